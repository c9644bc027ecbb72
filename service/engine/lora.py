"""Adapter slots: preallocated LoRA buffers that a batch indexes per token, with LRU eviction and pinning.

Every adaptable weight gets one A and one B buffer with a leading slot dimension
(`max_loras_per_batch`) at `max_rank`; an adapter of a smaller rank is zero-padded. A slot's
scaling is zero for a target its adapter does not adapt, so stale buffer contents never leak into
another adapter. Copying an adapter in touches only its slot, so the other slots keep serving.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import MAX_RANK, TARGET_GROUPS, LoraSpec
from inkwell.adapters.targets import model_targets
from inkwell.models.base import BaseModelIdentity
from inkwell.service.engine.slot_copy import write_slot


class AdapterIncompatibleError(ValueError):
    """An adapter this engine cannot serve (other base, rank too high, group not enabled)."""


class NoFreeSlotError(RuntimeError):
    """Every adapter slot holds an adapter that running requests or a pin keep resident."""


@dataclass
class SlotBuffer:
    """A and B for one adapted weight, all slots; `scalings[s]` is 0 where slot s does not adapt it."""

    kind: str  # "linear" | "expert_in" | "expert_out", as in inkwell.adapters.targets
    a: torch.Tensor
    b: torch.Tensor
    scalings: torch.Tensor


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
        if not 1 <= max_rank <= MAX_RANK:
            raise ValueError(f"max_lora_rank must be between 1 and {MAX_RANK}, got {max_rank}")
        if max_loras < 1:
            raise ValueError(f"max_loras_per_batch must be at least 1, got {max_loras}")
        self.config = config
        self.identity = identity
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.groups = tuple(groups)
        self.buffers: dict[str, SlotBuffer] = {}
        for target in model_targets(config, LoraSpec(rank=max_rank, targets=self.groups)):
            shapes = target.shapes(max_rank)
            self.buffers[target.module] = SlotBuffer(
                kind=target.kind,
                a=torch.zeros((max_loras, *shapes["lora_A"]), dtype=dtype, device=device),
                b=torch.zeros((max_loras, *shapes["lora_B"]), dtype=dtype, device=device),
                scalings=torch.zeros(max_loras, dtype=torch.float32, device=device),
            )
        self._slot_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._users: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._lru: OrderedDict[str, None] = OrderedDict()

    def check(self, adapter: Adapter) -> None:
        """Raise AdapterIncompatibleError saying why `adapter` cannot go into these slots."""
        if adapter.base.config_sha256 != self.identity.config_sha256:
            raise AdapterIncompatibleError(
                f"adapter was trained on base {adapter.base.name!r} (config {adapter.base.config_sha256[:12]}), "
                f"this engine serves {self.identity.name!r} (config {self.identity.config_sha256[:12]})"
            )
        if adapter.spec.max_rank > self.max_rank:
            raise AdapterIncompatibleError(
                f"adapter rank {adapter.spec.max_rank} exceeds the engine's max_lora_rank {self.max_rank}; "
                "start the engine with a larger max_lora_rank"
            )
        extra = sorted(set(adapter.spec.targets) - set(self.groups))
        if extra:
            raise AdapterIncompatibleError(
                f"adapter targets {extra} are not enabled in this engine (enabled: {list(self.groups)})"
            )

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
        self._write(slot, adapter)
        self._slot_of[key], self._key_of[slot] = slot, key
        self._lru[key] = None
        return slot

    def _write(self, slot: int, adapter: Adapter) -> None:
        write_slot(self, slot, adapter)  # multi-tensor launches: a swap costs about one copy of its bytes

    def evict(self, key: str) -> int:
        """Free `key`'s slot (it must be idle); returns the slot number."""
        if self._users.get(key, 0):
            raise NoFreeSlotError(f"adapter {key!r} is in use by running requests")
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        self._lru.pop(key, None)
        self._pinned.discard(key)
        for buf in self.buffers.values():
            buf.scalings[slot] = 0.0
        return slot

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
