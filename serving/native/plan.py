"""The step plan of a parallel engine: what rank 0 does to the memory every rank holds a slice of, sent in order.

Rank 0 runs the engine (scheduling, sampling, the adapter table) over its own shard. Whatever it does to memory that
every rank holds its own slice of is recorded as a typed op while it happens: an adapter added or dropped, written
into a slot or a slot emptied, a sequence slot cleared for a new sequence. The ops go out with the next forward, as
one `Step` (the ops, then the batch's chunks; its token ids, LoRA slots and scored rows follow as one device tensor),
and every other rank applies them in that order before it runs the same forward on its shard. So an adapter swapped
on a running group reaches every rank in the step it first serves.
"""

from dataclasses import dataclass

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.serving.native.group import RankGroup
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import ForwardBatch, Segment
from inkwell.serving.native.sharded_model import ShardedInklingModel
from inkwell.serving.native.shards import Shard
from inkwell.serving.native.state import StatePool


@dataclass(frozen=True)
class AddAdapter:
    """Keep `adapter` (whole, on the host) under `key`; each rank builds the slot image of its slices once."""

    key: str
    adapter: Adapter


@dataclass(frozen=True)
class DropAdapter:
    key: str


@dataclass(frozen=True)
class PlaceAdapter:
    """Write adapter `key`'s slot image into LoRA slot `slot`."""

    slot: int
    key: str


@dataclass(frozen=True)
class EvictSlot:
    """LoRA slot `slot` adapts nothing any more."""

    slot: int


@dataclass(frozen=True)
class ClearState:
    """Sequence slot `slot` starts a new sequence."""

    slot: int


Op = AddAdapter | DropAdapter | PlaceAdapter | EvictSlot | ClearState


@dataclass(frozen=True)
class Step:
    """The ops since the last step, then one forward over `segments` scoring `scored` rows."""

    ops: tuple[Op, ...]
    segments: tuple[Segment, ...]
    scored: int


@dataclass(frozen=True)
class Stop:
    """The group ends: every other rank returns from `follow`."""


def host_copy(adapter: Adapter) -> Adapter:
    """`adapter` with its own host tensors (a slot image's views would take the whole image along when pickled)."""
    tensors = {name: tensor.to("cpu", copy=True) for name, tensor in adapter.tensors.items()}
    return Adapter(adapter.spec, tensors, adapter.base, dict(adapter.metadata))


class Plan:
    """Rank 0's ops since the last step; `group` is set once the ranks have joined."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.group: RankGroup | None = None

    def record(self, op: Op) -> None:
        self.ops.append(op)

    def send_step(self, batch: ForwardBatch) -> None:
        """Send the ops and `batch` to every other rank (before rank 0 runs it)."""
        ops, self.ops = tuple(self.ops), []
        self.group.send(Step(ops, tuple(batch.segments), batch.logit_rows.shape[0]))
        self.group.broadcast(torch.cat([batch.input_ids, batch.lora_slots, batch.logit_rows]))

    def send_stop(self) -> None:
        self.group.send(Stop())


class LeadingModel(ShardedInklingModel):
    """Rank 0's model: each forward is sent to the other ranks (with the ops before it) as it starts."""

    def __init__(self, plan: Plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan

    def forward(self, batch: ForwardBatch, state: StatePool, lora: LoraSlots | None = None, routing=None):
        self.plan.send_step(batch)
        return super().forward(batch, state, lora, routing)


class RecordingStatePool(StatePool):
    """Rank 0's state: each sequence slot it hands out is cleared on every rank."""

    def __init__(self, plan: Plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan

    def acquire(self) -> int:
        slot = super().acquire()
        self.plan.record(ClearState(slot))
        return slot


class RecordingLoraSlots(LoraSlots):
    """Rank 0's adapter slots: each adapter written into a slot, and each slot emptied, is done on every rank."""

    def __init__(self, plan: Plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan

    def place(self, key: str, adapter: Adapter) -> int:
        placed = self.slot_of(key) is None
        slot = super().place(key, adapter)
        if placed:
            self.plan.record(PlaceAdapter(slot, key))
        return slot

    def evict(self, key: str) -> int:
        slot = super().evict(key)
        self.plan.record(EvictSlot(slot))
        return slot


def follow(group: RankGroup, model: ShardedInklingModel, state: StatePool, lora: LoraSlots, shard: Shard) -> None:
    """Every other rank: apply rank 0's steps to this rank's shard until it stops the group."""
    images: dict[str, torch.Tensor] = {}  # this rank's slot image of each adapter rank 0 holds
    while not isinstance(message := group.receive(), Stop):
        for op in message.ops:
            match op:
                case AddAdapter(key=key, adapter=adapter):
                    images[key] = lora.slot_image(shard.adapter(adapter))
                case DropAdapter(key=key):
                    del images[key]
                case PlaceAdapter(slot=slot, key=key):
                    lora.write_image(slot, images[key])
                case EvictSlot(slot=slot):
                    lora.disable(slot)
                case ClearState(slot=slot):
                    state.clear(slot)
        tokens = sum(segment.length for segment in message.segments)
        packed = torch.empty(2 * tokens + message.scored, dtype=torch.long, device=model.device)
        ids, slots, scored = group.broadcast(packed).split([tokens, tokens, message.scored])
        model.forward(ForwardBatch(ids, slots, list(message.segments), scored), state, lora)
