"""Every way an adapter can be wrong gets its own error naming the tensor and the fix."""

import json

import pytest
import torch
from pydantic import ValidationError

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.errors import (
    BaseModelMismatchError,
    LayoutError,
    ManifestError,
    MissingModuleError,
    NonFiniteError,
    RankLimitError,
    ShapeMismatchError,
    UnknownModuleError,
)
from inkwell.adapters.io import load_adapter, save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.adapters.validate import validate
from inkwell.models import base_model_identity, init_base_model, load_base_config

Q_A = "model.layers.0.self_attn.q_proj.lora_A"


@pytest.fixture
def parts(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    identity = base_model_identity(tiny_model_dir)
    adapter = init_adapter(config, LoraSpec(rank=4, alpha=8), identity, seed=0, b_std=0.01)
    return config, identity, adapter


def _with(adapter: Adapter, **changes) -> Adapter:
    tensors = dict(adapter.tensors)
    for name, value in changes.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return Adapter(adapter.spec, tensors, adapter.base)


def test_a_good_adapter_validates(parts):
    config, identity, adapter = parts
    validate(adapter, config, identity)


def test_spec_errors_name_the_field():
    with pytest.raises(ValidationError, match="unknown target group 'mlpp'"):
        LoraSpec(targets=["attn", "mlpp"])
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        LoraSpec(rank=0)
    with pytest.raises(ValidationError, match="'lm_head' is not in targets"):
        LoraSpec(targets=["attn"], ranks={"lm_head": 4})


def test_wrong_shape(parts):
    config, identity, adapter = parts
    bad = _with(adapter, **{Q_A: torch.zeros(4, 64)})
    with pytest.raises(ShapeMismatchError, match=r"q_proj.lora_A.*\(4, 64\), expected \(4, 128\)") as exc:
        validate(bad, config, identity)
    assert exc.value.tensor == Q_A and exc.value.code == "shape_mismatch"


def test_unknown_and_missing_modules(parts):
    config, identity, adapter = parts
    with pytest.raises(UnknownModuleError, match="model.layers.0.self_attn.z_proj.lora_A"):
        validate(_with(adapter, **{"model.layers.0.self_attn.z_proj.lora_A": torch.zeros(4, 128)}), config)
    with pytest.raises(MissingModuleError, match=Q_A):
        validate(_with(adapter, **{Q_A: None}), config)


def test_rank_over_limit(parts):
    config, identity, adapter = parts
    with pytest.raises(RankLimitError, match="rank 4, over this server's limit 2"):
        validate(adapter, config, identity, max_rank=2)


def test_nan_and_inf(parts):
    config, identity, adapter = parts
    poisoned = adapter.tensors[Q_A].clone()
    poisoned[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=Q_A):
        validate(_with(adapter, **{Q_A: poisoned}), config)


def test_wrong_base_model(parts, tmp_path):
    config, _, adapter = parts
    other_dir = init_base_model("inkling-tiny", tmp_path / "other", seed=0, name="other")
    cfg = json.loads((other_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    cfg["layer_types"], cfg["mlp_layer_types"] = cfg["layer_types"][:2], cfg["mlp_layer_types"][:2]
    (other_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BaseModelMismatchError, match="use it with its own base model"):
        validate(adapter, config, base_model_identity(other_dir))


def test_unknown_layout(parts, tmp_path):
    config, _, adapter = parts
    with pytest.raises(LayoutError, match="choose one of sglang, peft"):
        save_adapter(adapter, tmp_path / "x", "onnx", config)


@pytest.mark.parametrize("layout", ["sglang", "peft"])
def test_manifest_catches_truncation_and_flipped_bytes(parts, tmp_path, layout):
    config, _, adapter = parts
    out = save_adapter(adapter, tmp_path / "a", layout, config)
    weights = out / "adapter_model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-100])
    with pytest.raises(ManifestError, match="truncated or altered"):
        load_adapter(out, config)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    weights.write_bytes(bytes(flipped))
    with pytest.raises(ManifestError, match="sha256 does not match"):
        load_adapter(out, config)
    (out / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="missing"):
        load_adapter(out, config)


def test_save_never_overwrites(parts, tmp_path):
    config, _, adapter = parts
    out = save_adapter(adapter, tmp_path / "a", "peft", config)
    with pytest.raises(FileExistsError):
        save_adapter(adapter, out, "peft", config)
