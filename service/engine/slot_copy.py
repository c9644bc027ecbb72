"""Slot layout and slot images: an adapter as the exact bytes of one LoRA slot, so placing it is one copy.

The engine's LoRA memory is slot-major: one [max_loras, slot_elems] buffer in which each slot holds
every target's A and B at max rank, back to back (`SlotLayout` says where). A *slot image* is one
slot's bytes for a given adapter: its factors in the rank-r corners, zeros everywhere else, plus a
small fp32 vector of per-buffer scalings (0 where the adapter adapts nothing). Writing an adapter
into a slot is then one `copy_` of the image and one of its scalings, however many tensors it has
(inkling-small: 346), instead of hundreds of views, zero fills and per-tensor copies.

The layout depends only on (model config, max rank, target groups, dtype), and `slot_layout` is the
one place that computes it: the engine's `LoraSlots` and the adapter loader (which builds images on
the GPU for the worker to copy) call it with the same arguments and get the same layout. Within one
process equal arguments return the same object, so a check that an image fits some slots is an
identity test.
"""

from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import MAX_RANK, LoraSpec
from inkwell.adapters.targets import model_targets
from inkwell.models.base import BaseModelIdentity

# Every A and B starts at a multiple of this many elements (128 bytes in bf16), and so does every
# slot: the kernels' base pointers keep the alignment they had with one allocation per buffer.
ALIGN = 64


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


def _view(memory: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`shape` at `offset` of the last dim of `memory` ([..., slot_elems]); leading dims stay (strided)."""
    numel = 1
    for dim in shape:
        numel *= dim
    return memory[..., offset : offset + numel].unflatten(-1, shape)


@dataclass(frozen=True)
class SlotLayout:
    """Where every target of `groups` sits in one slot of `slot_elems` elements of `dtype`."""

    entries: tuple[SlotEntry, ...]  # also the order of a slot's scalings
    slot_elems: int
    max_rank: int
    groups: tuple[str, ...]
    dtype: torch.dtype

    def views(self, memory: torch.Tensor, entry: SlotEntry) -> tuple[torch.Tensor, torch.Tensor]:
        """`entry`'s A and B in `memory`: a whole [S, slot_elems] buffer gives [S, ...] views, an image [...]."""
        return _view(memory, entry.a_offset, entry.a_shape), _view(memory, entry.b_offset, entry.b_shape)

    def image(
        self, adapter: Adapter, device: torch.device | str | None = None, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`adapter`'s slot image (flat, scalings), built on `device` (default: where its tensors are).

        `out` ([slot_elems] of this dtype) is filled instead of a new buffer; the scalings go to its device.
        """
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
        return out, torch.tensor(scale, dtype=torch.float32).to(out.device)

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
    entries, offset = [], 0

    def take(shape: tuple[int, ...]) -> int:
        nonlocal offset
        start = offset
        numel = 1
        for dim in shape:
            numel *= dim
        offset = -(-(start + numel) // ALIGN) * ALIGN
        return start

    for target in model_targets(config, LoraSpec(rank=max_rank, targets=tuple(groups))):
        shapes = target.shapes(max_rank)
        a_offset = take(shapes["lora_A"])
        b_offset = take(shapes["lora_B"])
        entries.append(
            SlotEntry(target.module, target.group, target.kind, shapes["lora_A"], a_offset, shapes["lora_B"], b_offset)
        )
    _layouts[key] = SlotLayout(tuple(entries), max(offset, ALIGN), max_rank, tuple(groups), dtype)
    return _layouts[key]


class ImageAdapter(Adapter):
    """An adapter held as its slot image: placing it in a slot of the same layout is one copy.

    `tensors` are views of the image's rank-r corners (built on first use), so it is still a whole
    Adapter for anything that reads factors. An image that lives in someone else's memory (the
    loader's staging ring) is taken over with `own()` before that memory is handed back.
    """

    def __init__(
        self,
        spec: LoraSpec,
        base: BaseModelIdentity,
        metadata: dict,
        layout: SlotLayout,
        flat: torch.Tensor,
        scalings: torch.Tensor,
    ):
        self.spec, self.base, self.metadata = spec, base, metadata
        self.layout, self.flat, self.scalings = layout, flat, scalings
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self.layout.factors(self.flat, self.spec)
        return self._tensors

    def own(self) -> None:
        """Copy the image into memory of our own (on its device), so its source can be reused."""
        self.flat, self.scalings = self.flat.clone(), self.scalings.clone()
        self._tensors = None
