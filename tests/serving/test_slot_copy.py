"""Slot-major LoRA memory and slot images: one copy writes exactly what per-tensor writes did, and an
adapter kept as its image comes back right after its slot was taken by others."""

import pytest
import torch

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.adapters.targets import model_targets
from inkwell.models import base_model_identity, load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.slot_copy import ALIGN, ImageAdapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [1, *range(40, 56)]


def per_tensor_write(slots: LoraSlots, slot: int, adapter: Adapter) -> None:
    """The reference: zero the slot's A and B of every target, copy each factor, set each scaling."""
    for buf in slots.buffers.values():
        buf.scalings[slot] = 0.0
    for target in model_targets(slots.config, adapter.spec):
        buf = slots.buffers[target.module]
        a, b = adapter.factors(target)
        r = adapter.spec.rank_for(target.group)
        buf.a[slot].zero_()
        buf.b[slot].zero_()
        (buf.a[slot, :, :r] if target.kind == "expert_out" else buf.a[slot, :r]).copy_(a)
        buf.b[slot, ..., :r].copy_(b)
        buf.scalings[slot] = adapter.scaling(target)


def mixed_adapters(model_dir, tiny_adapters) -> list[Adapter]:
    """The serving fixtures plus one with per-group ranks."""
    config = load_base_config(model_dir)
    spec = LoraSpec(rank=4, alpha=12, targets=("attn", "experts", "lm_head"), ranks={"experts": 16, "attn": 2})
    return [*tiny_adapters, init_adapter(config, spec, base_model_identity(model_dir), seed=9, b_std=0.05)]


def test_slot_image_writes_what_per_tensor_writes_did(tiny_model_dir, tiny_adapters):
    config, identity = load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir)
    ref = LoraSlots(config, identity, max_loras=3, max_rank=16)
    new = LoraSlots(config, identity, max_loras=3, max_rank=16)
    poison = torch.randn(new.memory.shape, generator=torch.Generator().manual_seed(0))
    for slots in (ref, new):  # every value a write must replace or leave alone is known and nonzero
        slots.memory.copy_(poison)
        slots.scalings.fill_(7.0)  # (in the slots' memory, at each slot's end)
    untouched = new.memory.clone()
    for adapter in mixed_adapters(tiny_model_dir, tiny_adapters):  # each over the previous one in slot 1
        per_tensor_write(ref, 1, adapter)
        new.write_image(1, new.slot_image(adapter))
        adapted = {t.module for t in model_targets(config, adapter.spec)}
        for module, buf in new.buffers.items():
            want = ref.buffers[module]
            assert torch.equal(buf.scalings, want.scalings), module
            if module in adapted:  # the factors, zero padding to max rank, in every view of every slot
                assert torch.equal(buf.a, want.a) and torch.equal(buf.b, want.b), module
            else:  # switched off by its zero scaling; the image also clears what the old write left stale
                assert buf.scalings[1] == 0 and not buf.a[1].any() and not buf.b[1].any(), module
        assert torch.equal(new.memory[0], untouched[0]) and torch.equal(new.memory[2], untouched[2])  # the others


def test_slot_memory_is_one_contiguous_range_per_slot(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=3, max_rank=8, dtype=torch.bfloat16)
    layout = slots.layout
    assert layout.slot_elems % ALIGN == 0
    ranges = sorted(
        (offset, offset + torch.Size(shape).numel())
        for entry in layout.entries
        for offset, shape in ((entry.a_offset, entry.a_shape), (entry.b_offset, entry.b_shape))
    )
    end = 0
    for start, stop in ranges:  # no overlap, all inside the slot; aligned unless it continues a family
        assert start >= end and (start % ALIGN == 0 or start == end)
        end = stop
    # the fp32 scalings follow the factors: two bf16 elements each, the last thing in the slot
    assert end <= layout.scalings_offset and layout.scalings_offset + 2 * len(layout.entries) <= layout.slot_elems
    assert slots.scalings.shape == (3, len(layout.entries)) and slots.scalings.dtype == torch.float32
    assert slots.scalings.untyped_storage().data_ptr() == slots.memory.untyped_storage().data_ptr()
    for j, (module, buf) in enumerate(slots.buffers.items()):
        assert buf.a.untyped_storage().data_ptr() == slots.memory.untyped_storage().data_ptr(), module
        assert buf.a.stride(0) == buf.b.stride(0) == layout.slot_elems, module
        assert buf.a.dtype == torch.bfloat16 and buf.scalings.dtype == torch.float32
        assert buf.scalings.data_ptr() == slots.scalings[:, j].data_ptr()
    slots.memory[1].fill_(1.0)  # a slot's range is exactly its views
    assert {len(modules) for modules in slots.stacks} == {4, 2}  # q/k/v/r and gate/up; routed+shared down
    for buf in slots.buffers.values():
        assert torch.all(buf.a[1] == 1) and torch.all(buf.b[1] == 1)
        assert not buf.a[0].any() and not buf.b[2].any()
    image = slots.slot_image(tiny_adapters[0])  # the image carries the scalings' bytes: one copy writes them
    slots.write_image(2, image)
    assert torch.equal(slots.scalings[2], layout.scalings(image)) and slots.scalings[2].max() == 2.0  # alpha/rank
    assert not slots.scalings[0].any()


