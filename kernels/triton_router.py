"""Inkling's shared-sink router after its gate GEMM as one Triton kernel: sigmoid, correction bias, top-k over the
routed experts, and the weights renormalised jointly with the shared experts' (the sink).

In torch (`torch_ops.shared_sink_route`) that is about ten launches per MoE layer on a [T, E + n] tensor of a few
KB at decode. Here one program takes a block of rows and does all of it, rounding where the torch composite rounds
(the sigmoid, the biased score, the log-sigmoids, each step of logsumexp, the exp and both scalings) and with
torch's formulas. On CUDA it computes exp/log/log1p as torch's kernels do (`triton_math`) and divides in IEEE, so
the scores top-k compares are the same numbers; the weights can differ where a sum taken in another order moves a
value across a rounding boundary.

Top-k returns what torch.topk(sorted=False) returns on CUDA for rows this narrow (its one-block radix select):
the experts whose score is above the k-th largest, in index order, then those equal to it, lowest index first,
until there are k. That matters because ties are common in bf16 (sigmoids near 0.5 are 2^-8 apart and the bias
starts at zero), and the order fixes the order `Dispatch.combine` sums in. NaN scores are not handled (torch
ranks them highest).
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_math import exp, log, log1p
from inkwell.kernels.triton_pdl import chain_launch, chain_start

_NEG_INF = tl.constexpr(float("-inf"))
SMALL_BLOCK_MAX_TOKENS = 128


@triton.jit
def _log_sigmoid(x, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """torch's formula, min(x, 0) - log1p(exp(-|x|)), rounded to `dtype` (held in fp32)."""
    soft = log1p(exp(-tl.abs(x), PRECISE), PRECISE)
    return (tl.minimum(x, 0.0) - soft).to(dtype).to(tl.float32)


@triton.jit
def route_rows(
    x, x_shared, in_rows, e, s, bias_ptr, scale_ptr, route_scale,
    ROUTED: tl.constexpr, SHARED: tl.constexpr, TOP_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_E: tl.constexpr,
    dtype: tl.constexpr,
):  # fmt: skip
    """The routing of a block of rows (`in_rows` [BLOCK_T, 1] those that exist) from their logits, fp32 values of
    `dtype`: routed x [BLOCK_T, BLOCK_E] (experts e [1, BLOCK_E]) and shared x_shared [BLOCK_T, BLOCK_S] (s).
    Returns which routed experts each row picked, each pick's place among the row's first TOP_K, and the weights
    (in `dtype`) of the picks and of the shared experts."""
    routed = in_rows & (e < ROUTED)
    shared = in_rows & (s < SHARED)
    # the scores top-k compares: sigmoid and sigmoid + bias, each rounded to the model's dtype as torch does
    sig = tl.math.div_rn(tl.zeros_like(x) + 1.0, 1.0 + exp(-x, PRECISE)).to(dtype).to(tl.float32)
    bias = tl.load(bias_ptr + e, mask=e < ROUTED, other=0.0).to(tl.float32)
    score = tl.where(routed, (sig + bias).to(dtype).to(tl.float32), _NEG_INF)
    # the k-th largest score, counted with multiplicity: take the largest k times, one expert at a time
    left = routed
    for _ in tl.static_range(TOP_K):
        kth = tl.max(tl.where(left, score, _NEG_INF), axis=1)[:, None]
        first = tl.min(tl.where(left & (score == kth), e, BLOCK_E), axis=1)[:, None]
        left = left & (e != first)
    above = (routed & (score > kth)).to(tl.int32)
    tied = (routed & (score == kth)).to(tl.int32)
    n_above = tl.sum(above, axis=1)[:, None]
    tie_rank = tl.cumsum(tied, axis=1) - tied
    picked = (above > 0) | ((tied > 0) & (tie_rank < TOP_K - n_above))
    place = tl.where(above > 0, tl.cumsum(above, axis=1) - 1, n_above + tie_rank)

    # weights: softmax of the log-sigmoids of the picked and shared logits (torch's logsumexp, step by step)
    lp = _log_sigmoid(x, dtype, PRECISE)
    lp_shared = _log_sigmoid(x_shared, dtype, PRECISE)
    top = tl.maximum(
        tl.max(tl.where(picked, lp, _NEG_INF), axis=1), tl.max(tl.where(shared, lp_shared, _NEG_INF), axis=1)
    )[:, None]
    exps = tl.where(picked, exp((lp - top).to(dtype).to(tl.float32), PRECISE).to(dtype).to(tl.float32), 0.0)
    exps_shared = tl.where(
        shared, exp((lp_shared - top).to(dtype).to(tl.float32), PRECISE).to(dtype).to(tl.float32), 0.0
    )
    total = (tl.sum(exps, axis=1) + tl.sum(exps_shared, axis=1))[:, None].to(dtype).to(tl.float32)
    total = tl.where(in_rows, total, 1.0)  # rows past T: no log(0)
    lse = (log(total, PRECISE).to(dtype).to(tl.float32) + top).to(dtype).to(tl.float32)
    global_scale = tl.load(scale_ptr).to(tl.float32)
    w = exp((lp - lse).to(dtype).to(tl.float32), PRECISE).to(dtype).to(tl.float32)
    w = (w * route_scale).to(dtype).to(tl.float32) * global_scale
    w_shared = exp((lp_shared - lse).to(dtype).to(tl.float32), PRECISE).to(dtype).to(tl.float32)
    w_shared = (w_shared * route_scale).to(dtype).to(tl.float32) * global_scale
    return picked, place, w.to(dtype), w_shared.to(dtype)


