"""Adapters written by peft itself (no manifest) import into inkwell's form without loss."""

import peft
import pytest
import torch

from inkwell.adapters.errors import LayoutError
from inkwell.adapters.io import read_external_adapter
from inkwell.adapters.reference import apply_lora
from inkwell.models import base_model_identity, load_base_config, load_base_model


def _peft_trained_like(tiny_model_dir, out, target_modules, target_parameters):
    model = load_base_model(tiny_model_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, target_parameters=target_parameters)
    peft_model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        # shared-outer: gate_up A and down B identical across experts, as inkwell's form requires
        for layer in peft_model.base_model.model.model.layers[1:]:
            inner = layer.mlp.experts.base_layer  # gate_up_proj (listed first)
            a = inner.lora_A["default"].weight.view(8, 4, -1)
            a.copy_(a[:1].expand_as(a).clone())
            b = layer.mlp.experts.lora_B["default"].weight.view(128, 4, 8)
            b.copy_(b[:, :, :1].expand_as(b).clone())
    peft_model.save_pretrained(str(out))
    return peft_model.eval()


def test_peft_written_adapter_imports_with_the_same_logits(tiny_model_dir, tmp_path):
    attn = [
        f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj")
    ]
    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2, 3) for p in ("gate_up_proj", "down_proj")]
    theirs = _peft_trained_like(tiny_model_dir, tmp_path / "p", attn, experts)
    config = load_base_config(tiny_model_dir)
    adapter = read_external_adapter(tmp_path / "p", "peft", config, base_model_identity(tiny_model_dir))
    assert set(adapter.spec.targets) == {"attn", "experts"} and adapter.spec.rank == 4
    ours = load_base_model(tiny_model_dir)
    apply_lora(ours, adapter)
    ids = torch.randint(0, 263, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() < 1e-5


def test_non_inkling_peft_adapter_is_refused(tiny_model_dir, tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["query_key_value", "dense"]}'
    )
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    config = load_base_config(tiny_model_dir)
    with pytest.raises(LayoutError, match="'query_key_value' is not an Inkling module"):
        read_external_adapter(tmp_path, "peft", config, base_model_identity(tiny_model_dir))
