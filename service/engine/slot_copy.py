"""Copy an adapter into one LoRA slot in a handful of launches instead of a few per target.

An Inkling adapter has hundreds of A/B pairs (inkling-small, every group: 346 tensors), and a
per-tensor `zero_()` + `copy_()` + scaling fill costs four launches each: milliseconds of launch
latency for megabytes that the GPU moves in microseconds. `torch._foreach_*` groups the zeroing,
the copies and the per-target scalings into multi-tensor launches. The destination views of a
(slot, spec) pair are built once and kept (slot buffers are never reallocated), so a repeated swap
spends its host time on the launches, not on slicing hundreds of views. On CPU the same calls run
as plain loops (identical results); a source on another device (an adapter read from disk) falls
back to per-tensor copies.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.targets import model_targets

if TYPE_CHECKING:
    from inkwell.service.engine.lora import LoraSlots


@dataclass(frozen=True)
class _Plan:
    """Where one spec's factors go in one slot: every view the write touches, in source order."""

    names: list[str]  # adapter tensor names, matching `dst`
    cleared: list[torch.Tensor]  # the slot's whole A and B of every adapted target
    dst: list[torch.Tensor]  # the rank-r corner each factor is copied into
    scalings: list[torch.Tensor]  # the slot's scaling of every buffer (1-element views)
    scale: list[float]  # its value: the target's scaling, 0 where the spec adapts nothing


_plans: "WeakKeyDictionary[LoraSlots, dict[tuple[int, str], _Plan]]" = WeakKeyDictionary()


def _plan(slots: "LoraSlots", slot: int, adapter: Adapter) -> _Plan:
    cache = _plans.setdefault(slots, {})
    key = (slot, adapter.spec.model_dump_json())
    if key in cache:
        return cache[key]
    scale = dict.fromkeys(slots.buffers, 0.0)
    names: list[str] = []
    cleared: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for target in model_targets(slots.config, adapter.spec):
        buf = slots.buffers[target.module]
        r = adapter.spec.rank_for(target.group)
        names += [f"{target.module}.lora_A", f"{target.module}.lora_B"]
        cleared += [buf.a[slot], buf.b[slot]]
        dst += [buf.a[slot, :, :r] if target.kind == "expert_out" else buf.a[slot, :r], buf.b[slot, ..., :r]]
        scale[target.module] = adapter.scaling(target)
    scalings = [buf.scalings[slot : slot + 1] for buf in slots.buffers.values()]
    cache[key] = _Plan(names, cleared, dst, scalings, list(scale.values()))
    return cache[key]


def write_slot(slots: "LoraSlots", slot: int, adapter: Adapter) -> None:
    """Put `adapter` into slot `slot`: its factors zero-padded to max rank, scaling 0 where it adapts nothing."""
    plan = _plan(slots, slot, adapter)
    if plan.cleared:
        torch._foreach_zero_(plan.cleared)
        torch._foreach_copy_(plan.dst, [adapter.tensors[name] for name in plan.names], non_blocking=True)
    torch._foreach_zero_(plan.scalings)
    torch._foreach_add_(plan.scalings, plan.scale)
