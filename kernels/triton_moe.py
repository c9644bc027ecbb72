"""The MoE layer's row bookkeeping as Triton kernels: the dispatch (each token's (token, expert) rows sorted by
expert) and the combine (each token's rows weighted and summed back into one).

In torch (`torch_ops.moe_dispatch`, `moe_combine`) the dispatch is a stable argsort (a radix sort of several
launches), a division, searchsorted and four gathers, and the combine a cast, a product, a scatter, a sum and a cast:
about fifteen launches per MoE layer for a few KB at decode. Here the dispatch is a stable counting sort: it counts
each expert's rows, then gives each row its place (its expert's first place, plus the rows of that expert before
it) and writes every output there; one program at decode, a program per block of rows at prefill. The combine is
one program per (token, column block), summing the token's rows in its own order, so the result does not depend on
the sort; with the experts' down LoRA, one per (tile of tokens, column block), which also sums each token's rows'
shrunk y per group and expands the sums (B is shared by a group's experts).
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink
from inkwell.kernels.triton_lora.common import (
    SENTINEL,
    dot_operands,
    local_split,
    lora_dot,
    plus_delta,
    pow2,
    require,
    row_keys,
    row_slots,
    scale_strides,
)
from inkwell.kernels.triton_lora.dense import lora_shrink
from inkwell.kernels.triton_math import exp
from inkwell.kernels.triton_pdl import (
    chain_launch,
    chain_start,
    pair_launch,
    prefetch_rows_l2,
    rows_prefetchable,
    wait_then_trigger,
)


@triton.jit
def _keys(index_ptr, i, M, E):
    """Rows i's sort keys: the expert id, ids past the last expert all as E; -1 past the last row."""
    return tl.where(i < M, tl.minimum(tl.load(index_ptr + i, mask=i < M, other=0), E), -1)


