"""Copy an adapter into one LoRA slot in a handful of launches instead of a few per target.

An Inkling adapter has hundreds of A/B pairs (inkling-small, every group: 390 tensors), and a
per-tensor `zero_()` + `copy_()` + scaling fill costs four launches each: milliseconds of launch
latency for megabytes that the GPU moves in microseconds. `torch._foreach_*` groups the zeroing,
the copies and the per-target scalings into multi-tensor launches, so a swap costs about one
device copy of the adapter's bytes. On CPU the same calls run as plain loops (identical results),
and a source on another device (an adapter read from disk) falls back to per-tensor copies.
"""

from typing import TYPE_CHECKING

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.targets import model_targets

if TYPE_CHECKING:
    from inkwell.service.engine.lora import LoraSlots


def write_slot(slots: "LoraSlots", slot: int, adapter: Adapter) -> None:
    """Put `adapter` into slot `slot`: its factors zero-padded to max rank, scaling 0 where it adapts nothing."""
    scale = dict.fromkeys(slots.buffers, 0.0)
    cleared: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for target in model_targets(slots.config, adapter.spec):
        buf = slots.buffers[target.module]
        a, b = adapter.factors(target)
        r = adapter.spec.rank_for(target.group)
        cleared += [buf.a[slot], buf.b[slot]]
        dst += [buf.a[slot, :, :r] if target.kind == "expert_out" else buf.a[slot, :r], buf.b[slot, ..., :r]]
        src += [a, b]
        scale[target.module] = adapter.scaling(target)
    if cleared:
        torch._foreach_zero_(cleared)
        torch._foreach_copy_(dst, src, non_blocking=True)
    scalings = [buf.scalings[slot : slot + 1] for buf in slots.buffers.values()]
    torch._foreach_zero_(scalings)
    torch._foreach_add_(scalings, list(scale.values()))
