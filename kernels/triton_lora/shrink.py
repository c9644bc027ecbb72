"""The shrink y = x @ A[slot, expert]^T over token tiles, for the dense projections and the experts' rows alike.

Its launcher can put it in the decode step's chain (`triton_pdl`) ahead of the GEMM that reads y: `lora_linear`'s
base GEMM, and the experts' gate/up GEMM after a `TokenShrink`, run their K loops beside the shrink and wait for y
only in their epilogues. Where each slot has its own programs (decode, and steps up to SLOT_LOOP_MIN_TOKENS tokens)
the shrink splits its K loop over several programs (`split_k`): one program streaming a slot's whole A is latency, not
bandwidth, and the GEMM beside it waits for all of it.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.split_counts import SPLIT_COUNTS, split_counts
from inkwell.kernels.triton_lora.common import (
    SENTINEL,
    SLOT_LOOP_MIN_TOKENS,
    dot_precision,
    pow2,
    require,
    row_keys,
    row_slots,
)
from inkwell.kernels.triton_pdl import chain_launch, wait_then_trigger


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
    CHAINED: tl.constexpr = False,
):
    """y[t, r-block] = x[t] @ A[slot, expert - first]^T; slot -1 rows (and uncovered experts') get zeros.

    SLOT_LOOP: one program per token tile walks the tile's (slot, expert) groups (long segments);
    otherwise program_id(1) - 1 picks the slot (-1: the zeros), so slots run in parallel (decode).
    CHAINED: launched early (`triton_pdl`), the program waits for the kernel before it, then lets the next kernel,
    the GEMM that reads y, launch: that GEMM may read what this shrink reads (every kernel before it has finished),
    and waits for y in its epilogue.
    """
    if CHAINED:
        wait_then_trigger()
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_t = rt < T
    slots, local = row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS)
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
    keys = row_keys(rows, slots, local, E)
    key = tl.min(keys, 0)
    while key < SENTINEL:
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
        keys = tl.where(sel, SENTINEL, keys)
        key = tl.min(keys, 0)


@triton.jit
def _wait(WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()


@triton.jit
def split_shrink_program(
    tile,
    slot_program,
    r_split,
    slot_programs,
    r_splits,
    x_ptr,
    a_ptr,
    part_ptr,
    y_ptr,
    slot_ptr,
    count_ptr,
    T,
    K,
    R,
    K_PER_SPLIT,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WAIT: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
):
    """Program (tile, slot_program, r_split) of a split shrink's grid (token tiles, slot_programs = slots + 1,
    r_splits = rank blocks * SPLIT_K): y[t, r-block] = x[t] @ A[slot]^T, slot = slot_program - 1, its K loop split
    over SPLIT_K programs; slot -1 rows get zeros. WAIT (a chained caller that has not waited, `triton_pdl`): the
    program reads the tokens' slots and its first block of A, which no kernel of the step writes, then waits for
    the kernel before it, before it reads x or writes; TRIGGER: then lets the next kernel launch (a LoRA pair's
    GEMM, which reads x before its own wait).

    Each program adds its K range into an fp32 partial ([SPLIT_K, T, R]); the last of a group to finish (an
    atomic count, acquire-release) sums the partials in split order, writes y and resets the count, so the next
    launch and every CUDA graph replay find it zero. Programs of slots absent from their tile exit at once.
    """
    slot = slot_program - 1
    split = r_split % SPLIT_K
    rt = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    rr = (r_split // SPLIT_K) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_t = rt < T
    in_r = rr[None, :] < R
    slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
    y_ptrs = y_ptr + rt[:, None] * stride_yt + rr[None, :] * stride_yr
    if slot < 0:
        if split == 0:
            _wait(WAIT, TRIGGER)
            zeros = tl.zeros((BLOCK_T, BLOCK_R), dtype=y_ptr.dtype.element_ty)
            tl.store(y_ptrs, zeros, mask=(in_t & (slots < 0))[:, None] & in_r)
        return
    rows = in_t & (slots == slot)
    if tl.max(rows.to(tl.int32), 0) == 0:
        return
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + rr[None, :] * stride_ar
    x_ptrs = x_ptr + rt[:, None] * stride_xt
    k_first = split * K_PER_SPLIT
    k_end = tl.minimum(k_first + K_PER_SPLIT, K)
    rk = k_first + tl.arange(0, BLOCK_K)
    at = tl.load(a_ptrs + rk[:, None] * stride_ak, mask=(rk < k_end)[:, None] & in_r, other=0.0)
    _wait(WAIT, TRIGGER)
    xt = tl.load(x_ptrs + rk[None, :] * stride_xk, mask=rows[:, None] & (rk < K)[None, :], other=0.0)
    acc = tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
    for k0 in range(k_first + BLOCK_K, k_first + K_PER_SPLIT, BLOCK_K):  # the first block is above
        rk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptrs + rk[None, :] * stride_xk, mask=rows[:, None] & (rk < K)[None, :], other=0.0)
        at = tl.load(a_ptrs + rk[:, None] * stride_ak, mask=(rk < k_end)[:, None] & in_r, other=0.0)
        acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision=PRECISION)
    written = rows[:, None] & in_r
    part_rows = part_ptr + rt[:, None] * R + rr[None, :]
    tl.store(part_rows + split * T * R, acc, mask=written)
    group = (tile * slot_programs + slot_program) * (r_splits // SPLIT_K) + r_split // SPLIT_K
    if tl.atomic_add(count_ptr + group, 1) == SPLIT_K - 1:  # the other splits' partials are visible now
        total = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(part_rows + s * T * R, mask=written, other=0.0, cache_modifier=".cg")
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=written)
        tl.atomic_xchg(count_ptr + group, 0)


@triton.jit
def _split_shrink_kernel(
    x_ptr, a_ptr, part_ptr, y_ptr, slot_ptr, count_ptr, T, K, R, K_PER_SPLIT, stride_xt, stride_xk, stride_as,
    stride_ar, stride_ak, stride_yt, stride_yr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, CHAINED: tl.constexpr = False,
):  # fmt: skip
    """`split_shrink_program` over its grid (token tiles, slots + 1, rank blocks * SPLIT_K). CHAINED as in
    `_shrink_kernel` (a dependent's wait is for the whole grid, the programs that sum the partials included), but
    each program asks for its first block of A before it waits: the GEMM the shrink pairs with streams its weight
    once it launches, and A's reads then queue behind it."""
    split_shrink_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), tl.num_programs(2), x_ptr, a_ptr,
        part_ptr, y_ptr, slot_ptr, count_ptr, T, K, R, K_PER_SPLIT, stride_xt, stride_xk, stride_as, stride_ar,
        stride_ak, stride_yt, stride_yr, SPLIT_K, PRECISION, BLOCK_T, BLOCK_K, BLOCK_R, CHAINED, CHAINED,
    )  # fmt: skip


