"""The step plan of a parallel engine: what rank 0 does to the memory every rank holds a slice of, sent in order.

Rank 0 runs the engine (scheduling, sampling, the adapter table, the prefix cache's tree) over its own shard.
Whatever it does to memory that every rank holds its own slice of is recorded as a typed op while it happens: an
adapter added or dropped, written into a slot or a slot emptied, a sequence slot cleared for a new sequence, a
prefix cached, split, restored into a slot or forgotten. The ops go out with the next forward, as
one `Step` (the ops, then the batch's chunks; its token ids, LoRA slots and scored rows follow as one device tensor),
and every other rank applies them in that order before it runs the same forward on its shard. So an adapter swapped
on a running group reaches every rank in the step it first serves.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.serving.native.group import RankGroup
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import ForwardBatch, Segment
from inkwell.serving.native.prefix_cache import PrefixStore
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


@dataclass(frozen=True)
class SavePrefix:
    """Keep sequence slot `slot`'s full-layer keys and values at positions start..end-1 as cached node `node`."""

    node: int
    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class SaveBoundary:
    """Keep sequence slot `slot`'s rings and conv states as cached node `node`'s boundary."""

    node: int
    slot: int


@dataclass(frozen=True)
class SplitPrefix:
    """Cached node `node`'s first `offset` tokens become node `upper`'s."""

    node: int
    upper: int
    offset: int


@dataclass(frozen=True)
class RestorePrefix:
    """Copy cached nodes (id, start) into sequence slot `slot`, then node `boundary`'s rings and conv states."""

    slot: int
    parts: tuple[tuple[int, int], ...]
    boundary: int


@dataclass(frozen=True)
class ForgetPrefixes:
    nodes: tuple[int, ...]


Op = (
    AddAdapter
    | DropAdapter
    | PlaceAdapter
    | EvictSlot
    | ClearState
    | SavePrefix
    | SaveBoundary
    | SplitPrefix
    | RestorePrefix
    | ForgetPrefixes
)


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


class RecordingPrefixStore(PrefixStore):
    """Rank 0's prefix copies: each prefix it caches, splits, restores into a slot or forgets is done on every rank
    (the tree that decides lives on rank 0 only)."""

    def __init__(self, plan: Plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan

    def save(self, node: int, slot: int, start: int, end: int) -> None:
        super().save(node, slot, start, end)
        self.plan.record(SavePrefix(node, slot, start, end))

    def save_boundary(self, node: int, slot: int) -> None:
        super().save_boundary(node, slot)
        self.plan.record(SaveBoundary(node, slot))

    def split(self, node: int, upper: int, offset: int) -> None:
        super().split(node, upper, offset)
        self.plan.record(SplitPrefix(node, upper, offset))

    def restore(self, slot: int, parts: tuple[tuple[int, int], ...], boundary: int) -> None:
        super().restore(slot, parts, boundary)
        self.plan.record(RestorePrefix(slot, parts, boundary))

    def forget(self, nodes: Iterable[int]) -> None:
        nodes = tuple(nodes)
        super().forget(nodes)
        self.plan.record(ForgetPrefixes(nodes))


class RankMemory:
    """Another rank's slices of what rank 0's ops change: its adapter slots (and the slot image of each adapter rank 0
    holds), its sequence state and its copies of the cached prefixes."""

    def __init__(self, state: StatePool, lora: LoraSlots, shard: Shard):
        self.state, self.lora, self.shard = state, lora, shard
        self.images: dict[str, torch.Tensor] = {}
        self.prefixes = PrefixStore(state)

    def apply(self, op: Op) -> None:
        match op:
            case AddAdapter(key=key, adapter=adapter):
                self.images[key] = self.lora.slot_image(self.shard.adapter(adapter))
            case DropAdapter(key=key):
                del self.images[key]
            case PlaceAdapter(slot=slot, key=key):
                self.lora.write_image(slot, self.images[key])
            case EvictSlot(slot=slot):
                self.lora.disable(slot)
            case ClearState(slot=slot):
                self.state.clear(slot)
            case SavePrefix(node=node, slot=slot, start=start, end=end):
                self.prefixes.save(node, slot, start, end)
            case SaveBoundary(node=node, slot=slot):
                self.prefixes.save_boundary(node, slot)
            case SplitPrefix(node=node, upper=upper, offset=offset):
                self.prefixes.split(node, upper, offset)
            case RestorePrefix(slot=slot, parts=parts, boundary=boundary):
                self.prefixes.restore(slot, parts, boundary)
            case ForgetPrefixes(nodes=nodes):
                self.prefixes.forget(nodes)


def follow(group: RankGroup, model: ShardedInklingModel, state: StatePool, lora: LoraSlots, shard: Shard) -> None:
    """Every other rank: apply rank 0's steps to this rank's shard until it stops the group."""
    memory = RankMemory(state, lora, shard)
    while not isinstance(message := group.receive(), Stop):
        for op in message.ops:
            memory.apply(op)
        tokens = sum(segment.length for segment in message.segments)
        packed = torch.empty(2 * tokens + message.scored, dtype=torch.long, device=model.device)
        ids, slots, scored = group.broadcast(packed).split([tokens, tokens, message.scored])
        model.forward(ForwardBatch(ids, slots, list(message.segments), scored), state, lora)
