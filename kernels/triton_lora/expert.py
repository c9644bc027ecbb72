"""The routed experts' ops on dispatched rows: shrink, gate/up and down expands, and the down LoRA in one launch.

The fused down has the gate/up expand's program shapes (see `expand`): one program per dispatched row at decode,
one per (expert, slot) over rows sorted by expert up to SEGMENT_MAX_ROWS; past them, the shrink then the expand.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.torch_ops import ExpertGroups
from inkwell.kernels.triton_lora.common import (
    ROW_TILE_ELEMENTS,
    SEGMENT_MAX_ROWS,
    add_delta,
    dot_operands,
    expert_segment,
    local_split,
    lora_dot,
    plus_delta,
    pow2,
    require,
    row_block_n,
    row_expert,
    runs_per_row,
    scale_strides,
)
from inkwell.kernels.triton_lora.expand import ExpertRows, launch_expand
from inkwell.kernels.triton_lora.shrink import launch_shrink


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
    start, end = expert_segment(ends_ptr, first + e)
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
            acc = lora_dot(yt, bt, None, DOT_FP32, PRECISION)
            add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale)


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
    row, slot, local, group, covered = row_expert(slot_ptr, expert_ptr, first, count, split)
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
        tl.store(out_ptrs, plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=in_n)


def _check_rows(rows: int, slots: torch.Tensor, expert_ids: torch.Tensor) -> None:
    """A slot and an expert id for each of the M dispatched rows."""
    require(slots.shape == expert_ids.shape == (rows,), f"slots and expert_ids must be [M={rows}]")


def _check_expert_a(x: torch.Tensor, lora_a: torch.Tensor, groups: ExpertGroups) -> None:
    """Per-expert A [S, E, R, K] for dispatched rows x [M, K], E the experts `groups` cover."""
    require(lora_a.shape[3] == x.shape[1], f"lora_a's K={lora_a.shape[3]} differs from x's K={x.shape[1]}")
    require(groups.count == lora_a.shape[1], f"groups cover {groups.count} experts, lora_a has {lora_a.shape[1]}")


def _check_down_b(rows: int, lora_b: torch.Tensor, out: torch.Tensor, groups: ExpertGroups) -> None:
    """One B per group [S, G, N, R] adding into out [M, N]."""
    require(lora_b.shape[1] == groups.groups, f"lora_b has {lora_b.shape[1]} groups, the groups say {groups.groups}")
    require(tuple(out.shape) == (rows, lora_b.shape[2]), f"out must be [M={rows}, N={lora_b.shape[2]}]")


# ---- public ops: the torch twins' signatures --------------------------------------------------------


def expert_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert - first]^T -> [M,R] (A: [S,E,R,K]); uncovered rows are zero."""
    require(x.dim() == 2 and lora_a.dim() == 4, "expert_lora_shrink needs x [M,K] and lora_a [S,E,R,K]")
    _check_rows(x.shape[0], slots, expert_ids)
    groups = groups or ExpertGroups(0, lora_a.shape[1])
    _check_expert_a(x, lora_a, groups)
    return launch_shrink(x, lora_a, slots, expert_ids, groups.first)


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
    require(y.dim() == 2 and lora_b.dim() == 5, "expert_in_lora_expand needs y [T, P*G*R] and lora_b [S,P,E,N,R]")
    rows = out.shape[0]
    require(
        slots.shape == expert_ids.shape == token_of_row.shape == (rows,),
        f"slots, expert_ids and token_of_row must be [M={rows}]",
    )
    _, parts, count, n, _ = lora_b.shape
    require(groups.count == count, f"groups cover {groups.count} experts, lora_b has {count}")
    require(out.shape[1] == parts * n, f"out must be [M, P*N={parts * n}], got {tuple(out.shape)}")
    offsets = tuple(range(0, parts * n + 1, n))
    rows_of = ExpertRows(expert_ids, groups, token_of_row, expert_ends)
    return launch_expand(y, lora_b, slots, scalings, out, offsets, rows_of)


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
    require(y.dim() == 2 and lora_b.dim() == 4, "expert_out_lora_expand needs y [M,R] and lora_b [S,G,N,R]")
    _check_rows(y.shape[0], slots, expert_ids)
    _check_down_b(y.shape[0], lora_b, out, groups)
    return launch_expand(y, lora_b[:, None], slots, scalings, out, None, ExpertRows(expert_ids, groups))


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
    require(lora_a.dim() == 4 and lora_b.dim() == 4, "expert_down_lora needs lora_a [S,E,R,K] and lora_b [S,G,N,R]")
    per_row = runs_per_row(x.shape[0])
    if not per_row and (expert_ends is None or x.shape[0] > SEGMENT_MAX_ROWS):
        y = expert_lora_shrink(x, lora_a, slots, expert_ids, groups)
        return expert_out_lora_expand(y, lora_b, slots, expert_ids, scalings, out, groups)
    rows, k = x.shape
    num_slots, count, rank, _ = lora_a.shape
    _check_rows(rows, slots, expert_ids)
    _check_expert_a(x, lora_a, groups)
    _check_down_b(rows, lora_b, out, groups)
    ss, sg = scale_strides(scalings, num_slots, groups.groups)
    if rows == 0 or rank == 0:
        return out
    n = out.shape[1]
    if per_row:
        block_r = pow2(rank, 2)
        block_n = row_block_n(n, block_r)
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
            local_split(groups),
            *x.stride(),
            *lora_a.stride(),
            *lora_b.stride(),
            *out.stride(),
            ss,
            sg,
            BLOCK_N=block_n,
            BLOCK_K=min(pow2(k, 2), max(16, ROW_TILE_ELEMENTS // block_r)),
            BLOCK_R=block_r,
        )
        return out
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
        local_split(groups),
        *x.stride(),
        *lora_a.stride(),
        *lora_b.stride(),
        *out.stride(),
        ss,
        sg,
        **dot_operands(x.dtype, lora_b.dtype),
        BLOCK_T=16,
        BLOCK_N=block_n,
        BLOCK_K=pow2(k, 16, 256 if x.element_size() <= 2 else 64),
        BLOCK_R=pow2(rank, 16, 64),
    )
    return out
