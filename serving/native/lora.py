"""Adapter slots: preallocated LoRA buffers that a batch indexes per token, with LRU eviction and pinning.

Every adaptable weight gets one A and one B buffer with a leading slot dimension
(`max_loras_per_batch`) at `max_rank`; an adapter of a smaller rank is zero-padded. A slot's
scaling is zero for a target its adapter does not adapt, so stale buffer contents never leak into
another adapter. Copying an adapter in touches only its slot, so the other slots keep serving.

The memory is slot-major (see `slot_copy`): one [max_loras, slot_elems] buffer holds each slot's
A and B of every target back to back, and the per-buffer [S, ...] tensors the kernels index are
strided views into it. So one slot is one contiguous range, and writing an adapter is one copy of
its slot image; the slot's fp32 scalings [buffers] are in that range too, at its end.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import TARGET_GROUPS
from inkwell.kernels import ExpertGroups
from inkwell.models.base import BaseModelIdentity
from inkwell.serving.slot_copy import (
    EXPERT_DOWN_STACK,
    EXPERT_GATE_UP_STACK,
    ImageAdapter,
    check_adapter,
    slot_layout,
)

EXPERT_GROUPS = ("experts", "shared_experts")  # routed ids first, then shared: the order of the id space


class NoFreeSlotError(RuntimeError):
    """Every adapter slot holds an adapter that running requests or a pin keep resident."""


@dataclass
class SlotBuffer:
    """A and B for one adapted weight, all slots; `scalings[s]` is 0 where slot s does not adapt it.

    All three are views into `LoraSlots.memory` / `LoraSlots.scalings` (stride(0) is a whole slot)."""

    kind: str  # "linear" | "expert_in" | "expert_out", as in inkwell.adapters.targets
    a: torch.Tensor
    b: torch.Tensor
    scalings: torch.Tensor
    slice_offsets: tuple[int, ...] | None = None  # one LoRA over all output columns (see StackedBuffer)


@dataclass
class StackedBuffer:
    """A family of targets that one launch serves (its key in `LoraSlots.stacks`): A, B and scalings [S, P] as
    views into the same memory as their `SlotBuffer`s (shapes in `SlotStack`); for linears the outputs'
    column ranges."""

    a: torch.Tensor
    b: torch.Tensor
    scalings: torch.Tensor
    slice_offsets: tuple[int, ...] | None


@dataclass
class ExpertLora:
    """One MoE layer's expert LoRA, routed and shared experts as one id space (`groups`): gate/up A [S, 2*G*R, H]
    (each group's gate and up A, so the tokens' shrink is one launch), B [S, 2, E, F, R], scalings [S, 2*G];
    down A [S, E, R, F], B [S, G, H, R], scalings [S, G]."""

    groups: ExpertGroups
    gate_up: StackedBuffer
    down: StackedBuffer


class LoraSlots:
    """`max_loras` adapter slots over every target of `groups`, with refcounts, pins and LRU order."""

    def __init__(
        self,
        config: InklingTextConfig,
        identity: BaseModelIdentity,
        max_loras: int,
        max_rank: int,
        groups: tuple[str, ...] = TARGET_GROUPS,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras_per_batch must be at least 1, got {max_loras}")
        self.config = config
        self.identity = identity
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.groups = tuple(groups)
        self.layout = slot_layout(config, max_rank, self.groups, dtype)
        self.memory = torch.zeros((max_loras, self.layout.slot_elems), dtype=dtype, device=device)
        self.scalings = self.layout.scalings(self.memory)  # [max_loras, buffers] fp32, a view into memory
        self._slot_memory = self.memory.unbind()  # each slot's range, made once: a swap indexes nothing
        self.buffers: dict[str, SlotBuffer] = {}
        for j, entry in enumerate(self.layout.entries):
            a, b = self.layout.views(self.memory, entry)
            self.buffers[entry.module] = SlotBuffer(kind=entry.kind, a=a, b=b, scalings=self.scalings[:, j])
        self.stacks: dict[tuple[str, ...], StackedBuffer] = {}
        for stack in self.layout.stacks:
            a, b = self.layout.stack_views(self.memory, stack)
            scalings = self.scalings[:, stack.first_entry : stack.first_entry + len(stack.modules)]
            self.stacks[stack.modules] = StackedBuffer(a, b, scalings, stack.slice_offsets)
        self.experts = {layer: lora for layer in range(config.num_hidden_layers) if (lora := self._experts(layer))}
        self._slot_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._users: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._lru: OrderedDict[str, None] = OrderedDict()

    def _experts(self, layer: int) -> ExpertLora | None:
        """The layer's expert LoRA, if it has experts and an expert group is enabled."""
        cfg = self.config
        covered = [group for group in EXPERT_GROUPS if group in self.groups]
        if cfg.mlp_layer_types[layer] == "dense" or not covered:
            return None
        routed, shared = cfg.n_routed_experts, cfg.n_shared_experts
        if len(covered) == 2:
            groups = ExpertGroups(0, routed + shared, split=routed)
        else:
            groups = ExpertGroups(0, routed) if covered == ["experts"] else ExpertGroups(routed, shared)

        def stack(family: tuple[str, ...]) -> StackedBuffer:  # the family's enabled members, as laid out
            modules = (f"model.layers.{layer}.{name}" for name in family)
            return self.stacks[tuple(m for m in modules if m in self.buffers)]

        return ExpertLora(groups, stack(EXPERT_GATE_UP_STACK), stack(EXPERT_DOWN_STACK))

    def check(self, adapter: Adapter) -> None:
        """Raise AdapterIncompatibleError saying why `adapter` cannot go into these slots."""
        check_adapter(adapter, self.identity, self.layout)

    def slot_of(self, key: str) -> int | None:
        return self._slot_of.get(key)

    def resident(self) -> list[str]:
        return list(self._slot_of)

    def can_place(self, key: str) -> bool:
        return key in self._slot_of or len(self._slot_of) < self.max_loras or self._victim() is not None

    def _victim(self) -> str | None:
        for key in self._lru:
            if key not in self._pinned and self._users.get(key, 0) == 0:
                return key
        return None

    def place(self, key: str, adapter: Adapter) -> int:
        """The slot holding `key`, copying `adapter` into a free or least-recently-used idle slot."""
        if key in self._slot_of:
            return self._slot_of[key]
        self.check(adapter)
        if len(self._slot_of) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self._key_of))
        else:
            victim = self._victim()
            if victim is None:
                raise NoFreeSlotError(
                    f"all {self.max_loras} adapter slots are pinned or in use; raise max_loras_per_batch or unpin"
                )
            slot = self.evict(victim)
        if isinstance(adapter, ImageAdapter) and adapter.layout is self.layout:
            self.write_image(slot, adapter.flat)
        else:
            self.write_image(slot, self.slot_image(adapter))
        self._slot_of[key], self._key_of[slot] = slot, key
        self._lru[key] = None
        return slot

    def slot_image(self, adapter: Adapter, device: torch.device | str | None = None) -> torch.Tensor:
        """The exact contents of a slot holding `adapter` ([slot_elems], its scalings included).

        Built on `device`, by default where the adapter's tensors are (a host adapter is padded on the
        host and crosses to the slots in one copy)."""
        self.check(adapter)
        return self.layout.image(adapter, device)

    def write_image(self, slot: int, flat: torch.Tensor) -> None:
        """Overwrite slot `slot` with a slot image: one copy of its bytes."""
        if flat.shape != (self.layout.slot_elems,) or flat.dtype != self.layout.dtype:
            raise ValueError(
                f"a slot image is [{self.layout.slot_elems}] {self.layout.dtype}, got {list(flat.shape)} {flat.dtype}"
            )
        self._slot_memory[slot].copy_(flat, non_blocking=True)

    def evict(self, key: str) -> int:
        """Free `key`'s slot (it must be idle); returns the slot number."""
        if self._users.get(key, 0):
            raise NoFreeSlotError(f"adapter {key!r} is in use by running requests")
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        self._lru.pop(key, None)
        self._pinned.discard(key)
        self.disable(slot)
        return slot

    def disable(self, slot: int) -> None:
        """Zero `slot`'s scalings, so it adapts nothing whatever its buffers still hold."""
        self.scalings[slot].zero_()

    def pin(self, key: str, pinned: bool = True) -> None:
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)

    def acquire(self, key: str) -> int:
        """Mark one more running request on `key` (it must be resident); returns its slot."""
        self._users[key] = self._users.get(key, 0) + 1
        self._lru.move_to_end(key)
        return self._slot_of[key]

    def release(self, key: str) -> None:
        self._users[key] -= 1
        if not self._users[key]:
            del self._users[key]
