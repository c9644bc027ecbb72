"""Inkling base models on disk: create a preset checkpoint, load one, and name it.

A base model is a directory with `config.json` (transformers' `InklingTextConfig`),
`model.safetensors` and a tokenizer. transformers' `InklingForCausalLM` loads it and is the
numerical reference for every forward pass we write; it runs with eager attention because its
sdpa and flex paths drop the relative-position bias.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import InklingForCausalLM, InklingTextConfig

from inkwell.models.presets import preset_config
from inkwell.models.tokenizer import build_tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INKLING_MODEL_TYPE = "inkling_text"


class BaseModelError(ValueError):
    """A base-model directory that cannot be used, with what to do about it."""


@dataclass(frozen=True)
class BaseModelIdentity:
    """What an adapter records about the base it was trained on."""

    name: str
    config_sha256: str

    def to_dict(self) -> dict:
        return {"name": self.name, "config_sha256": self.config_sha256}

    @classmethod
    def from_dict(cls, data: dict) -> "BaseModelIdentity":
        return cls(name=data["name"], config_sha256=data["config_sha256"])


def _config_fingerprint(config: InklingTextConfig) -> str:
    """sha256 of the architecture-defining fields, so a re-saved config keeps its identity."""
    data = config.to_dict()
    keep = {k: v for k, v in sorted(data.items()) if not k.startswith("_") and k not in _VOLATILE_KEYS}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()


_VOLATILE_KEYS = {"transformers_version", "architectures", "dtype", "torch_dtype", "name_or_path", "inkwell_name"}


def init_base_model(preset: str, out_dir: str | Path, seed: int = 0, name: str | None = None) -> Path:
    """Write a deterministic HF-format checkpoint of a preset (same seed, same bytes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset)
    config.architectures = ["InklingForCausalLM"]
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = InklingForCausalLM(config)
    model.eval()
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, out / WEIGHTS_FILE, metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["inkwell_name"] = name or preset
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    build_tokenizer().save_pretrained(str(out))
    return out


def load_base_config(model_dir: str | Path) -> InklingTextConfig:
    """The config of a base-model directory, or a BaseModelError saying what is wrong."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise BaseModelError(
            f"{path}: missing; a base model directory needs {CONFIG_FILE} "
            f"(create one with `inkwell models init inkling-tiny DIR`)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BaseModelError(f"{path}: not valid JSON ({exc}); restore the file from the checkpoint") from exc
    model_type = data.get("model_type")
    if model_type != INKLING_MODEL_TYPE:
        raise BaseModelError(
            f"{path}: model_type is {model_type!r}, not {INKLING_MODEL_TYPE!r}; "
            "inkwell serves and trains Inkling text models only"
        )
    data = {k: v for k, v in data.items() if k not in {"inkwell_name", "transformers_version"}}
    return InklingTextConfig(**data)


def base_model_name(model_dir: str | Path) -> str:
    data = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    return data.get("inkwell_name") or Path(model_dir).name


def base_model_identity(model_dir: str | Path) -> BaseModelIdentity:
    return BaseModelIdentity(base_model_name(model_dir), _config_fingerprint(load_base_config(model_dir)))


def config_identity(config: InklingTextConfig, name: str) -> BaseModelIdentity:
    return BaseModelIdentity(name, _config_fingerprint(config))


# transformers 5.17 saves the embedding norm as `model.embed_norm`; 5.19 nests it in `embed_tokens`.
_WEIGHT_ALIASES = {"model.embed_norm.weight": "model.embed_tokens.embed_norm.weight"}


def canonical_weight_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under the transformers 5.19 names every inkwell model uses."""
    return {_WEIGHT_ALIASES.get(name, name): tensor for name, tensor in state.items()}


def installed_weight_names(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of canonical names under the names `model` (the installed transformers) expects."""
    expected = model.state_dict().keys()
    back = {new: old for old, new in _WEIGHT_ALIASES.items() if old in expected and new not in expected}
    return {back.get(name, name): tensor for name, tensor in state.items()}


def load_base_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by (5.19) transformers name, or a BaseModelError for a bad file."""
    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise BaseModelError(f"{path}: missing; the base model's weights must be in {WEIGHTS_FILE}")
    try:
        return canonical_weight_names(load_file(str(path)))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BaseModelError(f"{path}: corrupt safetensors file ({exc}); re-download or re-create it") from exc


def load_base_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> InklingForCausalLM:
    """transformers' InklingForCausalLM for a base-model directory, eager attention, eval mode."""
    config = load_base_config(model_dir)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = InklingForCausalLM(config)
    weights = installed_weight_names(load_base_weights(model_dir), model)
    missing = sorted(set(model.state_dict()) - set(weights))
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if missing or unexpected:
        raise BaseModelError(
            f"{Path(model_dir) / WEIGHTS_FILE}: does not match config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.load_state_dict(weights, assign=True, strict=True)
    return model.to(device=device, dtype=dtype).eval()
