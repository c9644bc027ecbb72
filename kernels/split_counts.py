"""The counts of split reductions: each program of a split adds one to its group's count once its partial is
written, and the program that brings the count to the number of splits sums the partials and resets it to zero.

One zeroed int32 buffer per (kernel, device), made on first use outside any graph capture (the decode graphs'
warm-up runs every kernel eagerly first), so a captured launch finds its counts at zero. Each kernel has its own
buffer: two kernels running at once on two streams must not share counts, and one kernel never runs beside
itself (the engine launches it on one stream).
"""

import torch

SPLIT_COUNTS = 4096  # groups per launch a buffer serves; a launch with more must not split
_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def split_counts(kernel: str, device: torch.device) -> torch.Tensor:
    """The zeroed counts of `kernel` on `device` (SPLIT_COUNTS of them)."""
    key = (kernel, device)
    if key not in _buffers:
        _buffers[key] = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
    return _buffers[key]