SHRINK_SPLIT_K = 8  # at most this many K ranges per slot for `lora_shrink` (2048 / 256 at bf16)
# The split shrink's counts (`split_counts`, one per (token tile, slot, rank block) of a launch) serve every launch:
# the engine never runs two split shrinks at once (on one stream launches run in turn: a chained shrink touches
# nothing before its wait, its GEMM, `lora_linear`'s or `expert_matmul`'s after a `TokenShrink`, waits for it before
# letting the next kernel launch; the experts' shrink on the LoRA side stream, past decode sizes, runs while the
# main stream routes and runs the experts' GEMMs, no shrink; a projection's shrink on the side stream runs beside
# its base GEMM alone); two streams running split shrinks at the same time would share the counts, and must not.


def launch_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor | None,
    first: int = 0,
    chained: bool = False,
    split_k: int = 1,
) -> torch.Tensor:
    """a is [S, E, R, K] (E=1 with expert stride 0 for the linear case); rows read A[slot, expert - first].

    `chained` launches it early in the step's chain (`triton_pdl`), ahead of the GEMM that reads y. `split_k` > 1
    splits the K loop over up to that many programs (linear case, one program per slot)."""
    tokens, k = x.shape
    num_slots, num_experts, rank, _ = a.shape
    block_t, block_r, block_k = _shrink_blocks(x, rank)
    splits = min(split_k, triton.cdiv(k, block_k))
    if splits > 1 and experts is None and split_shrinkable(tokens, num_slots, rank):
        y, grid, args, consts = split_shrink_operands(x, a[:, 0], slots, splits, "lora_shrink")
        _split_shrink_kernel[grid](*args, **consts, **chain_launch(x, chained))
        return y
    y = torch.empty((tokens, rank), dtype=x.dtype, device=x.device)
    if tokens == 0 or rank == 0:
        return y
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
        PRECISION=dot_precision(x.dtype),
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        **chain_launch(x, chained),
    )
    return y


