"""`write_slot`: an adapter lands in its slot zero-padded, and nothing of the slot's previous adapter leaks."""

import torch

from inkwell.adapters.targets import model_targets
from inkwell.models import base_model_identity, load_base_config
from inkwell.service.engine.lora import LoraSlots
from inkwell.service.engine.slot_copy import write_slot


def test_write_slot_pads_ranks_and_clears_the_previous_adapter(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=3, max_rank=16)
    for buf in slots.buffers.values():  # poison: every value the write must replace or leave alone is known
        buf.a.fill_(7.0)
        buf.b.fill_(7.0)
        buf.scalings.fill_(7.0)
    full, narrow = tiny_adapters[0], tiny_adapters[3]  # rank 8 over every group; rank 8 over attn only
    write_slot(slots, 1, full)
    write_slot(slots, 1, narrow)
    adapted = {t.module: t for t in model_targets(config, narrow.spec)}
    assert {t.module for t in model_targets(config, full.spec)} > set(adapted)
    for module, buf in slots.buffers.items():
        assert buf.scalings[0] == 7.0 and buf.scalings[2] == 7.0, module  # other slots untouched
        assert torch.all(buf.a[0] == 7.0) and torch.all(buf.b[2] == 7.0), module
        if module not in adapted:
            assert buf.scalings[1] == 0.0, module  # the full adapter's delta is switched off here
            continue
        target = adapted[module]
        a, b = narrow.factors(target)
        r = narrow.spec.rank_for(target.group)
        assert buf.scalings[1] == narrow.scaling(target)
        assert torch.equal(buf.a[1, :r], a) and torch.equal(buf.b[1, :, :r], b), module
        assert not buf.a[1, r:].any() and not buf.b[1, :, r:].any(), module  # padding is zero, not stale


def test_write_slot_places_expert_factors_in_their_layout(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=2, max_rank=16)
    adapter = tiny_adapters[2]  # rank 16 on the routed experts only
    write_slot(slots, 0, adapter)
    kinds = set()
    for target in model_targets(config, adapter.spec):
        buf = slots.buffers[target.module]
        a, b = adapter.factors(target)
        kinds.add(target.kind)
        got_a = buf.a[0, :, : a.shape[1]] if target.kind == "expert_out" else buf.a[0, : a.shape[0]]
        assert torch.equal(got_a, a) and torch.equal(buf.b[0, ..., : b.shape[-1]], b), target.module
        assert buf.scalings[0] == adapter.scaling(target)
    assert kinds == {"expert_in", "expert_out"}
