"""Inkling base models on disk: create a preset checkpoint, load one, and name it.

A base model is a directory with `config.json` (transformers' `InklingTextConfig`, or the released multimodal
config around one), its safetensors weights (one file or shards, transformers' or the released names; see
`models/checkpoint.py`) and a tokenizer. transformers' `InklingForCausalLM` loaded with those weights is the
numerical reference for every forward pass we write; it runs with eager attention because its sdpa and flex paths
drop the relative-position bias.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import InklingForCausalLM, InklingTextConfig

from inkwell.models.checkpoint import BaseCheckpoint
from inkwell.models.config import CONFIG_FILE, BaseModelError, load_base_config, read_config_json
from inkwell.models.names import installed_weight_names
from inkwell.models.presets import preset_config
from inkwell.models.shards import write_shards
from inkwell.models.tokenizer import build_tokenizer, load_tokenizer


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
    write_shards({k: v.detach() for k, v in model.state_dict().items()}, out)
    cfg = config.to_dict()
    cfg["inkwell_name"] = name or preset
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    build_tokenizer().save_pretrained(str(out))
    return out


def base_model_name(model_dir: str | Path) -> str:
    return read_config_json(model_dir).get("inkwell_name") or Path(model_dir).name


def base_model_identity(model_dir: str | Path) -> BaseModelIdentity:
    return BaseModelIdentity(base_model_name(model_dir), _config_fingerprint(load_base_config(model_dir)))


def config_identity(config: InklingTextConfig, name: str) -> BaseModelIdentity:
    return BaseModelIdentity(name, _config_fingerprint(config))


def load_base_weights(model_dir: str | Path) -> BaseCheckpoint:
    """The checkpoint's tensors by (5.19) transformers name, read lazily; a BaseModelError names what is wrong."""
    return BaseCheckpoint(model_dir)


def check_base_model(model_dir: str | Path) -> BaseCheckpoint:
    """The checkpoint of a base-model directory once everything a job or a serving worker reads is checked:
    config.json, every tensor there and of its shape (headers only, `BaseCheckpoint`), and the tokenizer."""
    checkpoint = load_base_weights(model_dir)
    try:
        tokens = len(load_tokenizer(model_dir))
    except (OSError, ValueError) as exc:
        raise BaseModelError(f"{model_dir}: no usable tokenizer ({exc})") from exc
    if tokens > checkpoint.config.vocab_size:
        raise BaseModelError(
            f"{model_dir}: the tokenizer has {tokens} tokens, more than the model's vocab_size "
            f"{checkpoint.config.vocab_size}"
        )
    return checkpoint


def load_base_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> InklingForCausalLM:
    """transformers' InklingForCausalLM for a base-model directory, eager attention, eval mode."""
    weights = load_base_weights(model_dir)
    config = weights.config
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = InklingForCausalLM(config)
    # the stored tensors become the parameters: the model is in memory once, then converted tensor by tensor
    model.load_state_dict(installed_weight_names(weights, model), assign=True, strict=True)
    return model.to(device=device, dtype=dtype).eval()
