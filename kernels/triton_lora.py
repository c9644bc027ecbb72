"""Triton multi-LoRA kernels: segmented shrink and expand over a per-token adapter slot index.

Twins of `inkwell.kernels.torch_ops` (same signatures, same results up to summation order), plus
sliced variants for fused projections (q/k/v/r, gate/up) and a fused shrink+expand for decode.

Every kernel gives one program a tile of BLOCK_T consecutive tokens and one slot: it masks the tile
down to that slot's tokens (and for routed experts walks the experts those tokens went to), so mixed
adapters, base-model tokens (slot -1) and slots absent from the batch need no sort, no host sync and
a grid that depends only on shapes, which keeps every launch CUDA-graph capturable. Programs of
absent slots exit after reading BLOCK_T slot ids. The experts' kernels have two more shapes: one program
per (expert, slot) over rows sorted by expert, and at decode one program per dispatched row, which reads
its own slot and expert.

Slot buffers are zero-padded to the largest rank, so per-slot ranks need no rank table. A sliced
projection keeps A stacked along the rank ([S, P*R, K]) and B stacked along the output ([S, N, R]);
output column n belongs to slice p(n) and reads rank block p(n) of the stacked shrink result: the
expand multiplies by a block-diagonal B it never materializes.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.dispatch import FUSED_MAX_N, FUSED_MAX_TOKENS
from inkwell.kernels.torch_ops import ExpertGroups

_NONE = tl.constexpr(2**30)  # sentinel expert id: "no row left"
MAX_SLICES = 4
SLOT_LOOP_MIN_TOKENS = 64  # above, a program walks its tile's slots instead of one program per slot
# Up to this many dispatched rows sorted by expert (with their segment ends), the expert kernels run one program
# per (expert, slot): decode's few rows per expert then take one step each instead of a walk over all groups.
SEGMENT_MAX_ROWS = 1024
# Up to this many dispatched rows (decode), the expert gate/up expand and the fused down run one program per
# (row, column tile) instead: the row's slot, expert and token locate its factors, so no program searches a
# segment, every load goes out at once, and the grid does the same work for one adapter as for eight.
ROW_MAX_ROWS = 256
ROW_TILE_ELEMENTS = 8192  # elements of a per-row program's A block ([R, K]); its B tile ([N, R]) holds half


@triton.jit
def _slice_of(n, o1, o2, o3):
    """Slice index of output column(s) n, given the slice starts o1 <= o2 <= o3 (N where unused)."""
    return (n >= o1).to(tl.int32) + (n >= o2).to(tl.int32) + (n >= o3).to(tl.int32)


@triton.jit
def _slice_start(part, o1, o2, o3):
    """First output column of slice(s) `part`."""
    return tl.where(part >= 1, o1, 0) + tl.where(part >= 2, o2 - o1, 0) + tl.where(part >= 3, o3 - o2, 0)


@triton.jit
def _row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS: tl.constexpr):
    """Each row's slot and expert - first; rows of experts outside first .. first+E-1 get slot -1."""
    slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
    if HAS_EXPERTS:
        local = tl.load(expert_ptr + rt, mask=in_t, other=0).to(tl.int32) - first
        slots = tl.where((local >= 0) & (local < E), slots, -1)
    else:
        local = tl.zeros_like(rt)
    return slots, local


@triton.jit
def _row_keys(rows, slots, local, E):
    """Group key slot * E + local expert of each selected row; _NONE elsewhere."""
    return tl.where(rows, slots.to(tl.int32) * E + local, _NONE)