def _token_rank_blocks(tokens: int, rank: int) -> tuple[int, int]:
    """The shrinks' token and rank blocks."""
    return pow2(tokens, 16, 32), pow2(rank, 16, 64)


def _shrink_blocks(x: torch.Tensor, rank: int) -> tuple[int, int, int]:
    """The shrinks' token, rank and K blocks for x [T, K]."""
    tokens, k = x.shape
    return *_token_rank_blocks(tokens, rank), pow2(k, 16, 256 if x.element_size() <= 2 else 128)


def split_shrinkable(tokens: int, num_slots: int, rank: int) -> bool:
    """Whether a shrink of `tokens` over `num_slots` slots of `rank` may split its K loop: each slot has its own
    programs (up to SLOT_LOOP_MIN_TOKENS tokens) and the counts serve its groups."""
    block_t, block_r = _token_rank_blocks(tokens, rank)
    groups = triton.cdiv(tokens, block_t) * (num_slots + 1) * triton.cdiv(rank, block_r)
    return 0 < tokens <= SLOT_LOOP_MIN_TOKENS and rank > 0 and groups <= SPLIT_COUNTS


def split_shrink_operands(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, split_k: int, counts: str
) -> tuple[torch.Tensor, tuple[int, int, int], list, dict]:
    """The split shrink of x [T, K] over A [S, R, K] (`split_shrinkable`) in up to `split_k` K ranges, its counts
    `split_counts(counts)`: y [T, R] (written by the launch), the grid (token tiles, slots + 1, rank blocks *
    splits), and `split_shrink_program`'s arguments after the program ids and constexprs, for `_split_shrink_kernel`
    and a kernel that runs the shrink in programs of its own (the MoE layer's head, `triton_route_dispatch`);
    `split_k` at most K / the K block."""
    (tokens, k), (num_slots, rank, _) = x.shape, a.shape
    require(
        split_shrinkable(tokens, num_slots, rank),
        f"a split shrink takes up to {SLOT_LOOP_MIN_TOKENS} tokens and groups that the split counts serve "
        f"(`split_shrinkable`); {tokens} tokens over {num_slots} slots of rank {rank} need the unsplit shrink",
    )
    block_t, block_r, block_k = _shrink_blocks(x, rank)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no split left without a K range
    y = torch.empty((tokens, rank), dtype=x.dtype, device=x.device)
    partials = torch.empty((split_k, tokens, rank), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(tokens, block_t), num_slots + 1, triton.cdiv(rank, block_r) * split_k)
    args = [
        x, a, partials, y, slots, split_counts(counts, x.device), tokens, k, rank, k_per_split, *x.stride(),
        *a.stride(), *y.stride(),
    ]  # fmt: skip
    consts = dict(SPLIT_K=split_k, PRECISION=dot_precision(x.dtype), BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_R=block_r)
    return y, grid, args, consts
