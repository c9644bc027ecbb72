"""Decode steps replayed from CUDA graphs, one per (batch bucket, context bucket, LoRA on/off).

An eager decode step of a 1B model launches hundreds of kernels and is bound by the host. A graph
captured over `DecodeForward` replays them all in one launch: the step's inputs are copied into the
bucket's static buffers (one host-to-device copy) and the graph runs. The LoRA slot buffers and
the state pools are read and written in place, so an adapter swap, which rewrites a slot's
contents, needs no re-capture. Graphs are captured lazily on a bucket's first step, after a
warm-up run (Triton compiles, cuBLAS picks its workspaces) whose padding-only batch touches only
the scratch state slot; all graphs share one private memory pool, which is safe because replays
run one at a time on one stream and each graph's output buffer stays alive.

Each step also picks every row's greedy next token on the device (captured with the forward), so a
step reads back a few token ids instead of the logits, and the next step can take its input tokens
straight from this one's output without the host in between (`Engine` overlaps steps so). Every row's
routed expert ids come out the same way (one small copy per step), for requests that record routing.

On the CPU (or with `graphs=False`) the same bucketed forward runs eagerly, which is how the CPU
tests check everything but the capture itself.
"""

from typing import NamedTuple

import torch

from inkwell.serving.native.decode import DecodeForward, DecodeInputs
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import InklingModel
from inkwell.serving.native.state import StatePool

MIN_CONTEXT_BUCKET = 256


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def context_bucket(max_position: int, max_context: int) -> int:
    """Keys a step's full-attention layers read: the smallest power of two >= MIN_CONTEXT_BUCKET that
    covers `max_position`, capped by the pool's context."""
    size = MIN_CONTEXT_BUCKET
    while size <= max_position:
        size *= 2
    return min(size, max_context)


class Decoded(NamedTuple):
    """A decode step's fp32 next-token logits [n, vocab], each row's greedy next token [n] and routed expert ids
    [n, MoE layers, top_k] (long), on the device; views of the graph's output buffers, valid until the next step."""

    logits: torch.Tensor
    greedy: torch.Tensor
    routing: torch.Tensor


class CudaGraphDecoder:
    """Bucketed decode of up to `max_batch` sequences over `state`, replayed from CUDA graphs on CUDA.

    Takes one state slot from `state` for the padding rows and keeps it. `grouped_mm` as in
    `DecodeForward` (None: decide from dtype and device).
    """

    def __init__(
        self,
        model: InklingModel,
        state: StatePool,
        lora: LoraSlots | None,
        max_batch: int,
        graphs: bool = True,
        grouped_mm: bool | None = None,
    ):
        self.forward = DecodeForward(model, state, lora, grouped_mm)
        self.state = state
        self.has_lora = lora is not None and bool(lora.buffers)
        self.device = model.device
        self.scratch = state.acquire()
        self.buckets = batch_buckets(max_batch)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.inputs = {b: DecodeInputs.empty(b, self.device) for b in self.buckets}
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, Decoded]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def __call__(
        self,
        input_ids: list[int] | torch.Tensor,
        seq_slots: list[int],
        positions: list[int],
        lora_slots: list[int],
    ) -> Decoded:
        """The next-token logits and greedy tokens of n one-token rows. `input_ids` on the device (a [n] long
        tensor, say the greedy tokens of the step before) are copied in on the device, so the host need not
        wait for them."""
        n = len(seq_slots)
        on_device = isinstance(input_ids, torch.Tensor)
        batch = next(b for b in self.buckets if b >= n)
        context = context_bucket(max(positions), self.state.max_context)
        use_lora = self.has_lora and any(s >= 0 for s in lora_slots)
        pad = batch - n
        packed = torch.tensor(
            [
                [0] * batch if on_device else input_ids + [0] * pad,
                seq_slots + [self.scratch] * pad,
                positions + [0] * pad,
                lora_slots + [-1] * pad,
            ],
            dtype=torch.long,
        )
        inputs = self.inputs[batch]
        key = (batch, context, use_lora)
        if self.use_graphs and key not in self.graphs:
            self.graphs[key] = self._capture(inputs, context, use_lora)
        inputs.packed.copy_(packed, non_blocking=True)  # pageable memory: staged before the call returns
        if on_device:
            inputs.input_ids[:n].copy_(input_ids)
        if not self.use_graphs:
            out = self._step(inputs, context, use_lora)
        else:
            graph, out = self.graphs[key]
            graph.replay()
        return Decoded(out.logits[:n], out.greedy[:n], out.routing[:n])

    def _step(self, inputs: DecodeInputs, context: int, use_lora: bool) -> Decoded:
        routing: list[torch.Tensor] = []
        logits = self.forward(inputs, context, use_lora, routing)
        return Decoded(logits, logits.argmax(-1), self.forward.model.routing_table(routing, logits.shape[0]))

    def _capture(self, inputs: DecodeInputs, context: int, use_lora: bool) -> tuple[torch.cuda.CUDAGraph, Decoded]:
        """Warm up on a side stream, then capture, both over a padding-only batch (scratch slot only)."""
        batch = inputs.packed.shape[1]
        padding = torch.tensor([[0] * batch, [self.scratch] * batch, [0] * batch, [-1] * batch], dtype=torch.long)
        inputs.packed.copy_(padding)
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):
            for _ in range(2):
                self._step(inputs, context, use_lora)
        torch.cuda.current_stream(self.device).wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._step(inputs, context, use_lora)
        return graph, out
