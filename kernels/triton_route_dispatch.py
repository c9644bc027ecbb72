"""The head of a MoE layer at decode sizes as one Triton kernel: the router's gate GEMM, the shared-sink routing and
the dispatch (each token's (token, expert) rows sorted by expert).

Apart they are three chained launches a MoE layer, each mostly latency: `dispatch.linear`'s GEMM, one program
streaming the gate's K columns for a [T, E + n] output, then `triton_router`, then `triton_moe`'s one-program
dispatch (at 8 tokens on an H100 4.4-4.9 + 2.2 + 2.4-2.6 µs of a ~90 µs layer). Here the GEMM's K is split over
programs, each reading its slice of the gate before its chain wait (a weight: `triton_pdl`), and the last program to
add its partial (the split shrink's count pattern, `split_counts`) sums the partials in split order, rounds the
logits to the model's dtype as the GEMM's output is rounded, routes every row (`triton_router.route_rows`) and
dispatches from registers: a routed expert's rows come in token order (a token picks an expert once), so a pick's
place is its expert's first place plus the picks of that expert by earlier tokens, a cumsum down the token axis; the
shared experts' rows follow every routed one, one per token. The outputs are those of `dispatch.gate_route_dispatch`
off CUDA: `linear`, `shared_sink_route`, then `moe_dispatch`.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.split_counts import split_counts
from inkwell.kernels.triton_lora.common import dot_precision, pow2, require
from inkwell.kernels.triton_lora.dense import lora_shrink
from inkwell.kernels.triton_lora.shrink import (
    SHRINK_SPLIT_K,
    split_shrink_operands,
    split_shrink_program,
    split_shrinkable,
)
from inkwell.kernels.triton_pdl import chain_launch
from inkwell.kernels.triton_router import route_rows, store_routes

# The gate's K is split into blocks of about K / SPLITS columns (16 to 256), one program each.
SPLITS = 16


@triton.jit
def _write_rows(
    order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr, row, place, token, expert, w, slot, mask
):
    """Token-major rows `row` go to their sorted `place`s: every output of the dispatch at once."""
    place = place.to(tl.int64)
    tl.store(places_ptr + row, place, mask=mask)
    tl.store(order_ptr + place, row.to(tl.int64), mask=mask)
    tl.store(tokens_ptr + place, token.to(tl.int64), mask=mask)
    tl.store(experts_ptr + place, expert.to(tl.int64), mask=mask)
    tl.store(w_out_ptr + place, w, mask=mask)
    tl.store(slots_out_ptr + place, slot, mask=mask)


@triton.jit
def _gate_route_dispatch_kernel(
    x_ptr, w_ptr, part_ptr, count_ptr, bias_ptr, scale_ptr, slot_ptr,
    index_ptr, weights_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, ends_ptr, places_ptr,
    T, K, route_scale, stride_xt, stride_xk, stride_wn, stride_wk, stride_it, stride_wt,
    s_x_ptr, s_a_ptr, s_part_ptr, s_y_ptr, s_slot_ptr, s_count_ptr, s_T, s_K, s_R, s_K_PER_SPLIT, s_stride_xt,
    s_stride_xk, s_stride_as, s_stride_ar, s_stride_ak, s_stride_yt, s_stride_yr, s_slot_programs, s_r_splits,
    ROUTED: tl.constexpr, SHARED: tl.constexpr, TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, CHAINED: tl.constexpr, SHRINK: tl.constexpr,
    s_SPLIT_K: tl.constexpr, s_PRECISION: tl.constexpr, s_BLOCK_T: tl.constexpr, s_BLOCK_K: tl.constexpr,
    s_BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program p adds x[:, K block p] @ gate[:, K block p]^T into its fp32 partial [T, ROUTED + SHARED]; the last to
    finish routes and dispatches every row of the sum, then resets the count for the next launch or replay.
    With SHRINK the programs from SPLIT_K on are a split shrink's (`split_shrink_program`, its operands `s_*`): the
    experts' gate/up LoRA shrink of x, written beside the routing, so the experts' GEMM after this kernel finds it."""
    N = ROUTED + SHARED
    if CHAINED:
        gdc_launch_dependents()
    if SHRINK:  # noqa: SIM102 (a constexpr: the shrink programs compile out without it)
        if tl.program_id(0) >= SPLIT_K:
            q = tl.program_id(0) - SPLIT_K
            per_tile = s_slot_programs * s_r_splits
            split_shrink_program(
                q // per_tile, (q % per_tile) // s_r_splits, q % s_r_splits, s_slot_programs, s_r_splits,
                s_x_ptr, s_a_ptr, s_part_ptr, s_y_ptr, s_slot_ptr, s_count_ptr, s_T, s_K, s_R, s_K_PER_SPLIT,
                s_stride_xt, s_stride_xk, s_stride_as, s_stride_ar, s_stride_ak, s_stride_yt, s_stride_yr,
                s_SPLIT_K, s_PRECISION, s_BLOCK_T, s_BLOCK_K, s_BLOCK_R, CHAINED,
            )  # fmt: skip
            return
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N)
    in_k = rk < K
    gate_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk
    gate = tl.load(gate_ptrs, mask=(rn[None, :] < N) & in_k[:, None], other=0.0)
    if CHAINED:
        gdc_wait()  # the gate is a weight; x is the kernel before's output
    rows = tl.arange(0, BLOCK_T)
    in_rows = (rows < T)[:, None]
    xt = tl.load(x_ptr + rows[:, None] * stride_xt + rk[None, :] * stride_xk, mask=in_rows & in_k[None, :], other=0.0)
    part = tl.dot(xt, gate.to(xt.dtype), input_precision=PRECISION)
    part_rows = part_ptr + rows[:, None] * N
    tl.store(part_rows + tl.program_id(0) * T * N + rn[None, :], part, mask=in_rows & (rn[None, :] < N))
    if tl.atomic_add(count_ptr, 1) == SPLIT_K - 1:  # every other program's partial is visible now
        e = tl.arange(0, BLOCK_E)[None, :]
        s = tl.arange(0, BLOCK_S)[None, :]
        shared = in_rows & (s < SHARED)
        x = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        x_shared = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
        for p in tl.static_range(SPLIT_K):
            x += tl.load(part_rows + p * T * N + e, mask=in_rows & (e < ROUTED), other=0.0, cache_modifier=".cg")
            x_shared += tl.load(part_rows + p * T * N + ROUTED + s, mask=shared, other=0.0, cache_modifier=".cg")
        dtype = weights_ptr.dtype.element_ty
        x, x_shared = x.to(dtype).to(tl.float32), x_shared.to(dtype).to(tl.float32)  # the GEMM's output rounding
        picked, place, w, w_shared = route_rows(
            x, x_shared, in_rows, e, s, bias_ptr, scale_ptr, route_scale, ROUTED, SHARED, TOP_K, PRECISE, BLOCK_E,
            dtype,
        )  # fmt: skip
        store_routes(index_ptr, weights_ptr, rows, stride_it, stride_wt, e, s, picked, place, w, shared, w_shared,
                     ROUTED, TOP_K)  # fmt: skip
        # the dispatch: each routed expert's rows in token order, then each shared expert's, one per token
        hits = picked.to(tl.int32)
        counts = tl.sum(hits, axis=0)[None, :]
        ends = tl.cumsum(counts, axis=1)
        routed_rows = tl.sum(counts, axis=1)[:, None]
        tl.store(ends_ptr + e, ends, mask=e < ROUTED)
        tl.store(ends_ptr + ROUTED + s, routed_rows + (s + 1) * T, mask=s < SHARED)
        token = rows[:, None]
        slot = tl.load(slot_ptr + token, mask=in_rows)
        first_row = token * (TOP_K + SHARED)
        _write_rows(
            order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr, first_row + place,
            ends - counts + tl.cumsum(hits, axis=0) - hits, token, e, w, slot, picked,
        )  # fmt: skip
        _write_rows(
            order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr, first_row + TOP_K + s,
            routed_rows + s * T + token, token, ROUTED + s, w_shared, slot, shared,
        )  # fmt: skip
        tl.atomic_xchg(count_ptr, 0)


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
    """`dispatch.gate_route_dispatch` in one launch: tokens x [T, H] (T >= 1, every row in one tile), gate [E + n, H]
    of x's dtype, bias [E], one global scale, the tokens' LoRA slots [T], and the experts' gate/up LoRA A [S, R, H]
    or None. Returns index and weights [T, k + n], the seven outputs of `moe_dispatch` over E + n experts, and the
    tokens' shrink x @ A[slot]^T [T, R] (`lora_shrink`) where `lora_a` is given, computed by programs of its own, or
    by a shrink launch after the kernel where its groups are more than the split counts serve (`split_shrinkable`)."""
    (tokens, k), experts = x.shape, gate.shape[0]
    routed = experts - n_shared
    require(
        tokens >= 1
        and gate.dim() == 2
        and gate.shape[1] == k
        and gate.dtype == x.dtype
        and bias.shape == (routed,)
        and global_scale.numel() == 1
        and 0 < top_k <= routed
        and slots.shape == (tokens,),
        f"gate_route_dispatch needs x [T>=1, H], gate [E + n, H] of x's dtype, bias [E], one global scale, top_k in "
        f"1..E and slots [T]; got x {list(x.shape)} {x.dtype}, gate {list(gate.shape)} {gate.dtype}, n {n_shared}, "
        f"bias {list(bias.shape)}, global_scale {list(global_scale.shape)}, top_k {top_k}, slots {list(slots.shape)}",
    )
    device, width = x.device, top_k + n_shared
    index = torch.empty(tokens, width, dtype=torch.long, device=device)
    weights = torch.empty(tokens, width, dtype=x.dtype, device=device)
    rows = tokens * width
    order, row_tokens, row_experts, places = (torch.empty(rows, dtype=torch.long, device=device) for _ in range(4))
    row_weights = torch.empty(rows, dtype=x.dtype, device=device)
    row_slots = torch.empty(rows, dtype=slots.dtype, device=device)
    ends = torch.empty(experts, dtype=torch.int32, device=device)
    block_k = pow2(triton.cdiv(k, SPLITS), 16, 256)
    split_k = triton.cdiv(k, block_k)
    partials = torch.empty(split_k, tokens, experts, dtype=torch.float32, device=device)
    block_t, block_e = pow2(tokens), triton.next_power_of_2(routed)
    own_shrink = lora_a is not None and split_shrinkable(tokens, lora_a.shape[0], lora_a.shape[-2])
    y, shrink_programs, shrink, shrink_consts = _shrink_operands(x, lora_a if own_shrink else None, slots)
    _gate_route_dispatch_kernel[(split_k + shrink_programs,)](
        x, gate, partials, split_counts("gate_route_dispatch", device), bias, global_scale, slots,
        index, weights, order, row_tokens, row_experts, row_weights, row_slots, ends, places,
        tokens, k, route_scale, *x.stride(), *gate.stride(), index.stride(0), weights.stride(0), *shrink,
        ROUTED=routed, SHARED=n_shared, TOP_K=top_k, SPLIT_K=split_k, PRECISE=x.is_cuda,
        PRECISION=dot_precision(x.dtype), BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_N=pow2(experts),
        BLOCK_E=block_e, BLOCK_S=triton.next_power_of_2(n_shared),
        num_warps=min(16, max(4, block_t * block_e // 128)),  # at most 4 scores a lane in the routing
        **shrink_consts, **chain_launch(x),
    )  # fmt: skip
    if lora_a is not None and not own_shrink:
        y = lora_shrink(x, lora_a, slots)
    return index, weights, (order, row_tokens, row_experts, row_weights, row_slots, ends, places), y


def _shrink_operands(
    x: torch.Tensor, lora_a: torch.Tensor | None, slots: torch.Tensor
) -> tuple[torch.Tensor | None, int, list, dict]:
    """The shrink's y, its programs, its `s_*` arguments and constexprs for `lora_a` whose groups the split counts
    serve (`split_shrinkable`); SHRINK off (no `lora_a`): placeholders of the right kinds, compiled out."""
    if lora_a is None:
        return None, 0, [x] * 6 + [0] * 13, dict(SHRINK=False, s_SPLIT_K=1, s_PRECISION="ieee", s_BLOCK_T=16,
                                                  s_BLOCK_K=16, s_BLOCK_R=16)  # fmt: skip
    k, depth = x.shape[1], lora_a.shape[-1]
    require(lora_a.dim() == 3 and depth == k, f"the head's shrink needs lora_a [S, R, H={k}], got {list(lora_a.shape)}")
    y, grid, args, consts = split_shrink_operands(x, lora_a, slots, SHRINK_SPLIT_K, "gate_route_dispatch_shrink")
    tiles, slot_programs, r_splits = grid
    consts = {f"s_{name}": value for name, value in consts.items()}
    return y, tiles * slot_programs * r_splits, [*args, slot_programs, r_splits], dict(SHRINK=True, **consts)
