"""Steps replayed from CUDA graphs: decode steps, one graph per (batch bucket, context bucket, LoRA on/off), and
short prefill steps, one per (batch bucket, chunk length bucket, context bucket, LoRA on/off).

An eager step of a 1B model launches hundreds of kernels and is bound by the host. A graph captured over
`DecodeForward` (or `ExtendForward`, for chunks of several tokens) replays them all in one launch: the step's
inputs are copied into the bucket's static buffers (one host-to-device copy) and the graph runs. Prefill steps
are captured where their chunks pad to at most `extend_tokens` token places: below that a replay, padding and all,
ends before an eager step's host has issued its launches (a prompt's tail after a cached prefix, a short chat turn,
and on an H200 up to 8 x 1,024 tokens); larger prefill steps run eagerly.
The LoRA slot buffers and the state pools are read and written in place, so an adapter swap, which rewrites a
slot's contents, needs no re-capture. Graphs are captured lazily on a bucket's first step, after a warm-up run
(Triton compiles, cuBLAS picks its workspaces) whose padding-only batch touches only the scratch state slot; all
graphs share one private memory pool, which is safe because replays run one at a time on one stream and each
graph's output buffer stays alive.

Each step also picks every row's greedy next token on the device (captured with the forward), so a
step reads back a few token ids instead of the logits, and the next step can take its input tokens
straight from this one's output without the host in between (`Engine` overlaps steps so). Each MoE layer's routed
expert ids stay in the graph's buffers; a step that records routing stacks them into one table after the replay
(`Decoded.routing`), so the graph itself launches nothing for them.

On the CPU (or with `graphs=False`) the same bucketed forward runs eagerly, which is how the CPU
tests check everything but the capture itself.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from inkwell.serving.contract import EngineConfig
from inkwell.serving.native.decode import DecodeForward, DecodeInputs
from inkwell.serving.native.extend import ExtendForward, ExtendInputs
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import InklingModel
from inkwell.serving.native.sampling import greedy_scores
from inkwell.serving.native.state import StatePool

MIN_CONTEXT_BUCKET = 256
MIN_CHUNK_BUCKET = 16


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def power_of_two_bucket(n: int, least: int) -> int:
    """The smallest power of two times `least` (itself a power of two) that is at least `n`."""
    size = least
    while size < n:
        size *= 2
    return size


def chunk_bucket(length: int) -> int:
    """Token places per chunk of a prefill step whose longest chunk has `length` tokens: a power of two, at least
    MIN_CHUNK_BUCKET."""
    return power_of_two_bucket(length, MIN_CHUNK_BUCKET)


def context_bucket(max_position: int, max_context: int) -> int:
    """Keys a step's full-attention layers read: the smallest power of two >= MIN_CONTEXT_BUCKET that
    covers `max_position`, capped by the pool's context."""
    return min(power_of_two_bucket(max_position + 1, MIN_CONTEXT_BUCKET), max_context)


class Decoded(NamedTuple):
    """A step's fp32 next-token logits [n, vocab] and each row's greedy next token [n] on the device, views of the
    graph's output buffers, valid until the next step; and `routing()`, its routed expert ids (long: decode [n, MoE
    layers, top_k], prefill chunks [n, chunk places, MoE layers, top_k]) stacked from each MoE layer's buffer: one
    launch, which only a step that records routing makes, before the next step."""

    logits: torch.Tensor
    greedy: torch.Tensor
    routing: Callable[[], torch.Tensor]


# what a captured step leaves in its buffers: logits, greedy tokens, each MoE layer's routed ids
StepOutputs = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


