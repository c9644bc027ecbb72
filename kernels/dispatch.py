"""Multi-LoRA ops that run the Triton kernels on CUDA tensors and the pure-torch twins elsewhere.

Same signatures as `inkwell.kernels.torch_ops`. The sliced ops (fused q/k/v/r and gate/up
projections) and the fused shrink+expand are defined here for every device: their torch form is
the composition of the reference ops over the slices, which the Triton kernels must equal.
Triton is imported only when a CUDA tensor arrives, so CPU processes never load it.
"""

from types import ModuleType

import torch
import torch.nn.functional as F

from inkwell.kernels import torch_ops
from inkwell.kernels.torch_ops import ExpertGroups, RowExpand

# On CUDA, up to FUSED_MAX_TOKENS tokens (decode) lora_linear is one Triton GEMM with the LoRA beside it and in its
# epilogue, and lora_shrink_expand is one launch up to FUSED_MAX_N columns too: past them every column tile
# re-reading its slot's A costs more than a second launch saves (H200 timings in docs/benchmarks.md). Projections
# of at most FUSED_MAX_N columns (attention's) stay one GEMM up to FUSED_NARROW_MAX_TOKENS: at 64 tokens it beat
# cuBLAS and the LoRA after it (qkvr 11.8-14.6 µs against 18.3-18.7), where wider ones lost (lm_head 75-81 against
# 50-62). At 128 tokens, in two 64-token tiles, o took 11.1-13.5 µs against 14.6-15.6 and q/k/v/r 18.6-21.8 against
# 17.4-24.2 (H100, 1-8 adapters), and 128-sequence decode gained 1.6% / 3.1% with 1 / 8 adapters; q/k/v/r's 64-column
# tiles there (13.1-18.7 µs against 18.3-21.6 in 32-column ones) another 0.6% / 2.0% (medians of three A/B rounds).
FUSED_MAX_TOKENS, FUSED_NARROW_MAX_TOKENS, FUSED_MAX_N = 32, 128, 4096
# At decode sizes an output of at most CHAINED_GEMM_MAX_N columns (the router's gate) is one Triton GEMM chained into
# the step (`triton_pdl`), where cuBLAS runs a split-K GEMM and its reduction, two launches for a 74 KB weight. Wider
# outputs stay with cuBLAS: chained Triton GEMMs for q/k/v/r and o, their weight prefetched into L2, were slower
# through the engine (H200, inkling-small, batch 8: 5,527-5,531 tok/s against 5,635; docs/benchmarks.md).
CHAINED_GEMM_MAX_N = 64
# Up to EXPERT_MATMUL_MAX_TOKENS tokens (decode) the experts' GEMMs are `expert_matmul`'s Triton kernel: a few rows
# per expert, where a grouped GEMM's 128-row tiles read the weights at half the memory's speed (H200: 499 µs a
# batch-8 step against 837). Measured through decode batches of 128; prefill steps of more tokens (the engine's
# default is 256) keep the grouped GEMM until a measurement says otherwise. There the experts' LoRA rides in those
# GEMMs (a `RowExpand`), one dot per adapter slot in a tile (docs/benchmarks.md, "The experts' expand as one dot
# per slot").
EXPERT_MATMUL_MAX_TOKENS = 128
# Up to ROUTE_DISPATCH_MAX_TOKENS tokens (decode) the router's gate GEMM, the routing and the dispatch are one Triton
# kernel (`triton_route_dispatch`), where apart they are three chained launches of mostly latency.
ROUTE_DISPATCH_MAX_TOKENS = 128


def _triton_dense() -> ModuleType:
    from inkwell.kernels.triton_lora import dense

    return dense


def _triton_expert() -> ModuleType:
    from inkwell.kernels.triton_lora import expert

    return expert


def _triton_router() -> ModuleType:
    from inkwell.kernels import triton_router

    return triton_router


def _triton_moe() -> ModuleType:
    from inkwell.kernels import triton_moe

    return triton_moe


def _triton_route_dispatch() -> ModuleType:
    from inkwell.kernels import triton_route_dispatch

    return triton_route_dispatch


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ A[slot]^T -> [T,R]; rows of slot -1 are zero."""
    ops = _triton_dense() if x.is_cuda else torch_ops
    return ops.lora_shrink(x, lora_a, token_slots)


def lora_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[T,N] += scaling[slot] * y[T,R] @ B[slot]^T, in place; rows of slot -1 are untouched."""
    ops = _triton_dense() if out.is_cuda else torch_ops
    return ops.lora_expand(y, lora_b, token_slots, scalings, out)


