"""A second CUDA stream for LoRA work that can overlap the base GEMMs, with fork/join by stream waits.

A projection's LoRA and its base GEMM read the same input, so the LoRA can run on a side stream beside
the GEMM (`EngineConfig.lora_side_stream`; at decode, `lora_linear`'s one launch does better). `fork()`
makes the side stream wait for everything already queued on the current stream and runs the block there;
`join()` makes the current stream wait for the side stream before the result is used. Both are stream
waits on events, which CUDA graph capture records as dependencies, so the schedule is capturable.

Memory stays safe without `record_stream`: blocks the side stream allocates return to the side
stream's pool, and the next fork waits for the current stream first, so a reuse is ordered after
every earlier use on either stream; callers allocate outputs the side stream writes on the
current stream and read them only after `join()`.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class SideStream:
    """One side stream on `device`, forked from and joined into whatever stream is current."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on the side stream, after the work queued so far on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the current stream wait for everything queued on the side stream."""
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