@triton.jit
def store_routes(
    index_ptr, weights_ptr, rows, stride_it, stride_wt, e, s, picked, place, w, shared, w_shared,
    ROUTED: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """`route_rows`' picks into rows [BLOCK_T] of index and weights [T, TOP_K + SHARED], the shared experts last."""
    out = rows[:, None].to(tl.int64)
    tl.store(index_ptr + out * stride_it + place, e.to(tl.int64), mask=picked)
    tl.store(weights_ptr + out * stride_wt + place, w, mask=picked)
    tl.store(index_ptr + out * stride_it + TOP_K + s, (ROUTED + s).to(tl.int64), mask=shared)
    tl.store(weights_ptr + out * stride_wt + TOP_K + s, w_shared, mask=shared)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, scale_ptr, index_ptr, weights_ptr,
    T, route_scale, stride_lt, stride_it, stride_wt,
    ROUTED: tl.constexpr, SHARED: tl.constexpr, TOP_K: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """Rows [BLOCK_T] of logits [T, ROUTED + SHARED] -> index [T, TOP_K + SHARED] and weights (like logits)."""
    chain_start(CHAINED)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_rows = (rows < T)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    s = tl.arange(0, BLOCK_S)[None, :]
    shared = in_rows & (s < SHARED)
    row_logits = logits_ptr + rows[:, None].to(tl.int64) * stride_lt
    x = tl.load(row_logits + e, mask=in_rows & (e < ROUTED), other=0.0).to(tl.float32)
    x_shared = tl.load(row_logits + ROUTED + s, mask=shared, other=0.0).to(tl.float32)
    picked, place, w, w_shared = route_rows(
        x, x_shared, in_rows, e, s, bias_ptr, scale_ptr, route_scale, ROUTED, SHARED, TOP_K, PRECISE, BLOCK_E,
        weights_ptr.dtype.element_ty,
    )  # fmt: skip
    store_routes(index_ptr, weights_ptr, rows, stride_it, stride_wt, e, s, picked, place, w, shared, w_shared, ROUTED,
                 TOP_K)  # fmt: skip


def shared_sink_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    top_k: int,
    n_shared: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights from its router logits [T, E + n] (routed, then shared): index [T, k + n]
    (long; the top-k routed experts as torch.topk picks and orders them, then the shared ids E .. E+n-1) and
    weights [T, k + n] in the logits' dtype, scaled by route_scale * global_scale. bias [E], global_scale [1]."""
    tokens, experts = logits.shape
    routed = experts - n_shared
    if logits.stride(1) != 1 or bias.shape != (routed,) or global_scale.numel() != 1 or not 0 < top_k <= routed:
        raise ValueError(
            f"shared_sink_route needs logits [T, E + n] with unit column stride, bias [E] and one global scale, "
            f"top_k in 1..E; got logits {list(logits.shape)} (strides {logits.stride()}), n {n_shared}, bias "
            f"{list(bias.shape)}, global_scale {list(global_scale.shape)}, top_k {top_k}"
        )
    index = torch.empty(tokens, top_k + n_shared, dtype=torch.long, device=logits.device)
    weights = torch.empty(tokens, top_k + n_shared, dtype=logits.dtype, device=logits.device)
    block_e = triton.next_power_of_2(routed)
    # Up to SMALL_BLOCK_MAX_TOKENS (decode) a program routes 2 rows in one warp, so its chain of exps, logs and
    # top-k steps runs once per lane: 2.4-2.6 µs where 64-row programs of 4 warps take 5.8-6.8 (H200, 1-128 tokens,
    # inkling-small's 16 experts); past it about 1k scores per program, one compiled variant for every T.
    block_t, warps = (2, 1) if tokens <= SMALL_BLOCK_MAX_TOKENS else (max(1, 1024 // block_e), 4)
    _route_kernel[(triton.cdiv(tokens, block_t),)](
        logits,
        bias,
        global_scale,
        index,
        weights,
        tokens,
        route_scale,
        logits.stride(0),
        index.stride(0),
        weights.stride(0),
        ROUTED=routed,
        SHARED=n_shared,
        TOP_K=top_k,
        PRECISE=logits.is_cuda,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_S=triton.next_power_of_2(n_shared),
        num_warps=warps,
        **chain_launch(logits),
    )
    return index, weights
