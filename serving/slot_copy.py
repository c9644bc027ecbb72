"""Slot layout and slot images: an adapter as the exact bytes of one LoRA slot, so placing it is one copy.

The engine's LoRA memory is slot-major: one [max_loras, slot_elems] buffer in which each slot holds
every target's A and B at max rank, back to back (`SlotLayout` says where). A *slot image* is one
slot's bytes for a given adapter: its factors in the rank-r corners, zeros everywhere else, plus a
fp32 vector of per-buffer scalings (0 where the adapter adapts nothing), which the slot keeps at its end (their
bytes, seen as fp32). Writing an adapter into a slot is then one `copy_` of its image, however many tensors it
has (inkling-small: 346), instead of hundreds of views, zero fills and per-tensor copies.

Targets that one launch serves together are laid out as families, their A's back to back and then
their B's, so one strided view stacks them (`SlotStack`): q/k/v/r (one input); the gate/up of routed and
shared experts (one input; gates first, then ups, so B is [2, routed + shared experts, F, R]); the down
projections of routed and shared experts (A [routed + shared experts, R, F]).

The layout depends only on (model config, max rank, target groups, dtype), and `slot_layout` is the
one place that computes it: the engine's `LoraSlots` and the adapter loader (which builds images on
the GPU for the worker to copy) call it with the same arguments and get the same layout. Within one
process equal arguments return the same object, so a check that an image fits some slots is an
identity test.
"""

import math
from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import MAX_RANK, LoraSpec
from inkwell.adapters.targets import model_targets
from inkwell.models.base import BaseModelIdentity
from inkwell.serving.contract import AdapterIncompatibleError

# Every A and B starts at a multiple of this many elements (128 bytes in bf16), and so does every
# slot: the kernels' base pointers keep the alignment they had with one allocation per buffer.
ALIGN = 64
# Targets of one layer that one launch serves: their A's sit back to back in a slot, then their B's, and
# a strided view stacks them (`SlotStack`). The engine runs routed and shared experts as one id space
# (shared ids after the routed), so the expert families list routed before shared, gate before up.
QKVR_STACK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.r_proj")
EXPERT_GATE_UP_STACK = (
    "mlp.experts.gate_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.shared_experts.up_proj",
)
EXPERT_DOWN_STACK = ("mlp.experts.down_proj", "mlp.shared_experts.down_proj")
STACKS = (QKVR_STACK, EXPERT_GATE_UP_STACK, EXPERT_DOWN_STACK)


@dataclass(frozen=True)
class SlotEntry:
    """One adapted weight's A and B in a slot: shapes at max rank and element offsets into the slot."""

    module: str
    group: str
    kind: str  # "linear" | "expert_in" | "expert_out", as in inkwell.adapters.targets
    a_shape: tuple[int, ...]
    a_offset: int
    b_shape: tuple[int, ...]
    b_offset: int


@dataclass(frozen=True)
class SlotStack:
    """A family's factors, contiguous in a slot, as one A and one B. Linears: A stacked along the rank
    [P*R, K], B along the output [N_1+...+N_P, R]. Expert gate/up (G groups, gates then ups): A [2*G*R, K],
    B [2, E, F, R]. Expert down: A [E, R, F], B [G, H, R]."""

    modules: tuple[str, ...]
    first_entry: int  # entries first_entry .. first_entry + P - 1, so scalings[:, that range] is [S, P]
    a_offset: int
    a_shape: tuple[int, ...]
    b_offset: int
    b_shape: tuple[int, ...]
    slice_offsets: tuple[int, ...] | None  # linears: (0, N_1, N_1+N_2, ..., N), the outputs' column ranges