class StepGraphs:
    """Bucketed decode of up to `max_batch` sequences, and prefill chunks of up to `max_batch` sequences padding to
    at most `extend_tokens` token places, over `state`; replayed from CUDA graphs on CUDA.

    Takes one state slot from `state` for the padding rows and keeps it. `grouped_mm` as in `DecodeForward` (None:
    decide from dtype and device).
    """

    def __init__(
        self,
        model: InklingModel,
        state: StatePool,
        lora: LoraSlots | None,
        max_batch: int,
        graphs: bool = True,
        grouped_mm: bool | None = None,
        extend_tokens: int = 0,
    ):
        self.state = state
        self.has_lora = lora is not None and bool(lora.buffers)
        self.device = model.device
        self.scratch = state.acquire()
        self.decode_forward = DecodeForward(model, state, lora, grouped_mm)
        self.extend_forward = ExtendForward(model, state, lora, self.scratch, grouped_mm)
        self.buckets = batch_buckets(max_batch)
        self.extend_tokens = extend_tokens
        self.use_graphs = graphs and self.device.type == "cuda"
        self.decode_inputs = {b: DecodeInputs.empty(b, self.device) for b in self.buckets}
        self.extend_inputs: dict[tuple[int, int], ExtendInputs] = {}
        self.decode_graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self.extend_graphs: dict[tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @classmethod
    def of(cls, model: InklingModel, state: StatePool, lora: LoraSlots | None, config: EngineConfig) -> "StepGraphs":
        """The step graphs an engine of `config` runs (its sequences, its prefill limit)."""
        return cls(model, state, lora, config.max_seqs, extend_tokens=config.graph_prefill_tokens)

    # ---- decode --------------------------------------------------------------------------------------

    def decode(
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
        inputs = self.decode_inputs[batch]
        key = (batch, context, use_lora)

        def padding() -> torch.Tensor:
            return torch.tensor([[0] * batch, [self.scratch] * batch, [0] * batch, [-1] * batch], dtype=torch.long)

        def step() -> StepOutputs:
            routing: list[torch.Tensor] = []
            logits, greedy = greedy_scores(self.decode_forward(inputs, context, use_lora, routing))
            return logits, greedy, routing

        def fill() -> None:
            inputs.packed.copy_(packed, non_blocking=True)  # pageable memory: staged before the call returns
            if on_device:
                inputs.input_ids[:n].copy_(input_ids)

        logits, greedy, ids = self._run(self.decode_graphs, key, inputs.packed, padding, fill, step)
        model = self.decode_forward.model
        return Decoded(logits[:n], greedy[:n], lambda: model.routing_table(ids, batch)[:n])

    # ---- prefill chunks ------------------------------------------------------------------------------

    def extend_bucket(self, lengths: list[int]) -> tuple[int, int] | None:
        """The (batch, chunk places) bucket of a prefill step of chunks of `lengths` tokens, or None where it pads
        to more than `extend_tokens` places (that step runs eagerly)."""
        if len(lengths) > self.buckets[-1]:
            return None
        batch = next(b for b in self.buckets if b >= len(lengths))
        places = min(chunk_bucket(max(lengths)), self.state.max_context)
        return (batch, places) if batch * places <= self.extend_tokens else None

    def extend(
        self,
        input_ids: list[int],
        seq_slots: list[int],
        starts: list[int],
        lengths: list[int],
        lora_slots: list[int],
    ) -> Decoded:
        """The next-token logits and greedy token after each of n chunks (`lengths[i]` tokens of `input_ids`, in
        order, continuing sequence `seq_slots[i]` from position `starts[i]`), and every token place's routing;
        `extend_bucket(lengths)` must not be None."""
        n = len(lengths)
        batch, places = self.extend_bucket(lengths)
        last = max(start + length - 1 for start, length in zip(starts, lengths, strict=True))
        context = context_bucket(last, self.state.max_context)
        use_lora = self.has_lora and any(s >= 0 for s in lora_slots)
        columns = list(zip(seq_slots, starts, lengths, lora_slots, strict=True))
        packed = ExtendInputs.host(input_ids, columns, batch, places, self.scratch)
        inputs = self.extend_inputs.get((batch, places))
        if inputs is None:
            inputs = self.extend_inputs[(batch, places)] = ExtendInputs.empty(batch, places, self.device)
        key = (batch, places, context, use_lora)

        def step() -> StepOutputs:
            routing: list[torch.Tensor] = []
            logits, greedy = greedy_scores(self.extend_forward(inputs, context, use_lora, routing))
            return logits, greedy, routing

        def fill() -> None:
            inputs.packed.copy_(packed, non_blocking=True)

        def padding() -> torch.Tensor:
            return ExtendInputs.host([], [], batch, places, self.scratch)

        logits, greedy, ids = self._run(self.extend_graphs, key, inputs.packed, padding, fill, step)
        model = self.extend_forward.model

        def routing() -> torch.Tensor:
            table = model.routing_table(ids, batch * places)
            return table.view(batch, places, *table.shape[1:])[:n]

        return Decoded(logits[:n], greedy[:n], routing)

    # ---- capture and replay --------------------------------------------------------------------------

    def _run[K](
        self,
        graphs: dict[K, tuple[torch.cuda.CUDAGraph, StepOutputs]],
        key: K,
        packed: torch.Tensor,
        padding: Callable[[], torch.Tensor],
        fill: Callable[[], None],
        step: Callable[[], StepOutputs],
    ) -> StepOutputs:
        """Run `step` over the inputs `fill` writes to `packed`: eagerly, or replayed from the graph under `key`,
        captured first (over `padding()` inputs) where there is none yet."""
        if not self.use_graphs:
            fill()
            return step()
        if key not in graphs:
            graphs[key] = self._capture(packed, padding, step)
        fill()
        graph, out = graphs[key]
        graph.replay()
        return out

    def _capture(
        self, packed: torch.Tensor, padding: Callable[[], torch.Tensor], step: Callable[[], StepOutputs]
    ) -> tuple[torch.cuda.CUDAGraph, StepOutputs]:
        """Warm up on a side stream, then capture, both over padding inputs (scratch slot only)."""
        packed.copy_(padding())
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        return graph, out