def expert_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert - first]^T -> [M,R] (A: [S,E,R,K]); uncovered rows are zero."""
    ops = _triton_expert() if x.is_cuda else torch_ops
    return ops.expert_lora_shrink(x, lora_a, slots, expert_ids, groups)


def expert_out_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
) -> torch.Tensor:
    """Down LoRA of dispatched rows, in place: out[M,N] += scaling[slot, g] * y[M,R] @ B[slot, g]^T, g the row's
    expert group (lora_b [S, G, N, R], scalings [S, G])."""
    ops = _triton_expert() if out.is_cuda else torch_ops
    return ops.expert_out_lora_expand(y, lora_b, slots, expert_ids, scalings, out, groups)


def _torch_expand_sliced(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
) -> torch.Tensor:
    offsets = (0, lora_b.shape[1]) if slice_offsets is None else tuple(slice_offsets)
    parts, rank = len(offsets) - 1, lora_b.shape[2]
    if y.shape[1] != parts * rank:
        raise ValueError(f"y has {y.shape[1]} columns; {parts} slice(s) of B's rank {rank} need {parts * rank}")
    for p, (lo, hi) in enumerate(zip(offsets, offsets[1:], strict=False)):
        scale = scalings if scalings.dim() == 1 else scalings[:, p]
        torch_ops.lora_expand(y[:, p * rank : (p + 1) * rank], lora_b[:, lo:hi], token_slots, scale, out[:, lo:hi])
    return out


def lora_expand_sliced(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
) -> torch.Tensor:
    """Expand of a fused projection (q/k/v/r, gate/up), in place.

    y [T, P*R] is `lora_shrink` over A stacked [S, P*R, K]; lora_b [S, N, R] is B stacked along N;
    `slice_offsets` (0, o_1, ..., N) are the slices' output starts; scalings [S] or [S, P]
    (a target an adapter leaves alone has scaling 0 in its slot). Slice p adds
    scaling[slot, p] * y[:, pR:(p+1)R] @ B[slot, o_p:o_{p+1}]^T to out[:, o_p:o_{p+1}].
    """
    if out.is_cuda:
        return _triton_dense().lora_expand_sliced(y, lora_b, token_slots, scalings, out, slice_offsets)
    return _torch_expand_sliced(y, lora_b, token_slots, scalings, out, slice_offsets)


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out += the (sliced) LoRA delta of x: `lora_expand_sliced(lora_shrink(x, A), B, ...)`.

    On CUDA, decode-sized batches take one fused launch (the shrink result never leaves registers).
    """
    if out.is_cuda:
        return _triton_dense().lora_shrink_expand(x, lora_a, lora_b, token_slots, scalings, out, slice_offsets)
    y = torch_ops.lora_shrink(x, lora_a, token_slots)
    return _torch_expand_sliced(y, lora_b, token_slots, scalings, out, slice_offsets)


def fused_linear(tokens: int, columns: int) -> bool:
    """Whether the Triton `lora_linear` of `tokens` rows and `columns` outputs is one GEMM with its LoRA inside."""
    return tokens <= FUSED_MAX_TOKENS or (tokens <= FUSED_NARROW_MAX_TOKENS and columns <= FUSED_MAX_N)


def one_launch_projection(x: torch.Tensor, columns: int) -> bool:
    """Whether `lora_linear` of x [T,K] to `columns` outputs is the one-GEMM path (decode sizes on CUDA)."""
    return x.is_cuda and fused_linear(x.shape[0], columns)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T as `F.linear`. At decode sizes on CUDA (`one_launch_projection`) of at most CHAINED_GEMM_MAX_N columns
    one Triton GEMM chained into the step: its weight streams into L2 while the kernel before it runs (`triton_pdl`)."""
    if one_launch_projection(x, weight.shape[0]) and weight.shape[0] <= CHAINED_GEMM_MAX_N and x.dtype == weight.dtype:
        return _triton_dense().linear(x, weight)
    return F.linear(x, weight)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x @ W^T plus each token's (sliced) LoRA delta: `F.linear`, then `lora_shrink_expand` on its output.

    Where `one_launch_projection` holds, one Triton GEMM: the shrink beside it, the expand in its epilogue.
    """
    if x.is_cuda:
        return _triton_dense().lora_linear(x, weight, lora_a, lora_b, token_slots, scalings, slice_offsets)
    return lora_shrink_expand(x, lora_a, lora_b, token_slots, scalings, F.linear(x, weight), slice_offsets)


