"""Adapters cross from the loader to its worker as slot images in a staging ring the worker maps once.

The loader builds each adapter's slot image (see `inkwell.serving.slot_copy`: the exact bytes
of one LoRA slot) in a row of a small ring of buffers it allocates once, on the engine's device. The
first staged adapter carries the ring itself through torch.multiprocessing (a CUDA IPC handle on GPU,
a shared-memory file descriptor on CPU), so the worker opens it once and keeps the mapping; every
later message carries only the row index and the adapter's metadata. A swap on the worker is then
one copy of the row into a slot, with no handle to open and no per-tensor views.

Rows are handed back with a `Release` message once the worker has copied its image out. On GPU
that copy is asynchronous: the worker records a CUDA IPC event after it (the event object crosses
once per row), and the loader waits on that event before it overwrites the row.
"""

from collections import deque
from dataclasses import dataclass

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models.base import BaseModelIdentity
from inkwell.serving.messages import Release
from inkwell.serving.slot_copy import ImageAdapter, SlotLayout

RING_SIZE = 2  # one row for the worker to copy from while the loader fills the next


@dataclass
class Ring:
    """The loader's staging rows: `flat[i]` is a slot image of `layout`."""

    flat: torch.Tensor  # [size, slot_elems], the engine's dtype
    layout: SlotLayout


@dataclass
class StagedAdapter:
    """One staged adapter: the ring row holding its image and what the image alone does not say."""

    index: int
    spec: str  # LoraSpec as JSON (the worker parses each distinct spec once)
    base: BaseModelIdentity
    metadata: dict
    ring: Ring | None  # the ring, on the first staged adapter only


class StagingRing:
    """The loader's end: `size` rows allocated once; `stage` fills a free row, `release` frees one."""

    def __init__(self, layout: SlotLayout, device: torch.device | str, size: int = RING_SIZE):
        device = torch.device(device)
        flat = torch.zeros((size, layout.slot_elems), dtype=layout.dtype, device=device)
        if device.type == "cpu":
            flat.share_memory_()
        self.ring = Ring(flat, layout)
        self.free: deque[int] = deque(range(size))
        self._sent = False
        self._copied: dict[int, torch.cuda.Event] = {}  # the worker's "copied out of row i" events
        # a GPU image is padded on the host and crosses in one copy, not one per tensor
        self._host = (
            torch.empty(layout.slot_elems, dtype=layout.dtype, pin_memory=True) if device.type == "cuda" else None
        )

    def stage(self, adapter: Adapter) -> StagedAdapter:
        """Write `adapter`'s slot image into a free row (there must be one) and describe it for the worker."""
        index = self.free[0]
        flat = self.ring.flat
        if index in self._copied:
            self._copied[index].synchronize()  # the worker's copy out of this row has finished
        if self._host is None:
            self.ring.layout.image(adapter, out=flat[index])
        else:
            flat[index].copy_(self.ring.layout.image(adapter, out=self._host))
            torch.cuda.synchronize(flat.device)  # the row is complete before the worker can read it
        self.free.popleft()
        ring, self._sent = (None if self._sent else self.ring), True
        return StagedAdapter(index, adapter.spec.model_dump_json(), adapter.base, dict(adapter.metadata), ring)

    def release(self, index: int, copied: torch.cuda.Event | None) -> None:
        """The worker is done with row `index`; `copied` is its event for that row, sent the first time."""
        if copied is not None:
            self._copied[index] = copied
        self.free.append(index)


class ImageReceiver:
    """The worker's end: keeps the ring mapped and turns each staged adapter into an `ImageAdapter`."""

    def __init__(self, layout: SlotLayout):
        self.layout = layout
        self.ring: Ring | None = None
        self._rows: list[torch.Tensor] = []  # each row's image, a view made once
        self._specs: dict[str, LoraSpec] = {}
        self._events: dict[int, torch.cuda.Event] = {}

    def adapter(self, staged: StagedAdapter) -> ImageAdapter:
        """The staged adapter, its image still in the ring row (place it, then `release` the row)."""
        if staged.ring is not None:
            if staged.ring.layout != self.layout:
                raise RuntimeError("the loader's slot layout differs from the worker's: same model, rank and groups?")
            self.ring = staged.ring
            self._rows = list(staged.ring.flat.unbind())
        if self.ring is None:
            raise RuntimeError("a staged adapter arrived before the loader's ring")
        spec = self._specs.get(staged.spec)
        if spec is None:
            spec = self._specs[staged.spec] = LoraSpec.model_validate_json(staged.spec)
        return ImageAdapter(spec, staged.base, staged.metadata, self.layout, self._rows[staged.index])

    def release(self, staged: StagedAdapter, kept: ImageAdapter | None) -> Release:
        """The message that hands `staged`'s row back, after `kept` (an adapter the engine keeps) owns its image."""
        if kept is not None:
            kept.own()
        row, event = staged.index, None
        if self.ring.flat.is_cuda:  # the copies out of the row are queued, not done: an event marks their end
            first = row not in self._events
            if first:
                self._events[row] = torch.cuda.Event(interprocess=True)
            self._events[row].record(torch.cuda.current_stream(self.ring.flat.device))
            event = self._events[row] if first else None
        return Release(row, event)

    def close(self) -> None:
        """Drop the ring mapping (before the loader that owns it exits)."""
        self.ring = None
        self._rows = []
        self._events.clear()