def test_stacks_are_views_of_their_members(tiny_model_dir):
    """A stack's A, B and scalings are exactly its members' factors side by side."""
    config = load_base_config(tiny_model_dir)
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=2, max_rank=8)
    torch.manual_seed(0)
    slots.memory.normal_()
    slots.scalings.normal_()
    layers = config.num_hidden_layers
    moe_layers = sum(kind != "dense" for kind in config.mlp_layer_types)
    assert len(slots.stacks) == layers + 2 * moe_layers
    for modules, stack in slots.stacks.items():
        members = [slots.buffers[m] for m in modules]
        kind = members[0].kind
        assert all(m.kind == kind for m in members), modules
        assert torch.equal(stack.a, torch.cat([m.a for m in members], dim=1)), modules
        assert torch.equal(stack.scalings, torch.stack([m.scalings for m in members], dim=1)), modules
        if kind == "linear":
            assert torch.equal(stack.b, torch.cat([m.b for m in members], dim=1)), modules
            widths = [m.b.shape[1] for m in members]
            assert stack.slice_offsets == tuple(sum(widths[:i]) for i in range(len(widths) + 1))
        elif kind == "expert_in":  # routed then shared experts' gates, then their ups: B [S, 2, E+n, F, R]
            assert [m.split(".")[-2:] for m in modules] == [
                ["experts", "gate_proj"],
                ["shared_experts", "gate_proj"],
                ["experts", "up_proj"],
                ["shared_experts", "up_proj"],
            ]
            for p in range(2):
                assert torch.equal(stack.b[:, p], torch.cat([m.b for m in members[2 * p : 2 * p + 2]], dim=1))
        else:  # down: A [S, E+n, R, F], one B per group [S, 2, H, R]
            assert torch.equal(stack.b, torch.stack([m.b for m in members], dim=1)), modules


def test_image_adapter_factors_and_placement_equal_the_adapter(tiny_model_dir, tiny_adapters):
    config, identity = load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir)
    slots = LoraSlots(config, identity, max_loras=2, max_rank=16)
    for k, adapter in enumerate(mixed_adapters(tiny_model_dir, tiny_adapters)):
        flat = slots.slot_image(adapter)
        image = ImageAdapter(adapter.spec, adapter.base, {}, slots.layout, flat)
        assert image.tensors.keys() == adapter.tensors.keys()
        assert all(torch.equal(image.tensors[n], t) for n, t in adapter.tensors.items())
        slot = slots.place(f"img{k}", image)
        assert torch.equal(slots.memory[slot], flat) and slots.scalings[slot].any()
        slots.evict(f"img{k}")
        assert not slots.scalings[slot].any()  # an evicted slot adapts nothing


def test_write_image_refuses_an_image_of_another_layout(tiny_model_dir, tiny_adapters):
    config, identity = load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir)
    slots = LoraSlots(config, identity, max_loras=2, max_rank=16)
    other = LoraSlots(config, identity, max_loras=2, max_rank=8)
    flat = other.slot_image(tiny_adapters[0])
    with pytest.raises(ValueError, match="slot image"):
        slots.write_image(0, flat)
    with pytest.raises(ValueError, match="slot image"):
        slots.write_image(0, slots.slot_image(tiny_adapters[0]).to(torch.float64))
    # an ImageAdapter of another layout is still placed right: padded again from its factors
    image = ImageAdapter(tiny_adapters[0].spec, tiny_adapters[0].base, {}, other.layout, flat)
    slot = slots.place("a0", image)
    assert torch.equal(slots.memory[slot], slots.slot_image(tiny_adapters[0]))


def test_evicted_image_adapters_come_back_right_after_their_source_is_reused(tiny_model_dir, tiny_adapters):
    """Five adapters through one staging row and two slots: every generation needs a readmission."""
    adapters = mixed_adapters(tiny_model_dir, tiny_adapters)
    config = EngineConfig(max_loras_per_batch=2, max_lora_rank=16)
    engine, reference = Engine(tiny_model_dir, config), Engine(tiny_model_dir, config)
    row = torch.empty(engine.lora.layout.slot_elems)  # stands for the loader's ring row
    for k, adapter in enumerate(adapters):
        reference.load_adapter(f"a{k}", adapter)
        layout = engine.lora.layout
        image = ImageAdapter(adapter.spec, adapter.base, {}, layout, layout.image(adapter, out=row))
        engine.load_adapter(f"a{k}", image)
        image.own()
    row.fill_(float("nan"))  # the row's next use must not reach any kept adapter
    for rnd in range(2):
        for k, adapter in enumerate(adapters):
            req = Request(f"r{rnd}{k}", PROMPT, GREEDY, f"a{k}")
            got = engine.generate([req])[req.request_id][0].token_ids
            assert got == reference.generate([req])[req.request_id][0].token_ids, (rnd, k)
            slot = engine.lora.slot_of(f"a{k}")
            assert torch.equal(engine.lora.memory[slot], engine.lora.slot_image(adapter))
    assert len(engine.lora.resident()) == 2