@triton.jit
def _place_rows(
    index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr, i,
    first, M, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Place rows i [BLOCK_M] (in order), each key's next free place at `first` [BLOCK_E], and write every output
    there; returns `first` past them."""
    e = tl.arange(0, BLOCK_E)
    valid = i < M
    hit = (_keys(index_ptr, i, M, E)[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_M, BLOCK_E]
    earlier = tl.cumsum(hit, axis=0) - hit  # rows of the same key before row i in this block
    place = tl.sum(hit * (first[None, :] + earlier), axis=1).to(tl.int64)
    token = i // K
    tl.store(places_ptr + i, place, mask=valid)
    tl.store(order_ptr + place, i.to(tl.int64), mask=valid)
    tl.store(tokens_ptr + place, token.to(tl.int64), mask=valid)
    tl.store(experts_ptr + place, tl.load(index_ptr + i, mask=valid), mask=valid)
    tl.store(w_out_ptr + place, tl.load(weight_ptr + i, mask=valid), mask=valid)
    tl.store(slots_out_ptr + place, tl.load(slot_ptr + token, mask=valid), mask=valid)
    return first + tl.sum(hit, axis=0)


@triton.jit
def _dispatch_kernel(
    index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr,
    ends_ptr, M, E, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """The whole dispatch in one program: count each key's rows, then place the rows block after block."""
    chain_start(CHAINED)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for m0 in range(0, M, BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        counts += tl.sum((_keys(index_ptr, i, M, E)[:, None] == e[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(ends_ptr + e, ends, mask=e < E)
    first = ends - counts  # each key's next free place
    for m0 in range(0, M, BLOCK_M):
        first = _place_rows(
            index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr,
            places_ptr, m0 + tl.arange(0, BLOCK_M), first, M, E, K, BLOCK_E,
        )  # fmt: skip


@triton.jit
def _count_kernel(index_ptr, counts_ptr, M, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Block b's rows of each key -> counts[b, :]."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    i = b * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(counts_ptr + b * BLOCK_E + e, tl.sum((_keys(index_ptr, i, M, E)[:, None] == e[None, :]).to(tl.int32), 0))


@triton.jit
def _place_kernel(
    index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr,
    ends_ptr, counts_ptr, M, E, blocks, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Block b's rows placed after every earlier block's rows of their key (from all blocks' counts)."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    block = tl.arange(0, BLOCK_B)
    counts = tl.load(counts_ptr + block[:, None] * BLOCK_E + e[None, :], mask=(block < blocks)[:, None], other=0)
    totals = tl.sum(counts, axis=0)
    ends = tl.cumsum(totals, axis=0)
    if b == 0:
        tl.store(ends_ptr + e, ends, mask=e < E)
    first = ends - totals + tl.sum(tl.where((block < b)[:, None], counts, 0), axis=0)
    _place_rows(
        index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr,
        b * BLOCK_M + tl.arange(0, BLOCK_M), first, M, E, K, BLOCK_E,
    )  # fmt: skip


# Up to this many rows (decode batches of up to ~170 tokens at inkling-small's 6 experts a token) the dispatch is
# one program; past it that program's two passes over the rows run long (0.67 ms for 8 x 1,024 tokens, 49,152
# rows, on the H200), so a program per block counts its rows and another per block places them.
ONE_PROGRAM_MAX_ROWS = 1024
MAX_SORT_BLOCKS = 256
dispatch_override: tuple[int, int] | None = None  # (BLOCK_M, num_warps): benchmarks/bench_dispatch.py's sweep


def dispatch_program(rows: int) -> tuple[int, int]:
    """The one-program dispatch's (BLOCK_M, num_warps) for `rows` rows: blocks of up to 256 rows, 4 warps. Wider
    blocks with more warps, one step per pass, were slower (H100, 768 rows: 512 x 8 warps 15.2 µs, 1,024 x 16 19.2,
    against 9.6; docs/benchmarks.md)."""
    if dispatch_override is not None:
        return dispatch_override
    return min(triton.next_power_of_2(rows), 256), 4


def moe_dispatch(
    index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, ...]:
    """`torch_ops.moe_dispatch` as a stable counting sort over the experts: one Triton program up to
    ONE_PROGRAM_MAX_ROWS rows, else a count and a place kernel over blocks of rows."""
    tokens, k = index.shape
    rows = tokens * k
    index, weights = index.contiguous(), weights.contiguous()
    device = index.device
    order, row_tokens, experts, places = (torch.empty(rows, dtype=torch.long, device=device) for _ in range(4))
    row_weights = torch.empty(rows, dtype=weights.dtype, device=device)
    row_slots = torch.empty(rows, dtype=slots.dtype, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    outputs = (order, row_tokens, experts, row_weights, row_slots, places, ends)
    block_e = triton.next_power_of_2(num_experts + 1)
    if rows == 0:
        ends.zero_()
    elif rows <= ONE_PROGRAM_MAX_ROWS:
        block_m, warps = dispatch_program(rows)
        _dispatch_kernel[(1,)](
            index, weights, slots, *outputs, rows, num_experts, K=k, BLOCK_M=block_m, BLOCK_E=block_e,
            num_warps=warps, **chain_launch(index),
        )  # fmt: skip
    else:
        block_m = max(256, triton.next_power_of_2(triton.cdiv(rows, MAX_SORT_BLOCKS)))
        blocks = triton.cdiv(rows, block_m)
        counts = torch.empty(blocks, block_e, dtype=torch.int32, device=device)
        _count_kernel[(blocks,)](index, counts, rows, num_experts, BLOCK_M=block_m, BLOCK_E=block_e, num_warps=4)
        _place_kernel[(blocks,)](
            index, weights, slots, *outputs, counts, rows, num_experts, blocks, K=k, BLOCK_M=block_m,
            BLOCK_E=block_e, BLOCK_B=triton.next_power_of_2(blocks), num_warps=8,
        )  # fmt: skip
    return order, row_tokens, experts, row_weights, row_slots, ends, places


@triton.jit
def combine_row(out_ptr, w_ptr, places_ptr, t, c, in_c, stride_om, K: tl.constexpr):
    """Token t's combine over columns c (mask in_c): its K dispatched rows of out (at places t*K ..), each times its
    weight, summed in fp32 in the token's own order -> fp32 [columns]. `_combine_kernel` and the decode ShortConv
    step that combines its input (`triton_short_conv`) both sum this way, so they round alike."""
    acc = tl.zeros(c.shape, tl.float32)
    for j in tl.static_range(K):
        place = tl.load(places_ptr + t * K + j)
        weight = tl.load(w_ptr + place).to(tl.float32)
        acc += tl.load(out_ptr + place * stride_om + c, mask=in_c, other=0.0).to(tl.float32) * weight
    return acc


@triton.jit
def _combine_kernel(
    out_ptr, w_ptr, places_ptr, result_ptr, H, stride_om, stride_rt, K: tl.constexpr, BLOCK_H: tl.constexpr,
    CHAINED: tl.constexpr,
):  # fmt: skip
    chain_start(CHAINED)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_c = c < H
    acc = combine_row(out_ptr, w_ptr, places_ptr, t, c, in_c, stride_om, K)
    tl.store(result_ptr + t * stride_rt + c, acc.to(result_ptr.dtype.element_ty), mask=in_c)


@triton.jit
def _group_expand(acc, z, sel, scale, b_ptrs, b_mask, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc += (the `sel` tokens' z [T, R] * scale) @ the B tile at b_ptrs [R, H]."""
    bt = tl.load(b_ptrs, mask=b_mask, other=0.0)
    z = tl.where(sel, z * scale, 0.0)
    if DOT_FP32:
        return tl.dot(z, bt.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(z.to(bt.dtype), bt, acc, input_precision=PRECISION)


@triton.jit
def _combine_down_kernel(
    out_ptr, w_ptr, places_ptr, result_ptr, y_ptr, b_ptr, slot_ptr, expert_ptr, scale_ptr, T, H, R, first, count,
    split, stride_om, stride_rt, stride_ym, stride_bs, stride_bg, stride_bn, stride_br, stride_ss, stride_sg,
    K: tl.constexpr, GROUPS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """`_combine_kernel` over a tile of tokens, with the experts' down LoRA: B is shared by a group's experts, so
    sum_j w_j (down_j + s_g y_j @ B_g^T) = sum_j w_j down_j + s_g (sum_j w_j y_j) @ B_g^T: each token's rows' shrunk
    y, weighted and summed per group in fp32, then one dot per (slot in the tile, group) adds the expand."""
    chain_start(CHAINED)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_c = c < H
    rr = tl.arange(0, BLOCK_R)
    in_r = rr < R
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    z_first = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    z_second = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for j in tl.static_range(K):
        place = tl.load(places_ptr + rt.to(tl.int64) * K + j, mask=in_t, other=0)
        weight = tl.load(w_ptr + place, mask=in_t, other=0.0).to(tl.float32)
        rows = tl.load(out_ptr + place[:, None] * stride_om + c[None, :], mask=in_t[:, None] & in_c[None, :], other=0.0)
        acc += rows.to(tl.float32) * weight[:, None]
        slot = tl.load(slot_ptr + place, mask=in_t, other=-1)
        local = tl.load(expert_ptr + place, mask=in_t, other=0).to(tl.int32) - first
        covered = (slot >= 0) & (local >= 0) & (local < count)
        y = tl.load(y_ptr + place[:, None] * stride_ym + rr[None, :], mask=covered[:, None] & in_r[None, :], other=0.0)
        wy = y.to(tl.float32) * weight[:, None]
        second = (local >= split)[:, None]
        z_first += tl.where(second, 0.0, wy)
        z_second += tl.where(second, wy, 0.0)
    token_slots = tl.load(slot_ptr + tl.load(places_ptr + rt.to(tl.int64) * K, mask=in_t, other=0), mask=in_t, other=-1)
    keys = tl.where(in_t & (token_slots >= 0), token_slots, SENTINEL)
    key = tl.min(keys, 0)
    while key < SENTINEL:  # each slot among the tile's tokens (one in a prefill chunk's tile)
        sel = (keys == key)[:, None]
        b_slot = b_ptr + key.to(tl.int64) * stride_bs
        b_tile = rr[:, None] * stride_br + c[None, :] * stride_bn
        b_mask = in_r[:, None] & in_c[None, :]
        scale = tl.load(scale_ptr + key * stride_ss).to(tl.float32)
        acc = _group_expand(acc, z_first, sel, scale, b_slot + b_tile, b_mask, DOT_FP32, PRECISION)
        if GROUPS == 2:
            scale = tl.load(scale_ptr + key * stride_ss + stride_sg).to(tl.float32)
            acc = _group_expand(acc, z_second, sel, scale, b_slot + stride_bg + b_tile, b_mask, DOT_FP32, PRECISION)
        keys = tl.where(keys == key, SENTINEL, keys)
        key = tl.min(keys, 0)
    tl.store(
        result_ptr + rt.to(tl.int64)[:, None] * stride_rt + c[None, :],
        acc.to(result_ptr.dtype.element_ty),
        mask=in_t[:, None] & in_c[None, :],
    )


def combine_down_tiles(tokens: int) -> tuple[int, int]:
    """(tokens, columns) of a program of the combine with the down LoRA: 16 tokens, 64 to 256 columns as tokens grow
    (programs enough to fill the GPU). At 8,192 tokens on the H200 16 x 256 took 87 µs where 32 x 128 took 125 (the
    combine without the LoRA: 64); benchmarks/bench_moe_rows.py --sweep sets this to other shapes."""
    return 16, 64 if tokens <= 256 else 128 if tokens <= 1024 else 256


def _combine_down(
    out: torch.Tensor, weights: torch.Tensor, places: torch.Tensor, down: RowExpand, result: torch.Tensor
):
    """`_combine_down_kernel`'s launch over `combine_down_tiles`."""
    tokens, width = result.shape
    rows = out.shape[0]
    num_slots, groups, n, rank = down.b.shape
    require(
        down.y.shape == (rows, rank) and down.slots.shape == down.experts.shape == (rows,) and n == width,
        f"the combine's down LoRA needs y [M={rows}, R={rank}], slots and experts [M] and B [S, G, N={width}, R]; got "
        f"y {list(down.y.shape)}, B {list(down.b.shape)}",
    )
    require(down.y.stride(1) == 1, "the combine's down LoRA needs y with unit column stride")
    require(groups == down.groups.groups, f"B has {groups} groups, the groups say {down.groups.groups}")
    ss, sg = scale_strides(down.scalings, num_slots, groups)
    block_t, block_h = combine_down_tiles(tokens)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_h))
    _combine_down_kernel[grid](
        out, weights, places, result, down.y, down.b, down.slots, down.experts, down.scalings, tokens, width, rank,
        down.groups.first, down.groups.count, local_split(down.groups), out.stride(0), result.stride(0),
        down.y.stride(0), *down.b.stride(), ss, sg, K=rows // tokens, GROUPS=groups,
        **dot_operands(down.y.dtype, down.b.dtype), BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_R=pow2(rank),
        **chain_launch(out),
    )  # fmt: skip


def moe_combine(
    out: torch.Tensor,
    weights: torch.Tensor,
    places: torch.Tensor,
    tokens: int,
    dtype: torch.dtype,
    down: RowExpand | None = None,
) -> torch.Tensor:
    """`torch_ops.moe_combine` as one Triton kernel: a program per (token, 1,024 columns), or with `down` (the
    experts' down LoRA) per (tile of tokens, column tile), which expands each token's weighted sum of its rows'
    shrunk y once per group instead of every row's."""
    rows, width = out.shape
    if out.stride(1) != 1 or rows % max(tokens, 1) or places.shape != (rows,) or weights.shape != (rows,):
        raise ValueError(
            f"moe_combine needs rows out [T*k, H] with unit column stride, weights and places [T*k]; got out "
            f"{list(out.shape)} (strides {out.stride()}), weights {list(weights.shape)}, places "
            f"{list(places.shape)}, T {tokens}"
        )
    result = torch.empty(tokens, width, dtype=dtype, device=out.device)
    if result.numel() and down is not None:
        _combine_down(out, weights, places, down, result)
    elif result.numel():
        block = min(triton.next_power_of_2(width), 1024)
        grid = (tokens, triton.cdiv(width, block))
        _combine_kernel[grid](
            out, weights, places, result, width, out.stride(0), result.stride(0), K=rows // tokens, BLOCK_H=block,
            **chain_launch(out),
        )  # fmt: skip
    return result


# expert_matmul's tiles (BLOCK_N the widest column tile: an expand's parts may take a half or less of it), from
# benchmarks/bench_expert_matmul.py on the H200 (2026-12-03): 128 x 64 columns x K where a program has little K to
# stream or many rows (inkling-small's down GEMM 1.08-1.17x at 8-128 tokens, its gate/up 1.26x at 128), 64 x 128
# for the deep, few-row gate/up of decode (0.96-0.99x with the wider tile). The sweep sets `tile_override`.
WIDE_TILES = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
DEEP_TILES = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
tile_override: dict | None = None


def expert_tiles(depth: int, max_rows: int) -> dict:
    """expert_matmul's tiles for weights of K = `depth` and up to `max_rows` rows per expert."""
    if tile_override is not None:
        return tile_override
    return WIDE_TILES if depth <= 1024 or max_rows >= 64 else DEEP_TILES


def expert_row_tile(max_rows: int) -> int:
    """expert_matmul's rows per program (BLOCK_M) for up to `max_rows` rows per expert: 16 to 64."""
    return pow2(max_rows, 16, 64)


@triton.jit
def expert_row_block(ends_ptr, e, m_block, BLOCK_M: tl.constexpr):
    """The first dispatched row of block m_block of expert e's rows (ends: each expert's end in the dispatch's row
    order) and the expert's end: a program whose first row is not below the end has no rows."""
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    return start + m_block * BLOCK_M, end


@triton.jit
def _delta_operands(
    e, r, in_r, src, n, in_n, n0, y_ptr, b_ptr, slot_ptr, R, num_slots, part_cols, first, count, split, groups,
    stride_ym, stride_yb, stride_bs, stride_bp, stride_be, stride_bn, stride_br, LATE_Y: tl.constexpr,
    PER_EXPERT: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """What `_slot_deltas` needs of columns n (one part, starting at n0) of expert e's tile, loaded before the GEMM's K
    loop so the loads fly beside it: the rows' slots, their y rows (with LATE_Y, y being written beside this kernel:
    y's pointers, for a load after the wait for it), the block of B of the tile's least slot, and B's pointers at that
    slot. The tile is one expert's, so a slot's B for it is one [R, BLOCK_N] block."""
    local = e - first
    slots = tl.load(slot_ptr + r, mask=in_r & (local >= 0) & (local < count), other=-1)
    part = n0 // part_cols
    block = part * groups + (local >= split).to(tl.int32)
    which = local if PER_EXPERT else (local >= split).to(tl.int32)
    j = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + src[:, None] * stride_ym + block * stride_yb + j[None, :]
    y_mask = (slots >= 0)[:, None] & (j < R)[None, :]
    y = y_ptrs
    if not LATE_Y:
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    b_block = (
        b_ptr + part * stride_bp + which.to(tl.int64) * stride_be
        + (n - part * part_cols)[None, :] * stride_bn + j[:, None] * stride_br
    )  # fmt: skip
    b_mask = (j < R)[:, None] & in_n[None, :]
    least = tl.min(tl.where(slots >= 0, slots, num_slots), 0)  # num_slots: the tile holds no slot
    b_block += least.to(tl.int64) * stride_bs
    b_least = tl.load(b_block, mask=b_mask & (least < num_slots), other=0.0)
    return slots, block, y, y_mask, least, b_least, b_block, b_mask


@triton.jit
def _slot_deltas(
    slots, block, y, y_mask, least, b_least, b_block, b_mask, scale_ptr, stride_bs, stride_ss, stride_sb,
    LATE_Y: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Each row's scaled LoRA delta [BLOCK_M, BLOCK_N] (fp32) from `_delta_operands`' (with LATE_Y, y loaded here):
    one [BLOCK_M, R] x [R, BLOCK_N] dot per slot, the tile's least slot's (its B loaded before the K loop) ahead of
    a loop over the rest up to its greatest (B's load masked off for a slot between them that no row holds), so a
    tile of one adapter's rows does one dot however many slots the pool has. Each row gets its own slot's product
    only, so the rows' scalings apply once, after the loop."""
    if LATE_Y:
        y = tl.load(y, mask=y_mask, other=0.0)
    y_least = tl.where((slots == least)[:, None], y, tl.zeros_like(y))
    delta = tl.dot(y_least, b_least, input_precision="ieee" if IEEE else None)
    for slot in range(least + 1, tl.max(slots, 0) + 1):  # the tile's other slots, up to its greatest
        b_block += stride_bs
        rows_of_slot = slots == slot
        held = tl.max(rows_of_slot.to(tl.int32), 0) > 0
        b = tl.load(b_block, mask=b_mask & held, other=0.0)
        y_slot = tl.where(rows_of_slot[:, None], y, tl.zeros_like(y))
        delta = tl.dot(y_slot, b, delta, input_precision="ieee" if IEEE else None)
    scale = tl.load(scale_ptr + slots * stride_ss + block * stride_sb, mask=slots >= 0, other=0.0).to(tl.float32)
    return delta * scale[:, None]


@triton.jit
def _expert_matmul_kernel(
    x_ptr, w_ptr, ends_ptr, tokens_ptr, out_ptr, N, K, stride_xm, stride_we, stride_wn, stride_om, every_from,
    y_ptr, b_ptr, slot_ptr, scale_ptr, R, num_slots, part_cols, first, count, split, groups, stride_ym, stride_yb,
    stride_bs, stride_bp, stride_be, stride_bn, stride_br, stride_ss, stride_sb,
    GATHER: tl.constexpr, IEEE: tl.constexpr, EXPAND: tl.constexpr, PER_EXPERT: tl.constexpr,
    WAIT_FOR_Y: tl.constexpr, CHAINED: tl.constexpr, PREFETCH_W: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Expert e's rows m_block*BLOCK_M .. (of its own) times its weight's columns n_block*BLOCK_N ..: programs past
    the expert's rows return at once. With EXPAND, each row's LoRA delta (`torch_ops.RowExpand`) is added to the
    output rounded, itself rounded first, as `plus_delta` adds it after a GEMM: after the K loop, one dot per slot
    (`_slot_deltas`), the rows' y and the least slot's B loaded before the loop (`_delta_operands`). With WAIT_FOR_Y
    (y is being written by the chained shrink launched before this one, which waited for the kernels before it) y is
    read after the loop and the wait, which is when the next kernel may launch.

    CHAINED (`triton_pdl`): the program lets the next kernel launch and waits for the one before it (the dispatch,
    whose row counts it reads) first; the first program of each column block of an expert that every token routes
    to (ids from `every_from`: the shared experts) asks L2 for its weight block before it waits (PREFETCH_W). With
    EXPAND it lets the next kernel launch only after its wait, so that kernel (silu * up with the down shrink, after
    the gate/up GEMM) may read the dispatch's rows before its own wait."""
    n_block = tl.program_id(0)
    m_block = tl.program_id(1)
    e = tl.program_id(2)
    if CHAINED:
        if not EXPAND:
            gdc_launch_dependents()
        if PREFETCH_W:
            first_of_block = (m_block == 0) & (e >= every_from)  # the shared experts always have rows
            if first_of_block:
                prefetch_rows_l2(w_ptr + e.to(tl.int64) * stride_we, n_block * BLOCK_N, N, K, stride_wn, BLOCK_N)
        gdc_wait()
        if EXPAND:  # the kernel after it may read before its own wait what the kernels before this one wrote
            gdc_launch_dependents()
    first_row, end = expert_row_block(ends_ptr, e, m_block, BLOCK_M)
    if first_row >= end:
        return
    r = first_row + tl.arange(0, BLOCK_M)
    in_r = r < end
    src = tl.load(tokens_ptr + r, mask=in_r, other=0).to(tl.int64) if GATHER else r
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    if EXPAND:  # y is written before this kernel unless the shrink beside it writes it (WAIT_FOR_Y)
        slots, block, y, y_mask, least, b_least, b_block, b_mask = _delta_operands(
            e, r, in_r, src, n, in_n, n_block * BLOCK_N, y_ptr, b_ptr, slot_ptr, R, num_slots, part_cols, first,
            count, split, groups, stride_ym, stride_yb, stride_bs, stride_bp, stride_be, stride_bn, stride_br,
            WAIT_FOR_Y, PER_EXPERT, BLOCK_R,
        )  # fmt: skip
    k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src[:, None] * stride_xm + k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = (k0 + k) < K
        a = tl.load(a_ptrs + k0, mask=in_r[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=in_n[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee" if IEEE else None)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if WAIT_FOR_Y:  # the shrink launched before this GEMM, which ran beside its K loop
        wait_then_trigger()  # triggering before the K loop instead made the step slower
    if EXPAND:  # a row without LoRA adds an exact 0
        delta = _slot_deltas(
            slots, block, y, y_mask, least, b_least, b_block, b_mask, scale_ptr, stride_bs, stride_ss, stride_sb,
            WAIT_FOR_Y, IEEE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        out = (out.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + r[:, None] * stride_om + n[None, :], out, mask=in_r[:, None] & in_n)


def _expand_operands(expand: RowExpand, y_rows: int, rows: int, width: int) -> tuple[int, int, int, int, tuple, int]:
    """`expand`'s B as (slots, parts, columns per part, rank, strides [S, P, E, N, R], y's stride between rank
    blocks), checked against y's rows and the output [rows, width] it adds to."""
    y, b, groups = expand.y, expand.b, expand.groups
    if expand.per_expert:
        num_slots, parts, count, part_cols, rank = b.shape
        b_strides = b.stride()
        block_stride = rank
        want_y = (y_rows, parts * groups.groups * rank)
    else:  # one B per group: the group takes the expert's place in B's strides
        num_slots, _, part_cols, rank = b.shape
        parts, count = 1, groups.count
        b_strides = (b.stride(0), 0, b.stride(1), b.stride(2), b.stride(3))
        block_stride = 0
        want_y = (y_rows, rank)
    require(
        tuple(y.shape) == want_y and y.stride(1) == 1,
        f"the expand's y must be {list(want_y)} with unit column stride, got {list(y.shape)} (strides {y.stride()})",
    )
    require(parts * part_cols == width, f"the expand's B gives {parts} x {part_cols} columns, the output {width}")
    require(groups.count == count, f"groups cover {groups.count} experts, the expand's B has {count}")
    require(expand.slots.shape == (rows,), f"the expand's slots must be [M={rows}], got {list(expand.slots.shape)}")
    return num_slots, parts, part_cols, rank, b_strides, block_stride


def _expand_args(expand: RowExpand, x: torch.Tensor, rows: int, width: int, widest: int) -> tuple[list, dict]:
    """The kernel's LoRA arguments for `expand` (checked against x [., K] and the output [rows, width]) and its
    constexprs, with a column tile that does not straddle two parts (gate | up)."""
    y, groups = expand.y, expand.groups
    num_slots, parts, part_cols, rank, b_strides, block_stride = _expand_operands(expand, x.shape[0], rows, width)
    sizes = (widest >> halving for halving in range(widest.bit_length()))
    block_n = next((size for size in sizes if parts == 1 or part_cols % size == 0), 0)
    require(block_n >= 16, f"the expand's {part_cols} columns per part must be a multiple of 16")
    stride_ss, stride_sb = scale_strides(expand.scalings, num_slots, parts * groups.groups)
    args = [
        y, expand.b, expand.slots, expand.scalings, rank, num_slots, part_cols, groups.first, groups.count,
        local_split(groups), groups.groups, y.stride(0), block_stride, *b_strides, stride_ss, stride_sb,
    ]  # fmt: skip
    return args, dict(EXPAND=True, PER_EXPERT=expand.per_expert, BLOCK_R=pow2(rank, 16), BLOCK_N=block_n)


def expert_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    tokens: torch.Tensor | None,
    max_rows: int,
    expand: RowExpand | None = None,
    every_token_from: int | None = None,
) -> torch.Tensor:
    """`torch_ops.expert_matmul` as one Triton kernel, a program per (column block, block of an expert's rows,
    expert), each streaming its expert's weight block once for up to 64 rows: at decode sizes (a few rows per
    expert) it reads the weights near the memory's speed, where a grouped GEMM's 128-row tiles do not. `expand`'s
    LoRA is added in the epilogue, so an adapter costs no launch and no second pass over the output; a `TokenShrink`
    y is launched just before, beside the K loop. Otherwise, on CUDA, the kernel is chained into the step
    (`triton_pdl`), and the experts from `every_token_from` on (those every token routes to) have their weight asked
    into L2 before it waits."""
    experts, width, depth = weight.shape
    rows = tokens.shape[0] if tokens is not None else x.shape[0]
    if x.shape[-1] != depth or x.stride(-1) != 1 or weight.stride(-1) != 1 or ends.shape != (experts,):
        raise ValueError(
            f"expert_matmul needs x [., K] and weight [E, N, K] with unit stride along K, ends [E]; got x "
            f"{list(x.shape)} (strides {x.stride()}), weight {list(weight.shape)}, ends {list(ends.shape)}"
        )
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    wait = False
    if expand is not None and isinstance(expand.y, TokenShrink):
        wait = x.is_cuda  # CPU tensors: Triton's interpreter (tests), which has no programmatic launch
        expand = replace(expand, y=lora_shrink(x, expand.y.a, expand.y.token_slots, chained=True))
    tiles = expert_tiles(depth, max_rows)
    if expand is None:
        lora = [ends] * 4 + [0] * 16
        consts = dict(EXPAND=False, PER_EXPERT=False, BLOCK_R=16, BLOCK_N=tiles["BLOCK_N"])
    else:
        lora, consts = _expand_args(expand, x, rows, width, tiles["BLOCK_N"])
    consts["WAIT_FOR_Y"] = wait
    # chained on CUDA, unless paired with the shrink launched just before it (WAIT_FOR_Y)
    launch = pair_launch(x) if wait else chain_launch(x)
    consts["PREFETCH_W"] = launch["CHAINED"] and every_token_from is not None and rows_prefetchable(weight)
    block_m = expert_row_tile(max_rows)
    grid = (triton.cdiv(width, consts["BLOCK_N"]), triton.cdiv(max_rows, block_m), experts)
    _expert_matmul_kernel[grid](
        x, weight, ends, tokens if tokens is not None else ends, out, width, depth, x.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), experts if every_token_from is None else every_token_from,
        *lora, GATHER=tokens is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_K=tiles["BLOCK_K"], num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
        **consts, **launch,
    )  # fmt: skip
    return out


@triton.jit
def _silu_times_up(gate, up, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """silu(gate) * up of fp32 gate and up as torch rounds it: silu = gate / (1 + exp(-gate)) rounded to `dtype`
    (`triton_math.exp`), then the product rounded."""
    silu = (gate / (1.0 + exp(-gate, PRECISE))).to(dtype)
    return (silu.to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, F, stride_xm, stride_om, a_ptr, slot_ptr, expert_ptr, y_ptr, R, first, count, stride_as,
    stride_ae, stride_ar, stride_ym,
    PRECISE: tl.constexpr, SHRINK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """Row m's silu(gate) * up over its column blocks (the grid's second axis strides them); with SHRINK (one
    program per row) also y[m] = act[m] @ A[slot, expert]^T, summed in fp32 over the rounded act, then rounded.

    CHAINED with SHRINK: the program reads the row's slot and expert and its first block of A before its wait, a
    round trip off the chain; the gate/up GEMM before it (`expert_matmul` with its expand) lets it launch only after
    its own wait, so the dispatch that wrote the rows has finished."""
    if SHRINK and CHAINED:
        gdc_launch_dependents()
    else:
        chain_start(CHAINED)
    m = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    rr = tl.arange(0, BLOCK_R)
    y = tl.zeros([BLOCK_R], tl.float32)
    covered = False
    a_ptrs = a_ptr + rr[:, None] * stride_ar
    at = tl.zeros([BLOCK_R, BLOCK], a_ptr.dtype.element_ty)  # without SHRINK, never read
    if SHRINK:
        slot = tl.load(slot_ptr + m)
        local = tl.load(expert_ptr + m).to(tl.int32) - first
        covered = (slot >= 0) & (local >= 0) & (local < count)
        a_ptrs += slot.to(tl.int64) * stride_as + local.to(tl.int64) * stride_ae
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # the first column block
        at = tl.load(a_ptrs + c[None, :], mask=covered & (rr < R)[:, None] & (c < F)[None, :], other=0.0)
        if CHAINED:
            gdc_wait()
    for c0 in range(tl.program_id(1) * BLOCK, F, tl.num_programs(1) * BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        in_c = c < F
        gate = tl.load(x_ptr + m * stride_xm + c, mask=in_c, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + m * stride_xm + F + c, mask=in_c, other=0.0).to(tl.float32)
        act = _silu_times_up(gate, up, dtype, PRECISE)
        tl.store(out_ptr + m * stride_om + c, act, mask=in_c)
        if covered:  # False, a constant, without SHRINK
            y += tl.sum(at.to(tl.float32) * act.to(tl.float32)[None, :], axis=1)
            c_next = c + tl.num_programs(1) * BLOCK  # the next block's A, one block ahead
            at = tl.load(a_ptrs + c_next[None, :], mask=(rr < R)[:, None] & (c_next < F)[None, :], other=0.0)
    if SHRINK:
        tl.store(y_ptr + m * stride_ym + rr, y.to(dtype), mask=rr < R)


def _act_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul's output [M, F] for rows [gate | up] [M, 2F], which it checks."""
    rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul needs rows [M, 2F] with unit column stride, got {list(gate_up.shape)}")
    return torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)


def _silu_mul(gate_up: torch.Tensor, shrink: tuple | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """silu_mul's launch, with `shrink` (lora_a, slots, expert_ids, groups) or without; (act, y or None)."""
    out = _act_rows(gate_up)
    rows, half = out.shape
    block = min(triton.next_power_of_2(half), 1024)
    if shrink is None:
        y, args, consts = None, [gate_up] * 4 + [0] * 7, dict(SHRINK=False, BLOCK_R=16)
        grid = (rows, triton.cdiv(half, block))
    else:
        lora_a, slots, expert_ids, groups = shrink
        _, count, rank, depth = lora_a.shape
        require(depth == half and lora_a.stride(3) == 1, f"lora_a must be [S, E, R, F={half}] with unit F stride")
        require(slots.shape == expert_ids.shape == (rows,), f"slots and expert_ids must be [M={rows}]")
        require(groups.count == count, f"groups cover {groups.count} experts, lora_a has {count}")
        y = torch.empty(rows, rank, dtype=gate_up.dtype, device=gate_up.device)
        args = [lora_a, slots, expert_ids, y, rank, groups.first, count, *lora_a.stride()[:3], y.stride(0)]
        block_r = pow2(rank)
        consts, grid = dict(SHRINK=True, BLOCK_R=block_r), (rows, 1)
        block = min(block, max(16, 8192 // block_r))  # the A tile [R, BLOCK] in registers
    if out.numel():
        _silu_mul_kernel[grid](
            gate_up, out, half, gate_up.stride(0), out.stride(0), *args, PRECISE=gate_up.is_cuda, BLOCK=block, **consts,
            **chain_launch(gate_up),
        )  # fmt: skip
    return out, y


@triton.jit
def _part_delta(y_ptr, y_rows, sel, y_col, stride_yt, b_ptrs, in_c, R, DOT_FP32: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """fp32 [T, F]: the `sel` rows' y rank block starting at column y_col (each row's token's) @ the B tile at b_ptrs
    [BLOCK_R, F] (its ranks past R and its columns outside `in_c` masked)."""
    rr = tl.arange(0, BLOCK_R)
    yt = tl.load(y_ptr + y_rows[:, None] * stride_yt + (y_col + rr)[None, :], mask=sel[:, None] & (rr < R)[None, :],
                 other=0.0)  # fmt: skip
    bt = tl.load(b_ptrs, mask=(rr < R)[:, None] & in_c[None, :], other=0.0)
    return lora_dot(yt, bt, None, DOT_FP32, PRECISION)


@triton.jit
def _silu_mul_lora_kernel(
    x_ptr, out_ptr, M, F, stride_xm, stride_om, y_ptr, b_ptr, slot_ptr, expert_ptr, token_ptr, scale_ptr, R, first,
    E, split, G, stride_yt, stride_bs, stride_bp, stride_be, stride_bn, stride_br, stride_ss, stride_sp,
    PRECISE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """silu(gate) * up over a tile of rows sorted by expert and a column tile, each row's gate/up LoRA added to its
    gate and up as they are read: per (slot, expert) group in the tile (one or two in a prefill tile), y of the
    rows' tokens, block p*G + g, times B[slot, p, expert]^T, rounded as `torch_ops.expert_in_lora_expand` adds it
    in place."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < M
    c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    in_c = c < F
    dtype = out_ptr.dtype.element_ty
    tile = in_t[:, None] & in_c[None, :]
    row_ptrs = x_ptr + rt.to(tl.int64)[:, None] * stride_xm + c[None, :]
    gate = tl.load(row_ptrs, mask=tile, other=0.0)
    up = tl.load(row_ptrs + F, mask=tile, other=0.0)
    slots, local = row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, True)
    keys = row_keys(in_t & (slots >= 0), slots, local, E)
    y_rows = tl.load(token_ptr + rt, mask=in_t, other=0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    b_tile = rr[:, None] * stride_br + c[None, :] * stride_bn
    key = tl.min(keys, 0)
    while key < SENTINEL:
        sel = keys == key
        slot = key // E
        expert = key % E
        group = (expert >= split).to(tl.int32)
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + expert.to(tl.int64) * stride_be + b_tile
        acc = _part_delta(y_ptr, y_rows, sel, group * R, stride_yt, b_ptrs, in_c, R, DOT_FP32, PRECISION, BLOCK_R)
        scale = tl.load(scale_ptr + slot * stride_ss + group * stride_sp).to(tl.float32)
        gate = tl.where(sel[:, None], plus_delta(gate, acc, scale, dtype), gate)
        acc = _part_delta(
            y_ptr, y_rows, sel, (G + group) * R, stride_yt, b_ptrs + stride_bp, in_c, R, DOT_FP32, PRECISION, BLOCK_R
        )
        scale = tl.load(scale_ptr + slot * stride_ss + (G + group) * stride_sp).to(tl.float32)
        up = tl.where(sel[:, None], plus_delta(up, acc, scale, dtype), up)
        keys = tl.where(sel, SENTINEL, keys)
        key = tl.min(keys, 0)
    act = _silu_times_up(gate.to(tl.float32), up.to(tl.float32), dtype, PRECISE)
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_om + c[None, :], act, mask=tile)


def _silu_mul_lora(gate_up: torch.Tensor, expand: RowExpand, tokens: torch.Tensor, out: torch.Tensor) -> None:
    """`_silu_mul_lora_kernel`'s launch over tiles of 32 rows and 64 columns of each half (ptxas for sm_90a, bf16:
    84 registers, no spills; 64 x 128 tiles spilled)."""
    rows, half = out.shape
    y, groups = expand.y, expand.groups
    require(
        isinstance(y, torch.Tensor) and expand.per_expert,
        "silu_mul's LoRA is the experts' gate/up: its shrink y computed, one B per expert",
    )
    num_slots, parts, _, rank, b_strides, _ = _expand_operands(expand, y.shape[0], rows, 2 * half)
    require(parts == 2, f"silu_mul's LoRA needs B of two parts (gate, up), got {parts}")
    require(expand.experts.shape == tokens.shape == (rows,), f"silu_mul's LoRA needs experts and tokens [M={rows}]")
    ss, sp = scale_strides(expand.scalings, num_slots, parts * groups.groups)
    block_f = min(64, max(16, triton.next_power_of_2(half)))
    grid = (triton.cdiv(rows, 32), triton.cdiv(half, block_f))
    _silu_mul_lora_kernel[grid](
        gate_up, out, rows, half, gate_up.stride(0), out.stride(0), y, expand.b, expand.slots, expand.experts, tokens,
        expand.scalings, rank, groups.first, groups.count, local_split(groups), groups.groups, y.stride(0),
        *b_strides, ss, sp, PRECISE=gate_up.is_cuda, **dot_operands(y.dtype, expand.b.dtype), BLOCK_T=32,
        BLOCK_F=block_f, BLOCK_R=pow2(rank),
    )  # fmt: skip


def silu_mul(
    gate_up: torch.Tensor, expand: RowExpand | None = None, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """`torch_ops.silu_mul` as one Triton kernel, torch's formula x / (1 + exp(-x)) with CUDA's exp (libdevice);
    with the gate/up LoRA `expand` of the rows (from tokens `tokens`), one kernel over tiles of rows that adds it as
    it reads them, where an in-place expand first would read and write every row once more."""
    if expand is None:
        return _silu_mul(gate_up, None)[0]
    out = _act_rows(gate_up)
    if out.numel():
        _silu_mul_lora(gate_up, expand, tokens, out)
    return out


def silu_mul_shrink(
    gate_up: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, expert_ids: torch.Tensor, groups: ExpertGroups
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ops.silu_mul_shrink` as one kernel: a program per row holds the row's act, so the down LoRA's shrink
    of it costs a read of the row's A, not a launch that reads the act again."""
    act, y = _silu_mul(gate_up, (lora_a, slots, expert_ids, groups))
    return act, y