@triton.jit
def _expand_acc(
    y_ptr,
    y_rows,
    sel,
    stride_yt,
    stride_yr,
    b_base,
    b_cols,
    stride_br,
    part,
    r_lo,
    r_hi,
    R,
    G,
    group,
    in_n,
    EXPERT_IN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """fp32 [BLOCK_T, BLOCK_N]: the selected rows' y rank blocks (virtual ranks r_lo .. r_hi-1) times B^T, each
    column reading only its slice's block (see `_expand_kernel`)."""
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        rj = r0 + tl.arange(0, BLOCK_R)
        y_cols = (rj // R) * (G * R) + group * R + rj % R if EXPERT_IN else rj
        yt = tl.load(
            y_ptr + y_rows[:, None] * stride_yt + y_cols[None, :] * stride_yr,
            mask=sel[:, None] & (rj[None, :] < r_hi),
            other=0.0,
        )
        local = rj[:, None] - (part * R)[None, :]  # rank inside column n's slice
        bt = tl.load(
            b_base + b_cols[None, :] + local * stride_br, mask=(local >= 0) & (local < R) & in_n[None, :], other=0.0
        )
        if DOT_FP32:
            acc = tl.dot(yt.to(tl.float32), bt.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(yt, bt.to(yt.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _plus_delta(old, acc, scale, dtype: tl.constexpr):
    """old + acc * scale in `dtype`, the delta rounded to it first, as the torch twins add it."""
    delta = (acc * scale).to(dtype).to(tl.float32)
    return (old.to(tl.float32) + delta).to(dtype)


@triton.jit
def _add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale):
    """out[rows, columns] += acc * scale (see `_plus_delta`)."""
    out_ptrs = out_ptr + rt[:, None] * stride_ot + rn[None, :] * stride_on
    m = sel[:, None] & in_n[None, :]
    old = tl.load(out_ptrs, mask=m, other=0.0)
    tl.store(out_ptrs, _plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    slot_ptr,
    expert_ptr,
    T,
    K,
    R,
    first,
    E,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    HAS_EXPERTS: tl.constexpr,
    SLOT_LOOP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """y[t, r-block] = x[t] @ A[slot, expert - first]^T; slot -1 rows (and uncovered experts') get zeros.

    SLOT_LOOP: one program per token tile walks the tile's (slot, expert) groups (long segments);
    otherwise program_id(1) - 1 picks the slot (-1: the zeros), so slots run in parallel (decode).
    LAUNCH_DEPENDENTS lets a kernel launched after this one with programmatic dependent launch start now
    (`_linear_kernel`: it waits for y only in its epilogue).
    """
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_t = rt < T
    slots, local = _row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
    y_ptrs = y_ptr + rt[:, None] * stride_yt + rr[None, :] * stride_yr
    in_r = rr[None, :] < R
    zeros = tl.zeros((BLOCK_T, BLOCK_R), dtype=y_ptr.dtype.element_ty)
    if SLOT_LOOP:
        tl.store(y_ptrs, zeros, mask=(in_t & (slots < 0))[:, None] & in_r)
        rows = in_t & (slots >= 0)
    else:
        slot = tl.program_id(1) - 1
        if slot < 0:
            tl.store(y_ptrs, zeros, mask=(in_t & (slots < 0))[:, None] & in_r)
            return
        rows = in_t & (slots == slot)
    keys = _row_keys(rows, slots, local, E)
    key = tl.min(keys, 0)
    while key < _NONE:
        sel = keys == key
        a_base = a_ptr + (key // E).to(tl.int64) * stride_as + (key % E).to(tl.int64) * stride_ae
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            in_k = rk < K
            xt = tl.load(
                x_ptr + rt[:, None] * stride_xt + rk[None, :] * stride_xk, mask=sel[:, None] & in_k[None, :], other=0.0
            )
            at = tl.load(
                a_base + rk[:, None] * stride_ak + rr[None, :] * stride_ar, mask=in_k[:, None] & in_r, other=0.0
            )
            acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision=PRECISION)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=sel[:, None] & in_r)
        keys = tl.where(sel, _NONE, keys)
        key = tl.min(keys, 0)


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
    slots, local_e = _row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
    rows = in_t & (slots >= 0) if SLOT_LOOP else in_t & (slots == tl.program_id(1))
    if tl.max(rows.to(tl.int32), 0) == 0:
        return
    keys = _row_keys(rows, slots, local_e, E)
    y_rows = tl.load(yrow_ptr + rt, mask=in_t, other=0) if EXPERT_IN else rt
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = _slice_of(rn, o1, o2, o3)
    r_lo = _slice_of(n0, o1, o2, o3) * R  # rank blocks this column tile reads
    r_hi = (_slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    # expert_in: slice p's B at p * stride_bp, by the column inside the slice; else B stacked along N
    b_cols = part * stride_bp + (rn - _slice_start(part, o1, o2, o3)) * stride_bn if EXPERT_IN else rn * stride_bn
    key = tl.min(keys, 0)
    while key < _NONE:
        sel = keys == key
        slot = key // E
        group = (key % E >= split).to(tl.int32)
        b_index = key % E if EXPERT_IN else group
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + b_index.to(tl.int64) * stride_be
        acc = _expand_acc(
            y_ptr, y_rows, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, G, group,
            in_n, EXPERT_IN, DOT_FP32, PRECISION, BLOCK_T, BLOCK_N, BLOCK_R,
        )  # fmt: skip
        scale = tl.load(scale_ptr + slot * stride_ss + (part * G + group) * stride_sp, mask=in_n, other=0.0)
        _add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale.to(tl.float32)[None, :])
        keys = tl.where(sel, _NONE, keys)
        key = tl.min(keys, 0)


@triton.jit
def _fused_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    scale_ptr,
    T,
    K,
    N,
    R,
    o1,
    o2,
    o3,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Shrink then expand in one program: the rank blocks this column tile needs, never leaving registers."""
    slot = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
    rows = in_t & (slots == slot)
    if tl.max(rows.to(tl.int32), 0) == 0:
        return
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = _slice_of(rn, o1, o2, o3)
    r_lo = _slice_of(n0, o1, o2, o3) * R
    r_hi = (_slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    scale = tl.load(scale_ptr + slot * stride_ss + part * stride_sp, mask=in_n, other=0.0).to(tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        rj = r0 + tl.arange(0, BLOCK_R)
        in_r = rj < r_hi
        y = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            in_k = rk < K
            xt = tl.load(
                x_ptr + rt[:, None] * stride_xt + rk[None, :] * stride_xk, mask=rows[:, None] & in_k[None, :], other=0.0
            )
            at = tl.load(
                a_base + rk[:, None] * stride_ak + rj[None, :] * stride_ar,
                mask=in_k[:, None] & in_r[None, :],
                other=0.0,
            )
            y = tl.dot(xt, at.to(xt.dtype), y, input_precision=PRECISION)
        yt = y.to(x_ptr.dtype.element_ty)  # the shrink result is rounded, as the two-launch path stores it
        local = rj[:, None] - (part * R)[None, :]
        bt = tl.load(
            b_base + rn[None, :] * stride_bn + local * stride_br,
            mask=(local >= 0) & (local < R) & in_n[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(yt.to(tl.float32), bt.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(yt, bt.to(yt.dtype), acc, input_precision=PRECISION)
    _add_delta(out_ptr, rt, rn, stride_ot, stride_on, rows, in_n, acc, scale[None, :])


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    scale_ptr,
    T,
    K,
    N,
    R,
    o1,
    o2,
    o3,
    stride_xt,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    WAIT_FOR_SHRINK: tl.constexpr,
    ONE_SLICE_PER_TILE: tl.constexpr,
    PREFETCH_B: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[:, tile] = x @ W[tile]^T plus each token's (sliced) LoRA expand of y, as the tile's epilogue.

    Launched right after the shrink that writes y, with programmatic dependent launch (WAIT_FOR_SHRINK): the
    GEMM's K loop runs while the shrink does, and only the epilogue waits for it. Each token gathers its own
    slot's B, so one program serves every adapter in the batch. The slots and scalings, and up to rank BLOCK_R
    the tile's B rows too (PREFETCH_B), are loaded before the K loop, so their latency hides behind it. Where
    every slice starts on a tile boundary (ONE_SLICE_PER_TILE) the tile reads one rank block of y per token, not
    one per column.
    """
    rt = tl.arange(0, BLOCK_T)
    in_t = rt < T
    n0 = tl.program_id(0) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
    adapted = (slots >= 0)[:, None] & in_n[None, :]
    if ONE_SLICE_PER_TILE:
        part = _slice_of(n0, o1, o2, o3)
        scale = tl.load(scale_ptr + slots * stride_ss + part * stride_sp, mask=slots >= 0, other=0.0)[:, None]
        y_rows = y_ptr + rt[:, None] * stride_yt + (part * R) * stride_yr  # [BLOCK_T, 1]
    else:
        part = _slice_of(rn, o1, o2, o3)
        scale = tl.load(scale_ptr + slots[:, None] * stride_ss + part[None, :] * stride_sp, mask=adapted, other=0.0)
        y_rows = y_ptr + rt[:, None, None] * stride_yt + (part * R)[None, :, None] * stride_yr  # [BLOCK_T, BLOCK_N, 1]
    b_rows = b_ptr + slots.to(tl.int64)[:, None, None] * stride_bs + rn[None, :, None] * stride_bn
    if PREFETCH_B:  # R <= BLOCK_R: the tile's whole B gather is in flight while the K loop runs
        rr = tl.arange(0, BLOCK_R)
        in_b = adapted[:, :, None] & (rr < R)[None, None, :]
        b_early = tl.load(b_rows + rr[None, None, :] * stride_br, mask=in_b, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        xt = tl.load(
            x_ptr + rt[:, None] * stride_xt + rk[None, :] * stride_xk, mask=in_t[:, None] & in_k[None, :], other=0.0
        )
        wt = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk, mask=in_n[None, :] & in_k[:, None], other=0.0
        )
        acc = tl.dot(xt, wt.to(xt.dtype), acc, input_precision=PRECISION)
    # as F.linear then the in-place expand: the base rounded, the delta rounded, their sum rounded
    out = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if WAIT_FOR_SHRINK:
        gdc_wait()
    delta = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):  # y[t, rank block p(n)] . B[slot_t, n]
        rr = r0 + tl.arange(0, BLOCK_R)
        in_b = adapted[:, :, None] & (rr < R)[None, None, :]
        bt = b_early if PREFETCH_B else tl.load(b_rows + rr[None, None, :] * stride_br, mask=in_b, other=0.0)
        if ONE_SLICE_PER_TILE:  # one rank block per token, broadcast over the tile's columns
            in_y = (slots >= 0)[:, None] & (rr < R)[None, :]
            yt = tl.load(y_rows + rr[None, :] * stride_yr, mask=in_y, other=0.0).to(tl.float32)[:, None, :]
        else:
            yt = tl.load(y_rows + rr[None, None, :] * stride_yr, mask=in_b, other=0.0).to(tl.float32)
        delta += tl.sum(yt * bt.to(tl.float32), axis=2)
    out += (delta * scale.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    out_ptrs = out_ptr + rt[:, None] * stride_ot + rn[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_t[:, None] & in_n[None, :])


@triton.jit
def _segment(ends_ptr, expert):
    """Rows start .. end-1 of `expert` among dispatched rows sorted by expert (ends: cumulative row counts)."""
    start = tl.load(ends_ptr + tl.maximum(expert - 1, 0), mask=expert > 0, other=0)
    return start, tl.load(ends_ptr + expert)


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
    start, end = _segment(ends_ptr, first + e)
    group = (e >= split).to(tl.int32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + (e if EXPERT_IN else group).to(tl.int64) * stride_be
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = _slice_of(rn, o1, o2, o3)
    r_lo = _slice_of(n0, o1, o2, o3) * R
    r_hi = (_slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    b_cols = part * stride_bp + (rn - _slice_start(part, o1, o2, o3)) * stride_bn if EXPERT_IN else rn * stride_bn
    scale = tl.load(scale_ptr + slot * stride_ss + (part * G + group) * stride_sp, mask=in_n, other=0.0)
    scale = scale.to(tl.float32)[None, :]
    for t0 in range(start, end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        sel = (rt < end) & (tl.load(slot_ptr + rt, mask=rt < end, other=-1) == slot)
        if tl.max(sel.to(tl.int32), 0) > 0:
            y_rows = tl.load(yrow_ptr + rt, mask=sel, other=0) if EXPERT_IN else rt
            acc = _expand_acc(
                y_ptr, y_rows, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, G, group,
                in_n, EXPERT_IN, DOT_FP32, PRECISION, BLOCK_T, BLOCK_N, BLOCK_R,
            )  # fmt: skip
            _add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale)


@triton.jit
def _segment_down_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    ends_ptr,
    scale_ptr,
    K,
    N,
    R,
    first,
    split,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bg,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sg,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The down projection's LoRA in one launch, one program per (expert, slot, column tile) over the expert's
    segment: x @ A[slot, expert]^T stays in registers, then @ B[slot, group]^T is added to the column tile."""
    e = tl.program_id(0)
    slot = tl.program_id(1)
    start, end = _segment(ends_ptr, first + e)
    group = (e >= split).to(tl.int32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + e.to(tl.int64) * stride_ae
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + group.to(tl.int64) * stride_bg
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rn < N
    rr = tl.arange(0, BLOCK_R)
    in_r = rr < R
    scale = tl.load(scale_ptr + slot * stride_ss + group * stride_sg).to(tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        sel = (rt < end) & (tl.load(slot_ptr + rt, mask=rt < end, other=-1) == slot)
        if tl.max(sel.to(tl.int32), 0) > 0:
            y = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                in_k = rk < K
                xt = tl.load(
                    x_ptr + rt[:, None] * stride_xt + rk[None, :] * stride_xk,
                    mask=sel[:, None] & in_k[None, :],
                    other=0.0,
                )
                at = tl.load(
                    a_base + rk[:, None] * stride_ak + rr[None, :] * stride_ar,
                    mask=in_k[:, None] & in_r[None, :],
                    other=0.0,
                )
                y = tl.dot(xt, at.to(xt.dtype), y, input_precision=PRECISION)
            yt = y.to(x_ptr.dtype.element_ty)  # rounded, as the two-launch path stores it
            bt = tl.load(
                b_base + rn[None, :] * stride_bn + rr[:, None] * stride_br,
                mask=in_r[:, None] & in_n[None, :],
                other=0.0,
            )
            if DOT_FP32:
                acc = tl.dot(yt.to(tl.float32), bt.to(tl.float32), input_precision=PRECISION)
            else:
                acc = tl.dot(yt, bt.to(yt.dtype), input_precision=PRECISION)
            _add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale)


@triton.jit
def _row_expert(slot_ptr, expert_ptr, first, count, split):
    """Dispatched row program_id(0)'s slot, its expert counted from `first`, its group, and whether a LoRA
    covers it (a slot, and an expert among the `count` covered)."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    local = tl.load(expert_ptr + row).to(tl.int32) - first
    return row, slot, local, (local >= split).to(tl.int32), (slot >= 0) & (local >= 0) & (local < count)


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
    row, slot, local, group, covered = _row_expert(slot_ptr, expert_ptr, first, count, split)
    if covered:
        token = tl.load(token_ptr + row)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = rn < N
        rr = tl.arange(0, BLOCK_R)
        in_b = in_n[:, None] & (rr < R)[None, :]
        part = _slice_of(rn, o1, o2, o3)
        block = part * G + group  # the column's block of y and of the scalings
        b_base = b_ptr + slot * stride_bs + local.to(tl.int64) * stride_be
        b_cols = part * stride_bp + (rn - _slice_start(part, o1, o2, o3)) * stride_bn
        bt = tl.load(b_base + b_cols[:, None] + rr[None, :] * stride_br, mask=in_b, other=0.0)
        y_cols = block[:, None] * R + rr[None, :]
        yt = tl.load(y_ptr + token * stride_yt + y_cols * stride_yr, mask=in_b, other=0.0)
        scale = tl.load(scale_ptr + slot * stride_ss + block * stride_sp, mask=in_n, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + row * stride_ot + rn * stride_on
        old = tl.load(out_ptrs, mask=in_n, other=0.0)
        acc = tl.sum(yt.to(tl.float32) * bt.to(tl.float32), axis=1)
        tl.store(out_ptrs, _plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def _row_down_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    expert_ptr,
    scale_ptr,
    K,
    N,
    R,
    first,
    count,
    split,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bg,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sg,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The down LoRA of one dispatched row's column tile: y = x[row] @ A[slot, expert]^T (rounded to x's dtype,
    as the two-launch path stores it), then out[row, tile] += scaling * y @ B[slot, group, tile]^T. B, the
    output and the scaling load before the shrink's loop, so their latency hides behind it."""
    row, slot, local, group, covered = _row_expert(slot_ptr, expert_ptr, first, count, split)
    if covered:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = rn < N
        rr = tl.arange(0, BLOCK_R)
        in_r = rr < R
        b_base = b_ptr + slot * stride_bs + group.to(tl.int64) * stride_bg
        b_ptrs = b_base + rn[:, None] * stride_bn + rr[None, :] * stride_br
        bt = tl.load(b_ptrs, mask=in_n[:, None] & in_r[None, :], other=0.0)
        out_ptrs = out_ptr + row * stride_ot + rn * stride_on
        old = tl.load(out_ptrs, mask=in_n, other=0.0)
        scale = tl.load(scale_ptr + slot * stride_ss + group * stride_sg).to(tl.float32)
        a_base = a_ptr + slot * stride_as + local.to(tl.int64) * stride_ae
        y = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            in_k = rk < K
            xk = tl.load(x_ptr + row * stride_xt + rk * stride_xk, mask=in_k, other=0.0).to(tl.float32)
            a_ptrs = a_base + rr[:, None] * stride_ar + rk[None, :] * stride_ak
            at = tl.load(a_ptrs, mask=in_r[:, None] & in_k[None, :], other=0.0)
            y += tl.sum(at.to(tl.float32) * xk[None, :], axis=1)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        acc = tl.sum(bt.to(tl.float32) * y[None, :], axis=1)
        tl.store(out_ptrs, _plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=in_n)


# ---- launchers ------------------------------------------------------------------------------------


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, triton.next_power_of_2(max(n, 1)))
    return p if hi is None else min(p, hi)


def _row_block_n(n: int, block_r: int) -> int:
    """Column tile of the per-row expert kernels: [BLOCK_N, BLOCK_R] factor tiles of ROW_TILE_ELEMENTS / 2."""
    return min(_pow2(n, 2), max(16, ROW_TILE_ELEMENTS // 2 // block_r))


def _precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 operands (the torch twins do not use TF32); tensor-core default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_t(tokens: int) -> int:
    return _pow2(tokens, 16, 64)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _slices(slice_offsets: tuple[int, ...] | None, n: int) -> tuple[int, int, int, int]:
    """(P, o1, o2, o3) from slice start offsets (0, ..., N); unused starts are N."""
    offsets = (0, n) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    p = len(offsets) - 1
    _check(
        1 <= p <= MAX_SLICES and offsets[0] == 0 and offsets[-1] == n,
        f"slice_offsets must run from 0 to N={n} with 1..{MAX_SLICES} slices, got {offsets}",
    )
    _check(all(a < b for a, b in zip(offsets, offsets[1:], strict=False)), f"slice_offsets must increase: {offsets}")
    starts = list(offsets[1:-1]) + [n] * (MAX_SLICES - p)
    return p, starts[0], starts[1], starts[2]


def _local_split(groups: ExpertGroups) -> int:
    """The kernels' `split`: the second group's first expert counted from `first`; _NONE with one group."""
    return _NONE.value if groups.split is None else groups.split - groups.first


def _check_expert_a(x: torch.Tensor, lora_a: torch.Tensor, groups: ExpertGroups) -> None:
    """Per-expert A [S, E, R, K] for dispatched rows x [M, K], E the experts `groups` cover."""
    _check(lora_a.shape[3] == x.shape[1], f"lora_a's K={lora_a.shape[3]} differs from x's K={x.shape[1]}")
    _check(groups.count == lora_a.shape[1], f"groups cover {groups.count} experts, lora_a has {lora_a.shape[1]}")


def _check_down_b(rows: int, lora_b: torch.Tensor, out: torch.Tensor, groups: ExpertGroups) -> None:
    """One B per group [S, G, N, R] adding into out [M, N]."""
    _check(lora_b.shape[1] == groups.groups, f"lora_b has {lora_b.shape[1]} groups, the groups say {groups.groups}")
    _check(tuple(out.shape) == (rows, lora_b.shape[2]), f"out must be [M={rows}, N={lora_b.shape[2]}]")


def _scale_strides(scalings: torch.Tensor, slots: int, parts: int) -> tuple[int, int]:
    if scalings.dim() == 1:
        _check(scalings.shape[0] == slots, f"scalings must be [S={slots}] or [S, {parts}], got {tuple(scalings.shape)}")
        return scalings.stride(0), 0
    _check(
        tuple(scalings.shape) == (slots, parts),
        f"scalings must be [S={slots}] or [S, {parts}], got {tuple(scalings.shape)}",
    )
    return scalings.stride(0), scalings.stride(1)


def _check_sliced_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
) -> None:
    """x [T,K], A stacked [S, P*R, K] and B stacked [S, N, R] of one sliced projection, and [T] slots."""
    _check(x.dim() == 2 and lora_a.dim() == 3 and lora_b.dim() == 3, "need x [T,K], lora_a [S,P*R,K], lora_b [S,N,R]")
    _check(lora_a.shape[2] == x.shape[1], f"lora_a's K={lora_a.shape[2]} differs from x's K={x.shape[1]}")
    _check(token_slots.shape == (x.shape[0],), f"token_slots must be [T={x.shape[0]}]")
    parts = _slices(slice_offsets, lora_b.shape[1])[0]
    _check(
        lora_a.shape[0] == lora_b.shape[0] and lora_a.shape[1] == parts * lora_b.shape[2],
        f"lora_a {tuple(lora_a.shape)} must be [S, {parts}*R, K] for lora_b {tuple(lora_b.shape)}",
    )


def _shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor | None,
    first: int = 0,
    launch_dependents: bool = False,
) -> torch.Tensor:
    """a is [S, E, R, K] (E=1 with expert stride 0 for the linear case); rows read A[slot, expert - first]."""
    tokens, k = x.shape
    num_slots, num_experts, rank, _ = a.shape
    y = torch.empty((tokens, rank), dtype=x.dtype, device=x.device)
    if tokens == 0 or rank == 0:
        return y
    block_t, block_r = _pow2(tokens, 16, 32), _pow2(rank, 16, 64)
    block_k = _pow2(k, 16, 256 if x.element_size() <= 2 else 128)
    slot_loop = tokens > SLOT_LOOP_MIN_TOKENS
    grid = (triton.cdiv(tokens, block_t), 1 if slot_loop else num_slots + 1, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x,
        a,
        y,
        slots,
        slots if experts is None else experts,
        tokens,
        k,
        rank,
        first,
        num_experts,
        *x.stride(),
        *a.stride(),
        *y.stride(),
        HAS_EXPERTS=experts is not None,
        SLOT_LOOP=slot_loop,
        PRECISION=_precision(x.dtype),
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        LAUNCH_DEPENDENTS=launch_dependents,
    )
    return y


@dataclass(frozen=True)
class _ExpertRows:
    """Dispatched rows for the expand kernel: each row's expert, the LoRA's groups, and for expert_in
    (gate/up) each row's token, whose row of the shrink result it reads."""

    experts: torch.Tensor
    groups: ExpertGroups
    tokens: torch.Tensor | None = None
    ends: torch.Tensor | None = None  # rows sorted by expert: ends[e] = rows of experts <= e (segment kernels)


def _expand(
    y: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
    rows: _ExpertRows | None = None,
) -> torch.Tensor:
    """out [M, N] += the expand of y's rank blocks over P slices of out's columns; b is [S, P_b, E_b, N_b, R]
    as `_expand_kernel` reads it (linears [S, 1, 1, N, R])."""
    num_slots, _, _, _, rank = b.shape
    tokens, n = out.shape
    parts, o1, o2, o3 = _slices(slice_offsets, n)
    groups = ExpertGroups(0, 1) if rows is None else rows.groups
    expert_in = rows is not None and rows.tokens is not None
    blocks = parts * groups.groups if expert_in else parts
    _check(
        y.shape[1] == blocks * rank,
        f"y has {y.shape[1]} columns; {blocks} block(s) of B's rank {rank} need {blocks * rank}",
    )
    _check(expert_in or y.shape[0] == tokens, f"out must be [T={y.shape[0]}, N], got {tuple(out.shape)}")
    ss, sp = _scale_strides(scalings, num_slots, parts * groups.groups)
    if tokens == 0 or rank == 0 or n == 0:
        return out
    split = _local_split(groups)
    if expert_in and tokens <= ROW_MAX_ROWS:
        block_r = _pow2(rank, 2)
        block_n = _row_block_n(n, block_r)
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
    dot_fp32 = y.dtype == torch.float32 or y.dtype != b.dtype  # the tl.dot kernels' operand precision
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
            DOT_FP32=dot_fp32,
            PRECISION="ieee" if dot_fp32 else "tf32",
            BLOCK_T=16,
            BLOCK_N=block_n,
            BLOCK_R=_pow2(rank * parts, 16, 64),
        )
        return out
    block_t = _block_t(tokens)
    block_n = 256 if tokens <= 16 else 128
    slot_loop = tokens > SLOT_LOOP_MIN_TOKENS
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
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=_pow2(rank * parts, 16, 64),
    )
    return out


def _fused(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """One launch, one program per (token tile, slot, column tile); the bench sweeps the tile knobs."""
    tokens, k = x.shape
    num_slots, n, rank = b.shape
    parts, o1, o2, o3 = _slices(slice_offsets, n)
    ss, sp = _scale_strides(scalings, num_slots, parts)
    if tokens == 0 or rank == 0 or n == 0:
        return out
    block_t = _block_t(tokens)
    block_n = block_n or (128 if tokens > 16 and n <= 2048 else 256)
    block_k = block_k or _pow2(k, 16, 256 if x.element_size() <= 2 else 64)
    dot_fp32 = x.dtype == torch.float32 or x.dtype != b.dtype
    grid = (triton.cdiv(tokens, block_t), num_slots, triton.cdiv(n, block_n))
    _fused_kernel[grid](
        x,
        a,
        b,
        out,
        slots,
        scalings,
        tokens,
        k,
        n,
        rank,
        o1,
        o2,
        o3,
        *x.stride(),
        *a.stride(),
        *b.stride(),
        *out.stride(),
        ss,
        sp,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=_pow2(rank, 16, 64),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# ---- public ops: the torch twins' signatures --------------------------------------------------------


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ A[slot]^T -> [T,R]; rows of slot -1 are zero. A stacked [S, P*R, K] gives P rank blocks."""
    _check(x.dim() == 2 and lora_a.dim() == 3, "lora_shrink needs x [T,K] and lora_a [S,R,K]")
    _check(lora_a.shape[2] == x.shape[1], f"lora_a's K={lora_a.shape[2]} differs from x's K={x.shape[1]}")
    _check(token_slots.shape == (x.shape[0],), f"token_slots must be [T={x.shape[0]}]")
    return _shrink(x, lora_a.unsqueeze(1), token_slots, None)


def lora_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[T,N] += scaling[slot] * y[T,R] @ B[slot]^T, in place; rows of slot -1 are untouched."""
    return lora_expand_sliced(y, lora_b, token_slots, scalings, out, None)


def lora_expand_sliced(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
) -> torch.Tensor:
    """Expand of a fused projection: out[:, o_p:o_p+1] += scaling[slot, p] * y[:, pR:(p+1)R] @ B[slot, o_p:o_p+1]^T.

    y [T, P*R] is the shrink over A stacked [S, P*R, K]; lora_b [S, N, R] is B stacked along N;
    slice_offsets (0, o_1, ..., N) are the slices' output starts; scalings [S] or [S, P].
    """
    _check(y.dim() == 2 and lora_b.dim() == 3, "lora_expand needs y [T,R] and lora_b [S,N,R]")
    _check(token_slots.shape == (y.shape[0],), f"token_slots must be [T={y.shape[0]}]")
    _check(tuple(out.shape) == (y.shape[0], lora_b.shape[1]), f"out must be [T={y.shape[0]}, N={lora_b.shape[1]}]")
    return _expand(y, lora_b[:, None, None], token_slots, scalings, out, slice_offsets)


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out += the LoRA delta of x, as lora_expand_sliced(lora_shrink(x, A), B, ...) computes it.

    Up to FUSED_MAX_TOKENS tokens and FUSED_MAX_N columns (decode) this is one launch: the shrink
    result stays in registers.
    """
    _check_sliced_lora(x, lora_a, lora_b, token_slots, slice_offsets)
    _check(tuple(out.shape) == (x.shape[0], lora_b.shape[1]), f"out must be [T, N={lora_b.shape[1]}]")
    if x.shape[0] <= FUSED_MAX_TOKENS and lora_b.shape[1] <= FUSED_MAX_N:
        return _fused(x, lora_a, lora_b, token_slots, scalings, out, slice_offsets)
    return lora_expand_sliced(lora_shrink(x, lora_a, token_slots), lora_b, token_slots, scalings, out, slice_offsets)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x @ W^T plus each token's (sliced) LoRA delta: `F.linear` then `lora_shrink_expand`.

    Up to FUSED_MAX_TOKENS tokens (decode) with one dtype throughout, the LoRA hides behind the base GEMM: the
    shrink launches first and lets the GEMM kernel start at once (programmatic dependent launch), the GEMM's K
    loop runs beside it, and the expand is the GEMM tiles' epilogue. Otherwise the base GEMM, then
    `lora_shrink_expand`.
    """
    _check(x.dim() == 2 and weight.dim() == 2, "lora_linear needs x [T,K] and weight [N,K]")
    _check(weight.shape[1] == x.shape[1], f"weight's K={weight.shape[1]} differs from x's K={x.shape[1]}")
    _check_sliced_lora(x, lora_a, lora_b, token_slots, slice_offsets)
    (tokens, k), n = x.shape, weight.shape[0]
    _check(lora_b.shape[1] == n, f"lora_b's N={lora_b.shape[1]} differs from weight's N={n}")
    num_slots, rank = lora_a.shape[0], lora_b.shape[2]
    one_dtype = len({x.dtype, weight.dtype, lora_a.dtype, lora_b.dtype}) == 1
    # rank 0 too: with no shrink launched, the GEMM's programmatic launch would pair with an unrelated kernel
    if tokens > FUSED_MAX_TOKENS or not one_dtype or rank == 0:
        out = torch.nn.functional.linear(x, weight)
        return lora_shrink_expand(x, lora_a, lora_b, token_slots, scalings, out, slice_offsets)
    parts, o1, o2, o3 = _slices(slice_offsets, n)
    ss, sp = _scale_strides(scalings, num_slots, parts)
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0 or n == 0:
        return out
    pdl = x.is_cuda  # CPU tensors: Triton's interpreter (tests), which has no programmatic launch
    y = _shrink(x, lora_a.unsqueeze(1), token_slots, None, launch_dependents=pdl)
    block_n = 32
    _linear_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y,
        lora_b,
        out,
        token_slots,
        scalings,
        tokens,
        k,
        n,
        rank,
        o1,
        o2,
        o3,
        *x.stride(),
        *weight.stride(),
        *y.stride(),
        *lora_b.stride(),
        *out.stride(),
        ss,
        sp,
        WAIT_FOR_SHRINK=pdl,
        ONE_SLICE_PER_TILE=all(start % block_n == 0 for start in (o1, o2, o3) if start < n),
        PRECISION=_precision(x.dtype),
        BLOCK_T=_block_t(tokens),
        BLOCK_N=block_n,
        BLOCK_K=_pow2(k, 16, 256 if x.element_size() <= 2 else 64),
        PREFETCH_B=rank <= 16,  # a larger block of B would not fit in registers beside the K loop
        BLOCK_R=16,
        num_stages=4 if x.element_size() <= 2 else 2,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def expert_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert - first]^T -> [M,R] (A: [S,E,R,K]); uncovered rows are zero."""
    _check(x.dim() == 2 and lora_a.dim() == 4, "expert_lora_shrink needs x [M,K] and lora_a [S,E,R,K]")
    _check(slots.shape == expert_ids.shape == (x.shape[0],), f"slots and expert_ids must be [M={x.shape[0]}]")
    groups = groups or ExpertGroups(0, lora_a.shape[1])
    _check_expert_a(x, lora_a, groups)
    return _shrink(x, lora_a, slots, expert_ids, groups.first)


def expert_in_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    token_of_row: torch.Tensor,
    groups: ExpertGroups,
    expert_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert B of the projections that read one input (gate/up) on dispatched rows, in place; see the
    torch twin. y [T, P*G*R], lora_b [S, P, E, N, R], scalings [S, P*G], out [M, P*N]. Up to ROW_MAX_ROWS rows,
    one program per row; past that, `expert_ends` (the rows sorted by expert, ends[e] counting those of experts
    <= e) gives one program per expert and slot."""
    _check(y.dim() == 2 and lora_b.dim() == 5, "expert_in_lora_expand needs y [T, P*G*R] and lora_b [S,P,E,N,R]")
    rows = out.shape[0]
    _check(
        slots.shape == expert_ids.shape == token_of_row.shape == (rows,),
        f"slots, expert_ids and token_of_row must be [M={rows}]",
    )
    _, parts, count, n, _ = lora_b.shape
    _check(groups.count == count, f"groups cover {groups.count} experts, lora_b has {count}")
    _check(out.shape[1] == parts * n, f"out must be [M, P*N={parts * n}], got {tuple(out.shape)}")
    offsets = tuple(range(0, parts * n + 1, n))
    rows_of = _ExpertRows(expert_ids, groups, token_of_row, expert_ends)
    return _expand(y, lora_b, slots, scalings, out, offsets, rows_of)


def expert_out_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
) -> torch.Tensor:
    """out[M,N] += scaling[slot, g] * y[M,R] @ B[slot, g]^T for rows whose expert the groups cover (lora_b
    [S, G, N, R], one shared B per group: the down projection), in place."""
    _check(y.dim() == 2 and lora_b.dim() == 4, "expert_out_lora_expand needs y [M,R] and lora_b [S,G,N,R]")
    _check(slots.shape == expert_ids.shape == (y.shape[0],), f"slots and expert_ids must be [M={y.shape[0]}]")
    _check_down_b(y.shape[0], lora_b, out, groups)
    return _expand(y, lora_b[:, None], slots, scalings, out, None, _ExpertRows(expert_ids, groups))


def expert_down_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
    expert_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """out += the down LoRA of dispatched rows x: `expert_out_lora_expand(expert_lora_shrink(x, A), B, ...)`.

    One launch, where the shrink result stays in registers: up to ROW_MAX_ROWS rows one program per (row, column
    tile), and with `expert_ends` (rows sorted by expert) up to SEGMENT_MAX_ROWS one per (expert, slot, column tile).
    """
    _check(lora_a.dim() == 4 and lora_b.dim() == 4, "expert_down_lora needs lora_a [S,E,R,K] and lora_b [S,G,N,R]")
    per_row = x.shape[0] <= ROW_MAX_ROWS
    if not per_row and (expert_ends is None or x.shape[0] > SEGMENT_MAX_ROWS):
        y = expert_lora_shrink(x, lora_a, slots, expert_ids, groups)
        return expert_out_lora_expand(y, lora_b, slots, expert_ids, scalings, out, groups)
    rows, k = x.shape
    num_slots, count, rank, _ = lora_a.shape
    _check(slots.shape == expert_ids.shape == (rows,), f"slots and expert_ids must be [M={rows}]")
    _check_expert_a(x, lora_a, groups)
    _check_down_b(rows, lora_b, out, groups)
    ss, sg = _scale_strides(scalings, num_slots, groups.groups)
    if rows == 0 or rank == 0:
        return out
    n = out.shape[1]
    if per_row:
        block_r = _pow2(rank, 2)
        block_n = _row_block_n(n, block_r)
        _row_down_kernel[(rows, triton.cdiv(n, block_n))](
            x,
            lora_a,
            lora_b,
            out,
            slots,
            expert_ids,
            scalings,
            k,
            n,
            rank,
            groups.first,
            count,
            _local_split(groups),
            *x.stride(),
            *lora_a.stride(),
            *lora_b.stride(),
            *out.stride(),
            ss,
            sg,
            BLOCK_N=block_n,
            BLOCK_K=min(_pow2(k, 2), max(16, ROW_TILE_ELEMENTS // block_r)),
            BLOCK_R=block_r,
        )
        return out
    dot_fp32 = x.dtype == torch.float32 or x.dtype != lora_b.dtype
    block_n = 256
    _segment_down_kernel[(count, num_slots, triton.cdiv(n, block_n))](
        x,
        lora_a,
        lora_b,
        out,
        slots,
        expert_ends,
        scalings,
        k,
        n,
        rank,
        groups.first,
        _local_split(groups),
        *x.stride(),
        *lora_a.stride(),
        *lora_b.stride(),
        *out.stride(),
        ss,
        sg,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_T=16,
        BLOCK_N=block_n,
        BLOCK_K=_pow2(k, 16, 256 if x.element_size() <= 2 else 64),
        BLOCK_R=_pow2(rank, 16, 64),
    )
    return out
