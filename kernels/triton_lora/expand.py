"""The expand kernel, out += scaling * y @ B^T in place over token tiles, and `launch_expand`, its launcher.

It serves the dense projections (sliced or not) and the experts' down projection, whose rows each read their expert
group's B.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inkwell.kernels.torch_ops import ExpertGroups
from inkwell.kernels.triton_lora.common import (
    SENTINEL,
    SLOT_LOOP_MIN_TOKENS,
    add_delta,
    dot_operands,
    expand_acc,
    local_split,
    parse_slices,
    pow2,
    require,
    row_keys,
    row_slots,
    scale_strides,
    slice_of,
    token_block,
)
from inkwell.kernels.triton_pdl import chain_launch, chain_start


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    slot_ptr,
    expert_ptr,
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
    stride_bg,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ss,
    stride_sp,
    HAS_EXPERTS: tl.constexpr,
    SLOT_LOOP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHAINED: tl.constexpr = False,
):
    """out[t, n] += scale[slot, p*G + g] * y[t, rank block p] @ B[slot, g, n]^T; slot -1 rows untouched.

    Column n belongs to slice p = p(n) of B stacked along N; a row's expert, as e = expert - first, is in group
    g = (e >= split) of G, each with its own B (linears: g = 0, G = 1). SLOT_LOOP as in _shrink_kernel; otherwise
    program_id(1) is the slot. CHAINED (`triton_pdl`): launched while the chained shrink that writes y runs, the
    program waits for it before its first read.
    """
    chain_start(CHAINED)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    slots, local_e = row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
    rows = in_t & (slots >= 0) if SLOT_LOOP else in_t & (slots == tl.program_id(1))
    if tl.max(rows.to(tl.int32), 0) == 0:
        return
    keys = row_keys(rows, slots, local_e, E)
    n0 = tl.program_id(2) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    part = slice_of(rn, o1, o2, o3)
    r_lo = slice_of(n0, o1, o2, o3) * R  # rank blocks this column tile reads
    r_hi = (slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
    b_cols = rn * stride_bn
    key = tl.min(keys, 0)
    while key < SENTINEL:
        sel = keys == key
        slot = key // E
        group = (key % E >= split).to(tl.int32)
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + group.to(tl.int64) * stride_bg
        acc = expand_acc(
            y_ptr, rt, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, in_n, DOT_FP32,
            PRECISION, BLOCK_T, BLOCK_N, BLOCK_R,
        )  # fmt: skip
        scale = tl.load(scale_ptr + slot * stride_ss + (part * G + group) * stride_sp, mask=in_n, other=0.0)
        add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale.to(tl.float32)[None, :])
        keys = tl.where(sel, SENTINEL, keys)
        key = tl.min(keys, 0)


@dataclass(frozen=True)
class ExpertRows:
    """Dispatched rows for the expand kernel: each row's expert, and the LoRA's groups, whose B a row reads."""

    experts: torch.Tensor
    groups: ExpertGroups


def launch_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
    rows: ExpertRows | None = None,
    chained: bool = False,
) -> torch.Tensor:
    """out [M, N] += the expand of y's rank blocks over P slices of out's columns; b is [S, G, N, R] as
    `_expand_kernel` reads it (linears [S, 1, N, R]). `chained`: y comes from a chained shrink launched just before
    (`launch_shrink`), and the expand launches while it runs, its own launch hidden behind the shrink's work."""
    num_slots, _, _, rank = b.shape
    tokens, n = out.shape
    parts, o1, o2, o3 = parse_slices(slice_offsets, n)
    groups = ExpertGroups(0, 1) if rows is None else rows.groups
    require(
        y.shape[1] == parts * rank,
        f"y has {y.shape[1]} columns; {parts} block(s) of B's rank {rank} need {parts * rank}",
    )
    require(y.shape[0] == tokens, f"out must be [T={y.shape[0]}, N], got {tuple(out.shape)}")
    ss, sp = scale_strides(scalings, num_slots, parts * groups.groups)
    if tokens == 0 or rank == 0 or n == 0:
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
        scalings,
        tokens,
        n,
        rank,
        groups.first,
        groups.count,
        local_split(groups),
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
        SLOT_LOOP=slot_loop,
        **dot_operands(y.dtype, b.dtype),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=pow2(rank, 16, 64) if slot_loop else pow2(rank * parts, 16, 64),
        **chain_launch(out, chained),
    )
    return out