def _view(memory: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`shape` at `offset` of the last dim of `memory` ([..., slot_elems]); leading dims stay (strided)."""
    return memory[..., offset : offset + math.prod(shape)].unflatten(-1, shape)


@dataclass(frozen=True)
class SlotLayout:
    """Where every target of `groups` sits in one slot of `slot_elems` elements of `dtype`."""

    entries: tuple[SlotEntry, ...]  # also the order of a slot's scalings
    slot_elems: int
    max_rank: int
    groups: tuple[str, ...]
    dtype: torch.dtype
    stacks: tuple[SlotStack, ...]
    scalings_offset: int  # where the slot's fp32 scalings start, in elements of `dtype`

    def scalings(self, memory: torch.Tensor) -> torch.Tensor:
        """The fp32 scalings in `memory`: [S, entries] views of a whole [S, slot_elems] buffer, [entries] of an
        image. They are the bytes at `scalings_offset` seen as fp32, so one copy of a slot carries them too."""
        elems = _scaling_elems(len(self.entries), self.dtype)
        region = memory[..., self.scalings_offset : self.scalings_offset + elems]
        return region.view(torch.float32)[..., : len(self.entries)]

    def views(self, memory: torch.Tensor, entry: SlotEntry) -> tuple[torch.Tensor, torch.Tensor]:
        """`entry`'s A and B in `memory`: a whole [S, slot_elems] buffer gives [S, ...] views, an image [...]."""
        return _view(memory, entry.a_offset, entry.a_shape), _view(memory, entry.b_offset, entry.b_shape)

    def stack_views(self, memory: torch.Tensor, stack: SlotStack) -> tuple[torch.Tensor, torch.Tensor]:
        """`stack`'s stacked A and B in `memory`, like `views`."""
        return _view(memory, stack.a_offset, stack.a_shape), _view(memory, stack.b_offset, stack.b_shape)

    def image(
        self, adapter: Adapter, device: torch.device | str | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`adapter`'s slot image [slot_elems], scalings included, built on `device` (default: where its tensors
        are); `out` ([slot_elems] of this dtype) is filled instead of a new buffer."""
        if out is None:
            if device is None:
                device = next(iter(adapter.tensors.values())).device
            out = torch.empty(self.slot_elems, dtype=self.dtype, device=device)
        elif tuple(out.shape) != (self.slot_elems,) or out.dtype != self.dtype:
            raise ValueError(f"an image is [{self.slot_elems}] {self.dtype}, got {tuple(out.shape)} {out.dtype}")
        out.zero_()
        spec = adapter.spec
        scale = [0.0] * len(self.entries)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for j, entry in enumerate(self.entries):
            if entry.group not in spec.targets:
                continue
            r = spec.rank_for(entry.group)
            a, b = self.views(out, entry)
            for corner, name in ((a[..., :r, :], "lora_A"), (b[..., :r], "lora_B")):
                tensor = adapter.tensors[f"{entry.module}.{name}"]
                if tensor.shape != corner.shape:  # copy_ would broadcast a wrong shape silently
                    raise ValueError(f"{entry.module}.{name} is {tuple(tensor.shape)}, expected {tuple(corner.shape)}")
                dst.append(corner)
                src.append(tensor)
            scale[j] = spec.scaling_for(entry.group)
        if dst:
            torch._foreach_copy_(dst, src)  # multi-tensor launches; per-tensor copies across devices
        self.scalings(out).copy_(torch.tensor(scale, dtype=torch.float32))
        return out

    def factors(self, flat: torch.Tensor, spec: LoraSpec) -> dict[str, torch.Tensor]:
        """The tensors of the adapter of `spec` whose image is `flat`: views of its rank-r corners."""
        tensors = {}
        for entry in self.entries:
            if entry.group in spec.targets:
                r = spec.rank_for(entry.group)
                a, b = self.views(flat, entry)
                tensors[f"{entry.module}.lora_A"] = a[..., :r, :]
                tensors[f"{entry.module}.lora_B"] = b[..., :r]
        return tensors


_layouts: dict[tuple, SlotLayout] = {}


def slot_layout(config: InklingTextConfig, max_rank: int, groups: tuple[str, ...], dtype: torch.dtype) -> SlotLayout:
    """The slot layout of a model of `config` with LoRA slots of `max_rank` over `groups` in `dtype`."""
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"max_lora_rank must be between 1 and {MAX_RANK}, got {max_rank}")
    key = (config.to_json_string(), max_rank, tuple(groups), dtype)
    if key in _layouts:
        return _layouts[key]
    entries: list[SlotEntry] = []
    stacks: list[SlotStack] = []
    offset = 0

    def take(shapes: list[tuple[int, ...]]) -> list[int]:
        """Offsets of `shapes` back to back; whatever comes next starts aligned."""
        nonlocal offset
        starts = []
        for shape in shapes:
            starts.append(offset)
            offset += math.prod(shape)
        offset = -(-offset // ALIGN) * ALIGN
        return starts

    targets = model_targets(config, LoraSpec(rank=max_rank, targets=tuple(groups)))
    stacked = _family_members(targets)
    for target in targets:
        members = stacked.get(target.module, [target])
        if target is not members[0]:
            continue  # placed with its family
        shapes = [member.shapes(max_rank) for member in members]
        a_offsets = take([shape["lora_A"] for shape in shapes])  # a family's A's back to back, then its B's
        b_offsets = take([shape["lora_B"] for shape in shapes])
        for member, shape, a_offset, b_offset in zip(members, shapes, a_offsets, b_offsets, strict=True):
            entries.append(
                SlotEntry(
                    member.module, member.group, member.kind, shape["lora_A"], a_offset, shape["lora_B"], b_offset
                )
            )
        if target.module in stacked:
            stacks.append(_stack(entries[-len(members) :], len(entries) - len(members)))
    (scalings,) = take([(_scaling_elems(len(entries), dtype),)])
    _layouts[key] = SlotLayout(
        tuple(entries), max(offset, ALIGN), max_rank, tuple(groups), dtype, tuple(stacks), scalings
    )
    return _layouts[key]


def _scaling_elems(entries: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` that hold `entries` fp32 scalings (a whole number of fp32 values)."""
    return -(-entries * 4 // dtype.itemsize)


def _family_members(targets: list) -> dict[str, list]:
    """module -> the present targets of its `STACKS` family in its layer."""
    by_module = {t.module: t for t in targets}
    out: dict[str, list] = {}
    for layer in sorted({t.layer for t in targets if t.layer is not None}):
        for family in STACKS:
            members = [by_module[m] for m in (f"model.layers.{layer}.{name}" for name in family) if m in by_module]
            out.update({member.module: members for member in members})
    return out


def _stack(members: list[SlotEntry], first: int) -> SlotStack:
    """The stack of a family's entries (`first`: the first one's index), laid out back to back by `take`."""
    modules, kind, head = tuple(m.module for m in members), members[0].kind, members[0]
    a_shape = (sum(m.a_shape[0] for m in members), *head.a_shape[1:])  # A's stacked along their first dim
    if kind == "expert_in":  # gates of each group, then ups: A [2*G*R, H], B [2, E, F, R]
        experts = sum(m.b_shape[0] for m in members[: len(members) // 2])
        b_shape = (2, experts, *head.b_shape[1:])
        return SlotStack(modules, first, head.a_offset, a_shape, head.b_offset, b_shape, None)
    if kind == "expert_out":  # per-expert A's of the groups: A [E, R, F], B [G, H, R]
        return SlotStack(modules, first, head.a_offset, a_shape, head.b_offset, (len(members), *head.b_shape), None)
    bounds = [0]  # linears: A [P*R, K], B stacked along the output
    for m in members:
        bounds.append(bounds[-1] + m.b_shape[0])
    b_shape = (bounds[-1], head.b_shape[1])
    return SlotStack(modules, first, head.a_offset, a_shape, head.b_offset, b_shape, tuple(bounds))


class ImageAdapter(Adapter):
    """An adapter held as its slot image: placing it in a slot of the same layout is one copy.

    `tensors` are views of the image's rank-r corners (built on first use), so it is still a whole
    Adapter for anything that reads factors. An image that lives in someone else's memory (the
    loader's staging ring) is taken over with `own()` before that memory is handed back.
    """

    def __init__(self, spec: LoraSpec, base: BaseModelIdentity, metadata: dict, layout: SlotLayout, flat: torch.Tensor):
        self.spec, self.base, self.metadata = spec, base, metadata
        self.layout, self.flat = layout, flat
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self.layout.factors(self.flat, self.spec)
        return self._tensors

    def own(self) -> None:
        """Copy the image into memory of our own (on its device), so its source can be reused."""
        self.flat = self.flat.clone()
        self._tensors = None


def check_adapter(adapter: Adapter, identity: BaseModelIdentity, layout: SlotLayout) -> None:
    """Raise AdapterIncompatibleError saying why `adapter` cannot go into slots of `layout` on `identity`."""
    if adapter.base.config_sha256 != identity.config_sha256:
        raise AdapterIncompatibleError(
            f"adapter was trained on base {adapter.base.name!r} (config {adapter.base.config_sha256[:12]}), "
            f"this engine serves {identity.name!r} (config {identity.config_sha256[:12]})"
        )
    if adapter.spec.max_rank > layout.max_rank:
        raise AdapterIncompatibleError(
            f"adapter rank {adapter.spec.max_rank} exceeds the engine's max_lora_rank {layout.max_rank}; "
            "start the engine with a larger max_lora_rank"
        )
    extra = sorted(set(adapter.spec.targets) - set(layout.groups))
    if extra:
        raise AdapterIncompatibleError(
            f"adapter targets {extra} are not enabled in this engine (enabled: {list(layout.groups)})"
        )
