"""The expand kernels, out += scaling * y @ B^T in place, and `launch_expand`, the launcher that picks one.

Token tiles serve every case, dense and expert. The experts' gate/up expand has two more program shapes: one
program per (expert, slot) over rows sorted by expert, and at decode one program per dispatched row, which reads
its own slot and expert.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inkwell.kernels.torch_ops import ExpertGroups
from inkwell.kernels.triton_lora.common import (
    SEGMENT_MAX_ROWS,
    SENTINEL,
    SLOT_LOOP_MIN_TOKENS,
    add_delta,
    dot_operands,
    expand_acc,
    expert_segment,
    local_split,
    parse_slices,
    plus_delta,
    pow2,
    require,
    row_block_n,
    row_expert,
    row_keys,
    row_slots,
    runs_per_row,
    scale_strides,
    slice_of,
    slice_start,
    token_block,
)


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    expert_ptr,
    yrow_ptr,
    scale_ptr,
    T,
    N,
    R,
    first,
    E,
    split,
    G,
    o1,
    o2,
    o3,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bp,
    stride_be,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    HAS_EXPERTS: tl.constexpr,
    EXPERT_IN: tl.constexpr,
    SLOT_LOOP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[t, n] += scale[slot, p*G + g] * y[., rank block] @ B[slot, ., ., n]^T; slot -1 rows untouched.

    Column n belongs to slice p = p(n); a row's expert, as e = expert - first, is in group g = (e >= split)
    of G (linears: g = 0, G = 1). Linears and expert_out (down): y row t, rank block p; B [S, 1, G, N, R]
    stacked along N, per group. EXPERT_IN (gate/up): y row yrow[t] (the row's token), rank block p*G + g;
    B [S, P, E, N_p, R], per slice and expert, indexed by the column inside the slice.
    SLOT_LOOP as in _shrink_kernel; otherwise program_id(1) is the slot.
    """
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    slots, local_e = row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
    rows = in_t & (slots >= 0) if SLOT_LOOP else in_t & (slots == tl.program_id(1))
    if tl.max(rows.to(tl.int32), 0) == 0:
        return
    keys = row_keys(rows, slots, local_e, E)
    y_rows = tl.load(yrow_ptr + rt, mask=in_t, other=0) if EXPERT_IN else rt
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = slice_of(rn, o1, o2, o3)
    r_lo = slice_of(n0, o1, o2, o3) * R  # rank blocks this column tile reads
    r_hi = (slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    # expert_in: slice p's B at p * stride_bp, by the column inside the slice; else B stacked along N
    b_cols = part * stride_bp + (rn - slice_start(part, o1, o2, o3)) * stride_bn if EXPERT_IN else rn * stride_bn
    key = tl.min(keys, 0)
    while key < SENTINEL:
        sel = keys == key
        slot = key // E
        group = (key % E >= split).to(tl.int32)
        b_index = key % E if EXPERT_IN else group
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + b_index.to(tl.int64) * stride_be
        acc = expand_acc(
            y_ptr, y_rows, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, G, group,
            in_n, EXPERT_IN, DOT_FP32, PRECISION, BLOCK_T, BLOCK_N, BLOCK_R,
        )  # fmt: skip
        scale = tl.load(scale_ptr + slot * stride_ss + (part * G + group) * stride_sp, mask=in_n, other=0.0)
        add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale.to(tl.float32)[None, :])
        keys = tl.where(sel, SENTINEL, keys)
        key = tl.min(keys, 0)


