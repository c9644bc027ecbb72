"""One random adapter on inkling-tiny, three independent ways to apply it, the same logits."""

import peft
import pytest
import torch

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.io import load_adapter, save_adapter
from inkwell.adapters.merge import merge
from inkwell.adapters.reference import apply_lora
from inkwell.adapters.spec import TARGET_GROUPS, LoraSpec
from inkwell.models import (
    base_model_identity,
    installed_weight_names,
    load_base_config,
    load_base_model,
    load_base_weights,
)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=8, alpha=16, targets=TARGET_GROUPS)
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=7, b_std=0.05)
    ids = torch.randint(0, 263, (2, 72), generator=torch.Generator().manual_seed(0))  # crosses window 24, extent 48
    with torch.no_grad():
        model = load_base_model(tiny_model_dir)
        base_logits = model(ids).logits
        apply_lora(model, adapter)
        ref_logits = model(ids).logits
    return config, adapter, ids, base_logits, ref_logits


def test_reference_changes_the_model(setup):
    _, _, _, base_logits, ref_logits = setup
    assert (ref_logits - base_logits).abs().max() > 0.1


def test_merge_equals_reference(setup, tiny_model_dir):
    config, adapter, ids, _, ref_logits = setup
    model = load_base_model(tiny_model_dir)
    model.load_state_dict(installed_weight_names(merge(load_base_weights(tiny_model_dir), adapter, config), model))
    with torch.no_grad():
        assert (model(ids).logits - ref_logits).abs().max() < 1e-5


def test_peft_export_loaded_by_peft_equals_reference(setup, tiny_model_dir, tmp_path):
    config, adapter, ids, _, ref_logits = setup
    out = save_adapter(adapter, tmp_path / "peft", "peft", config)
    model = peft.PeftModel.from_pretrained(load_base_model(tiny_model_dir), str(out)).eval()
    with torch.no_grad():
        assert (model(ids).logits - ref_logits).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["peft", "sglang"])
def test_layouts_round_trip_bit_exactly(setup, tmp_path, layout):
    config, adapter, *_ = setup
    back = load_adapter(save_adapter(adapter, tmp_path / layout, layout, config), config)
    assert back.spec == adapter.spec and back.base == adapter.base
    assert set(back.tensors) == set(adapter.tensors)
    for name, tensor in adapter.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name


def test_an_adapter_loaded_from_one_layout_saves_in_the_other(setup, tmp_path):
    config, adapter, *_ = setup
    from_sglang = load_adapter(save_adapter(adapter, tmp_path / "s", "sglang", config), config)
    back = load_adapter(save_adapter(from_sglang, tmp_path / "p", "peft", config), config)
    assert all(torch.equal(back.tensors[k], v) for k, v in adapter.tensors.items())


def test_per_group_ranks_survive_the_peft_layout(tiny_model_dir, tmp_path):
    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=8, alpha=16, targets=("attn", "experts", "shared_experts"), ranks={"attn": 4})
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=3, b_std=0.05)
    ids = torch.randint(0, 263, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_base_model(tiny_model_dir)
        apply_lora(ref, adapter)
        out = save_adapter(adapter, tmp_path / "p", "peft", config)
        theirs = peft.PeftModel.from_pretrained(load_base_model(tiny_model_dir), str(out)).eval()
        assert (theirs(ids).logits - ref(ids).logits).abs().max() < 1e-5
    back = load_adapter(out, config)
    assert all(torch.equal(back.tensors[k], v) for k, v in adapter.tensors.items())