def shared_sink_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    top_k: int,
    n_shared: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts [T, k + n] (top-k routed, then the shared ones) and weights from its router logits
    [T, E + n]; on CUDA one Triton kernel in place of the ~10 torch launches (`triton_router` says how it
    matches them)."""
    ops = _triton_router() if logits.is_cuda else torch_ops
    return ops.shared_sink_route(logits, bias, global_scale, top_k, n_shared, route_scale)


def gate_route(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    top_k: int,
    n_shared: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights [T, k + n] from the router's gate [E + n, H]: its logits x @ gate^T
    (`linear`, rounded to x's dtype), then `shared_sink_route`."""
    return shared_sink_route(linear(x, gate), bias, global_scale, top_k, n_shared, route_scale)


def moe_dispatch(
    index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, ...]:
    """Each token's (token, expert) rows sorted by expert, stably (`torch_ops.moe_dispatch` says what it returns);
    on CUDA one Triton program in place of a radix sort and a dozen small launches."""
    ops = _triton_moe() if index.is_cuda else torch_ops
    return ops.moe_dispatch(index, weights, slots, num_experts)


def gate_route_dispatch(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    top_k: int,
    n_shared: int,
    route_scale: float,
    slots: torch.Tensor,
    lora_a: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """A MoE layer's head: the router logits x @ gate^T [T, E + n], each token's experts and weights [T, k + n]
    from them (`gate_route`) and their rows dispatched by expert (`moe_dispatch` over E + n experts, with
    the tokens' LoRA slots [T]); returns (index, weights, the dispatch's outputs, y), y the experts' gate/up LoRA
    shrink `lora_shrink(x, lora_a, slots)` where `lora_a` [S, R, H] is given (else None). On CUDA at decode sizes
    one Triton kernel (`triton_route_dispatch`), the logits rounded to x's dtype as `linear` rounds them, the
    shrink in programs of its own beside the routing."""
    if x.is_cuda and 1 <= x.shape[0] <= ROUTE_DISPATCH_MAX_TOKENS and x.dtype == gate.dtype:
        ops = _triton_route_dispatch()
        return ops.gate_route_dispatch(x, gate, bias, global_scale, top_k, n_shared, route_scale, slots, lora_a)
    index, weights = gate_route(x, gate, bias, global_scale, top_k, n_shared, route_scale)
    y = None if lora_a is None else lora_shrink(x, lora_a, slots)
    return index, weights, moe_dispatch(index, weights, slots, gate.shape[0]), y


def moe_combine(
    out: torch.Tensor,
    weights: torch.Tensor,
    places: torch.Tensor,
    tokens: int,
    dtype: torch.dtype,
    down: RowExpand | None = None,
) -> torch.Tensor:
    """Each token's dispatched rows weighted and summed in fp32, in the token's own order, with `down` (the experts'
    down LoRA of the rows, shrunk) added: [T, H] in `dtype`; on CUDA one Triton kernel."""
    ops = _triton_moe() if out.is_cuda else torch_ops
    return ops.moe_combine(out, weights, places, tokens, dtype, down)


def expert_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    tokens: torch.Tensor | None,
    max_rows: int,
    expand: RowExpand | None = None,
    every_token_from: int | None = None,
) -> torch.Tensor:
    """Dispatched rows sorted by expert times their expert's weight [E, N, K] (`torch_ops.expert_matmul` says
    which rows), plus `expand`'s LoRA; on CUDA one Triton kernel that also gathers the rows and adds the LoRA in its
    epilogue, and asks L2 early for the weights of the experts from `every_token_from` on (every token's)."""
    ops = _triton_moe() if x.is_cuda else torch_ops
    return ops.expert_matmul(x, weight, ends, tokens, max_rows, expand, every_token_from)


def silu_mul(
    gate_up: torch.Tensor, expand: RowExpand | None = None, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [M, 2F] -> [M, F], each op rounded to the input's dtype as torch rounds
    them; on CUDA one Triton kernel in place of two (and the strided read of the halves). With `expand`, the
    dispatched rows' gate/up LoRA (y the shrink of their tokens `tokens`) is added to the rows first, as
    `torch_ops.expert_in_lora_expand` adds it in place; on CUDA in the same kernel, over tiles of rows sorted by
    expert."""
    ops = _triton_moe() if gate_up.is_cuda else torch_ops
    return ops.silu_mul(gate_up, expand, tokens)


def silu_mul_shrink(
    gate_up: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, expert_ids: torch.Tensor, groups: ExpertGroups
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul` of dispatched rows and the down LoRA's shrink of the result over per-expert A [S, E, R, F]:
    (act [M, F], y [M, R]); on CUDA one Triton kernel."""
    ops = _triton_moe() if gate_up.is_cuda else torch_ops
    return ops.silu_mul_shrink(gate_up, lora_a, slots, expert_ids, groups)