@triton.jit
def _segment_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    yrow_ptr,
    ends_ptr,
    scale_ptr,
    N,
    R,
    first,
    split,
    G,
    o1,
    o2,
    o3,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bp,
    stride_be,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    EXPERT_IN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """`_expand_kernel`'s expert cases with one program per (expert, slot, column tile) over the expert's
    segment of the sorted rows: at decode each program has one group, where a token tile's program walks
    every (slot, expert) group of its rows one after another."""
    e = tl.program_id(0)
    slot = tl.program_id(1)
    start, end = expert_segment(ends_ptr, first + e)
    group = (e >= split).to(tl.int32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + (e if EXPERT_IN else group).to(tl.int64) * stride_be
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = slice_of(rn, o1, o2, o3)
    r_lo = slice_of(n0, o1, o2, o3) * R
    r_hi = (slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    b_cols = part * stride_bp + (rn - slice_start(part, o1, o2, o3)) * stride_bn if EXPERT_IN else rn * stride_bn
    scale = tl.load(scale_ptr + slot * stride_ss + (part * G + group) * stride_sp, mask=in_n, other=0.0)
    scale = scale.to(tl.float32)[None, :]
    for t0 in range(start, end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        sel = (rt < end) & (tl.load(slot_ptr + rt, mask=rt < end, other=-1) == slot)
        if tl.max(sel.to(tl.int32), 0) > 0:
            y_rows = tl.load(yrow_ptr + rt, mask=sel, other=0) if EXPERT_IN else rt
            acc = expand_acc(
                y_ptr, y_rows, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, G, group,
                in_n, EXPERT_IN, DOT_FP32, PRECISION, BLOCK_T, BLOCK_N, BLOCK_R,
            )  # fmt: skip
            add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale)


@triton.jit
def _row_in_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    expert_ptr,
    token_ptr,
    scale_ptr,
    N,
    R,
    first,
    count,
    split,
    G,
    o1,
    o2,
    o3,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bp,
    stride_be,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The gate/up expand of one dispatched row's column tile: out[row, n] += scaling * y[token, block p(n)] .
    B[slot, p(n), expert, n], in fp32 elementwise products (a 1-row dot would pad to 16 rows)."""
    row, slot, local, group, covered = row_expert(slot_ptr, expert_ptr, first, count, split)
    if covered:
        token = tl.load(token_ptr + row)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = rn < N
        rr = tl.arange(0, BLOCK_R)
        in_b = in_n[:, None] & (rr < R)[None, :]
        part = slice_of(rn, o1, o2, o3)
        block = part * G + group  # the column's block of y and of the scalings
        b_base = b_ptr + slot * stride_bs + local.to(tl.int64) * stride_be
        b_cols = part * stride_bp + (rn - slice_start(part, o1, o2, o3)) * stride_bn
        bt = tl.load(b_base + b_cols[:, None] + rr[None, :] * stride_br, mask=in_b, other=0.0)
        y_cols = block[:, None] * R + rr[None, :]
        yt = tl.load(y_ptr + token * stride_yt + y_cols * stride_yr, mask=in_b, other=0.0)
        scale = tl.load(scale_ptr + slot * stride_ss + block * stride_sp, mask=in_n, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + row * stride_ot + rn * stride_on
        old = tl.load(out_ptrs, mask=in_n, other=0.0)
        acc = tl.sum(yt.to(tl.float32) * bt.to(tl.float32), axis=1)
        tl.store(out_ptrs, plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=in_n)


@dataclass(frozen=True)
class ExpertRows:
    """Dispatched rows for the expand kernel: each row's expert, the LoRA's groups, and for expert_in
    (gate/up) each row's token, whose row of the shrink result it reads."""

    experts: torch.Tensor
    groups: ExpertGroups
    tokens: torch.Tensor | None = None
    ends: torch.Tensor | None = None  # rows sorted by expert: ends[e] = rows of experts <= e (segment kernels)


def launch_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
    rows: ExpertRows | None = None,
) -> torch.Tensor:
    """out [M, N] += the expand of y's rank blocks over P slices of out's columns; b is [S, P_b, E_b, N_b, R]
    as `_expand_kernel` reads it (linears [S, 1, 1, N, R])."""
    num_slots, _, _, _, rank = b.shape
    tokens, n = out.shape
    parts, o1, o2, o3 = parse_slices(slice_offsets, n)
    groups = ExpertGroups(0, 1) if rows is None else rows.groups
    expert_in = rows is not None and rows.tokens is not None
    blocks = parts * groups.groups if expert_in else parts
    require(
        y.shape[1] == blocks * rank,
        f"y has {y.shape[1]} columns; {blocks} block(s) of B's rank {rank} need {blocks * rank}",
    )
    require(expert_in or y.shape[0] == tokens, f"out must be [T={y.shape[0]}, N], got {tuple(out.shape)}")
    ss, sp = scale_strides(scalings, num_slots, parts * groups.groups)
    if tokens == 0 or rank == 0 or n == 0:
        return out
    split = local_split(groups)
    if expert_in and runs_per_row(tokens):
        block_r = pow2(rank, 2)
        block_n = row_block_n(n, block_r)
        _row_in_expand_kernel[(tokens, triton.cdiv(n, block_n))](
            y,
            b,
            out,
            slots,
            rows.experts,
            rows.tokens,
            scalings,
            n,
            rank,
            groups.first,
            groups.count,
            split,
            groups.groups,
            o1,
            o2,
            o3,
            *y.stride(),
            *b.stride(),
            *out.stride(),
            ss,
            sp,
            BLOCK_N=block_n,
            BLOCK_R=block_r,
        )
        return out
    dot = dot_operands(y.dtype, b.dtype)
    if rows is not None and rows.ends is not None and tokens <= SEGMENT_MAX_ROWS:
        block_n = 256
        _segment_expand_kernel[(groups.count, num_slots, triton.cdiv(n, block_n))](
            y,
            b,
            out,
            slots,
            rows.tokens if expert_in else slots,
            rows.ends,
            scalings,
            n,
            rank,
            groups.first,
            split,
            groups.groups,
            o1,
            o2,
            o3,
            *y.stride(),
            *b.stride(),
            *out.stride(),
            ss,
            sp,
            EXPERT_IN=expert_in,
            **dot,
            BLOCK_T=16,
            BLOCK_N=block_n,
            BLOCK_R=pow2(rank * parts, 16, 64),
        )
        return out
    block_t = token_block(tokens)
    slot_loop = tokens > SLOT_LOOP_MIN_TOKENS
    # prefill (slot walk) over slices: 64-column tiles reading one slice's rank block a step, 102 registers (ptxas,
    # sm_90a) where 128 columns reading every slice's ranks took 255 and spilled; q/k/v/r's LoRA at 4,096 tokens
    # 39-42 -> 34-36 µs (bench_lora_kernels, H200). One slice keeps 128 columns.
    block_n = 256 if tokens <= 16 else 64 if slot_loop and parts > 1 else 128
    grid = (triton.cdiv(tokens, block_t), 1 if slot_loop else num_slots, triton.cdiv(n, block_n))
    _expand_kernel[grid](
        y,
        b,
        out,
        slots,
        slots if rows is None else rows.experts,
        rows.tokens if expert_in else slots,
        scalings,
        tokens,
        n,
        rank,
        groups.first,
        groups.count,
        split,
        groups.groups,
        o1,
        o2,
        o3,
        *y.stride(),
        *b.stride(),
        *out.stride(),
        ss,
        sp,
        HAS_EXPERTS=rows is not None,
        EXPERT_IN=expert_in,
        SLOT_LOOP=slot_loop,
        **dot,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=pow2(rank, 16, 64) if slot_loop else pow2(rank * parts, 16, 64),
    )
    return out
