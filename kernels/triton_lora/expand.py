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
    WALK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHAINED: tl.constexpr = False,
):
    """out[t, n] += scale[slot, p*G + g] * y[t, rank block p] @ B[slot, g, n]^T; slot -1 rows untouched.

    Column n belongs to slice p = p(n) of B stacked along N; a row's expert, as e = expert - first, is in group
    g = (e >= split) of G, each with its own B (linears: g = 0, G = 1). WALK: one program per (token tile, column
    tile) walks the tile's (slot, expert group) keys; otherwise program_id(1) picks the slot, so slots run in
    parallel. Either way the keys' products gather in one accumulator and the tile is read and written once.
    CHAINED (`triton_pdl`): launched while the chained shrink that writes y runs, the program waits for it before
    its first read.
    """
    chain_start(CHAINED)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    slots, local_e = row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
    rows = in_t & (slots >= 0) if WALK else in_t & (slots == tl.program_id(1))
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
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    key = tl.min(keys, 0)
    while key < SENTINEL:
        sel = keys == key
        group = (key % E >= split).to(tl.int32)
        b_base = b_ptr + (key // E).to(tl.int64) * stride_bs + group.to(tl.int64) * stride_bg
        acc = expand_acc(
            y_ptr, rt, sel, stride_yt, stride_yr, b_base, b_cols, stride_br, part, r_lo, r_hi, R, in_n, acc,
            DOT_FP32, PRECISION, BLOCK_R,
        )  # fmt: skip
        keys = tl.where(sel, SENTINEL, keys)
        key = tl.min(keys, 0)
    if WALK or HAS_EXPERTS:  # rows of several slots or expert groups: each row's own scalings
        groups = (local_e >= split).to(tl.int32)
        scale_at = scale_ptr + slots[:, None] * stride_ss + (part[None, :] * G + groups[:, None]) * stride_sp
        scale = tl.load(scale_at, mask=rows[:, None] & in_n[None, :], other=0.0)
    else:  # one slot: its columns' scalings
        scale = tl.load(scale_ptr + tl.program_id(1) * stride_ss + part * stride_sp, mask=in_n, other=0.0)[None, :]
    add_delta(out_ptr, rt, rn, stride_ot, stride_on, rows, in_n, acc, scale.to(tl.float32))


# Up to SLOT_LOOP_MIN_TOKENS tokens, an expand over one slice with fewer (token tile, column tile) programs than
# WALK_MIN_TILES gives each slot programs of its own, so that the slots of a decode batch run in parallel (o: 4.3
# against 7.2 µs walking, 8 adapters at 128 tokens); wider ones (the LM head's 32,000 columns: 250 tiles a token
# tile) and sliced ones (q/k/v/r, gate/up: a 64-column tile reads one slice's rank block a step) walk their tiles'
# slots, each tile read and written once (LM head 20.1 against 50.0 µs, q/k/v/r 6.4 against 10.4; H100,
# bench_lora_kernels.py, docs/benchmarks.md).
WALK_MIN_TILES = 128


def walks(tokens: int, tiles: int, parts: int) -> bool:
    """Whether the expand of `tokens` rows over `parts` slices and `tiles` (token tile, column tile) programs walks
    each tile's slots."""
    return tokens > SLOT_LOOP_MIN_TOKENS or parts > 1 or tiles >= WALK_MIN_TILES


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
    walk: bool | None = None,
) -> torch.Tensor:
    """out [M, N] += the expand of y's rank blocks over P slices of out's columns; b is [S, G, N, R] as
    `_expand_kernel` reads it (linears [S, 1, N, R]). `chained`: y comes from a chained shrink launched just before
    (`launch_shrink`), and the expand launches while it runs, its own launch hidden behind the shrink's work.
    `walk` (None: `walks`) picks the kernel's WALK; the kernel benchmark sets it to time both."""
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
    block_n = 256 if tokens <= 16 else 128
    walk = walks(tokens, triton.cdiv(tokens, block_t) * triton.cdiv(n, block_n), parts) if walk is None else walk
    # walking over slices: 64-column tiles reading one slice's rank block a step, 102 registers (ptxas, sm_90a)
    # where 128 columns reading every slice's ranks took 255 and spilled; q/k/v/r's LoRA at 4,096 tokens 39-42 ->
    # 34-36 µs (bench_lora_kernels, H200). One slice keeps its columns.
    block_n = 64 if walk and parts > 1 else block_n
    grid = (triton.cdiv(tokens, block_t), 1 if walk else num_slots, triton.cdiv(n, block_n))
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
        WALK=walk,
        **dot_operands(y.dtype, b.dtype),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=pow2(rank, 16, 64) if walk else pow2(rank * parts, 16, 64),
        **chain_launch(out, chained),
    )
    return out
