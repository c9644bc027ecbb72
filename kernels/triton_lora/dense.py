"""The dense projections' ops: shrink, (sliced) expand, the fused shrink+expand, `lora_linear` and `linear`.

Beyond the shrink and expand launchers they have two kernels of their own for decode: the fused shrink+expand,
whose shrink result never leaves registers, and the base GEMM, with the LoRA expand as its tiles' epilogue
(`lora_linear`) or alone and chained into the decode step (`linear`, `triton_pdl`).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.dispatch import FUSED_MAX_N, FUSED_MAX_TOKENS, fused_linear
from inkwell.kernels.torch_ops import check_token_slots
from inkwell.kernels.triton_lora.common import (
    add_delta,
    dot_operands,
    dot_precision,
    lora_dot,
    parse_slices,
    pow2,
    processors,
    require,
    scale_strides,
    slice_of,
    token_block,
)
from inkwell.kernels.triton_lora.expand import launch_expand
from inkwell.kernels.triton_lora.shrink import SHRINK_SPLIT_K, launch_shrink
from inkwell.kernels.triton_pdl import chain_launch, pair_launch, prefetch_rows_l2, rows_prefetchable, wait_then_trigger


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
    part = slice_of(rn, o1, o2, o3)
    r_lo = slice_of(n0, o1, o2, o3) * R
    r_hi = (slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, o1, o2, o3) + 1) * R
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
        acc = lora_dot(yt, bt, acc, DOT_FP32, PRECISION)
    add_delta(out_ptr, rt, rn, stride_ot, stride_on, rows, in_n, acc, scale[None, :])


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
    HAS_LORA: tl.constexpr,
    CHAINED: tl.constexpr,
    PREFETCH_W: tl.constexpr,
    WAIT_FOR_SHRINK: tl.constexpr,
    ONE_SLICE_PER_TILE: tl.constexpr,
    PREFETCH_B: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[rows, cols] = x[rows] @ W[cols]^T for a tile of BLOCK_T tokens (program_id(1)) and BLOCK_N columns
    (program_id(0)), with HAS_LORA plus each token's (sliced) LoRA expand of y as the tile's epilogue.

    CHAINED (`triton_pdl`): the program lets the next kernel launch, asks L2 for its rows of W (PREFETCH_W: W's rows
    contiguous) while the kernel before it still runs, then waits for that kernel before reading x. The LoRA pair
    instead launches once the chained shrink that writes y has waited (WAIT_FOR_SHRINK): x is written by then, the K
    loop runs while the shrink does, and the epilogue waits for y, after which the next kernel may launch. Each
    token gathers its own slot's B, so one program serves every adapter in the batch. The slots and scalings, and up
    to rank BLOCK_R the tile's B rows too (PREFETCH_B), are loaded before the K loop, so their latency hides behind
    it. Where every slice starts on a tile boundary (ONE_SLICE_PER_TILE) the tile reads one rank block of y per
    token, not one per column.
    """
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rt < T
    n0 = tl.program_id(0) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    in_n = rn < N
    if CHAINED:
        gdc_launch_dependents()
        if PREFETCH_W:
            prefetch_rows_l2(w_ptr, n0, N, K, stride_wn, BLOCK_N)
        gdc_wait()
    if HAS_LORA:
        slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
        adapted = (slots >= 0)[:, None] & in_n[None, :]
        if ONE_SLICE_PER_TILE:
            part = slice_of(n0, o1, o2, o3)
            scale = tl.load(scale_ptr + slots * stride_ss + part * stride_sp, mask=slots >= 0, other=0.0)[:, None]
            y_rows = y_ptr + rt[:, None] * stride_yt + (part * R) * stride_yr  # [BLOCK_T, 1]
        else:
            part = slice_of(rn, o1, o2, o3)
            scale = tl.load(scale_ptr + slots[:, None] * stride_ss + part[None, :] * stride_sp, mask=adapted, other=0.0)
            y_rows = y_ptr + rt[:, None, None] * stride_yt + (part * R)[None, :, None] * stride_yr  # [T, N, 1]
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
    if HAS_LORA:
        if WAIT_FOR_SHRINK:
            wait_then_trigger()  # triggering before the K loop instead made the step slower
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


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> None:
    """A [S, R, K] reads x [T, K]'s K, and each of the T tokens has a slot."""
    require(lora_a.shape[2] == x.shape[1], f"lora_a's K={lora_a.shape[2]} differs from x's K={x.shape[1]}")
    check_token_slots(token_slots, x.shape[0])


def _check_sliced_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_offsets: tuple[int, ...] | None,
) -> None:
    """x [T,K], A stacked [S, P*R, K] and B stacked [S, N, R] of one sliced projection, and [T] slots."""
    require(x.dim() == 2 and lora_a.dim() == 3 and lora_b.dim() == 3, "need x [T,K], lora_a [S,P*R,K], lora_b [S,N,R]")
    _check_shrink(x, lora_a, token_slots)
    parts = parse_slices(slice_offsets, lora_b.shape[1])[0]
    require(
        lora_a.shape[0] == lora_b.shape[0] and lora_a.shape[1] == parts * lora_b.shape[2],
        f"lora_a {tuple(lora_a.shape)} must be [S, {parts}*R, K] for lora_b {tuple(lora_b.shape)}",
    )


def launch_fused(
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
    """The fused shrink+expand: one launch, one program per (token tile, slot, column tile); the bench sweeps
    the tile knobs."""
    tokens, k = x.shape
    num_slots, n, rank = b.shape
    parts, o1, o2, o3 = parse_slices(slice_offsets, n)
    ss, sp = scale_strides(scalings, num_slots, parts)
    if tokens == 0 or rank == 0 or n == 0:
        return out
    block_t = token_block(tokens)
    block_n = block_n or (128 if tokens > 16 and n <= 2048 else 256)
    block_k = block_k or pow2(k, 16, 256 if x.element_size() <= 2 else 64)
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
        **dot_operands(x.dtype, b.dtype),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=pow2(rank, 16, 64),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# ---- public ops: the torch twins' signatures --------------------------------------------------------


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, chained: bool = False
) -> torch.Tensor:
    """x[T,K] @ A[slot]^T -> [T,R]; rows of slot -1 are zero. A stacked [S, P*R, K] gives P rank blocks.

    Where each slot has its own programs (up to SLOT_LOOP_MIN_TOKENS tokens) their K loop is split over up to
    SHRINK_SPLIT_K programs. `chained` (`launch_shrink`): the kernel after it, launched with `launch_pdl`, starts
    once every kernel before the shrink has finished, and must wait for y."""
    require(x.dim() == 2 and lora_a.dim() == 3, "lora_shrink needs x [T,K] and lora_a [S,R,K]")
    _check_shrink(x, lora_a, token_slots)
    return launch_shrink(x, lora_a.unsqueeze(1), token_slots, None, chained=chained, split_k=SHRINK_SPLIT_K)


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
    chained: bool = False,
) -> torch.Tensor:
    """Expand of a fused projection: out[:, o_p:o_p+1] += scaling[slot, p] * y[:, pR:(p+1)R] @ B[slot, o_p:o_p+1]^T.

    y [T, P*R] is the shrink over A stacked [S, P*R, K]; lora_b [S, N, R] is B stacked along N;
    slice_offsets (0, o_1, ..., N) are the slices' output starts; scalings [S] or [S, P]. `chained`: y comes from
    `lora_shrink(..., chained=True)` launched just before, and the expand launches while it runs (`launch_expand`).
    """
    require(y.dim() == 2 and lora_b.dim() == 3, "lora_expand needs y [T,R] and lora_b [S,N,R]")
    check_token_slots(token_slots, y.shape[0])
    require(tuple(out.shape) == (y.shape[0], lora_b.shape[1]), f"out must be [T={y.shape[0]}, N={lora_b.shape[1]}]")
    return launch_expand(y, lora_b[:, None], token_slots, scalings, out, slice_offsets, chained=chained)


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
    result stays in registers. Otherwise the shrink and the expand are chained (`triton_pdl`): the expand launches
    while the shrink runs and waits for its y.
    """
    _check_sliced_lora(x, lora_a, lora_b, token_slots, slice_offsets)
    require(tuple(out.shape) == (x.shape[0], lora_b.shape[1]), f"out must be [T, N={lora_b.shape[1]}]")
    if x.shape[0] <= FUSED_MAX_TOKENS and lora_b.shape[1] <= FUSED_MAX_N:
        return launch_fused(x, lora_a, lora_b, token_slots, scalings, out, slice_offsets)
    y = lora_shrink(x, lora_a, token_slots, chained=True)
    return lora_expand_sliced(y, lora_b, token_slots, scalings, out, slice_offsets, chained=True)


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

    Where `fused_linear` holds (decode sizes) with one dtype throughout, the LoRA hides behind the base GEMM: the
    shrink, chained into the step (`triton_pdl`), waits for the kernel before it and lets the GEMM kernel start, the
    GEMM's K loop runs beside it, and the expand is the GEMM tiles' epilogue. Otherwise the base GEMM, then
    `lora_shrink_expand`.
    """
    require(x.dim() == 2 and weight.dim() == 2, "lora_linear needs x [T,K] and weight [N,K]")
    require(weight.shape[1] == x.shape[1], f"weight's K={weight.shape[1]} differs from x's K={x.shape[1]}")
    _check_sliced_lora(x, lora_a, lora_b, token_slots, slice_offsets)
    tokens, n = x.shape[0], weight.shape[0]
    require(lora_b.shape[1] == n, f"lora_b's N={lora_b.shape[1]} differs from weight's N={n}")
    rank = lora_b.shape[2]
    one_dtype = len({x.dtype, weight.dtype, lora_a.dtype, lora_b.dtype}) == 1
    # rank 0 too: with no shrink launched, the GEMM's programmatic launch would pair with an unrelated kernel
    if not fused_linear(tokens, n) or not one_dtype or rank == 0:
        out = torch.nn.functional.linear(x, weight)
        return lora_shrink_expand(x, lora_a, lora_b, token_slots, scalings, out, slice_offsets)
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0 or n == 0:
        return out
    # the shrink's K loop split over programs: one program streaming a slot's whole A outlasts the GEMM beside it
    y = launch_shrink(x, lora_a.unsqueeze(1), token_slots, None, chained=True, split_k=SHRINK_SPLIT_K)
    return _launch_linear(x, weight, out, (y, lora_b, token_slots, scalings, slice_offsets))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T as `F.linear`, one Triton GEMM for decode sizes (`fused_linear`), chained into the step on CUDA
    (`triton_pdl`): the tile's rows of W stream into L2 while the kernel before it still runs."""
    require(x.dim() == 2 and weight.dim() == 2, "linear needs x [T,K] and weight [N,K]")
    require(weight.shape[1] == x.shape[1], f"weight's K={weight.shape[1]} differs from x's K={x.shape[1]}")
    require(x.dtype == weight.dtype, f"linear needs x and weight of one dtype, got {x.dtype} and {weight.dtype}")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or weight.shape[0] == 0:
        return out
    return _launch_linear(x, weight, out, None)


def _launch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    lora: tuple | None,
) -> torch.Tensor:
    """`_linear_kernel` over token tiles of up to 64 (`token_block`) and 32- or 64-column tiles; `lora` = (y, B, slots,
    scalings, slice offsets) or None. On CUDA the GEMM alone is chained into the step; with the LoRA it launches
    beside the chained shrink that writes y."""
    (tokens, k), n = x.shape, weight.shape[0]
    pdl = x.is_cuda  # CPU tensors: Triton's interpreter (tests), which has no programmatic launch
    block_t = token_block(tokens)
    # Each program reads its token tile's rows of x whole from L2. Where 32-column tiles would take more than one wave
    # (several token tiles: q/k/v/r's 208 programs at 65-128 tokens), 64-column tiles halve those reads and the
    # programs, and the epilogue gathers B in rank blocks of 8 to keep its [T, N, R] block the same size; o's 128
    # programs fit one wave and keep 32 columns (H100, 128 tokens: 10.6 µs with 1 adapter against 11.5 at 64).
    token_tiles = triton.cdiv(tokens, block_t)
    wide = token_tiles > 1 and token_tiles * triton.cdiv(n, 32) > processors(x)
    block_n, block_r = (64, 8) if wide else (32, 16)
    if lora is None:  # the LoRA operands are compiled out (HAS_LORA): any tensors of the right rank stand in
        y, lora_b, token_slots, scalings = out, weight[:, :, None], out, out
        rank, (o1, o2, o3), (ss, sp) = 0, (n, n, n), (0, 0)
    else:
        y, lora_b, token_slots, scalings, slice_offsets = lora
        rank = lora_b.shape[2]
        parts, o1, o2, o3 = parse_slices(slice_offsets, n)
        ss, sp = scale_strides(scalings, lora_b.shape[0], parts)
    _linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(tokens, block_t))](
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
        HAS_LORA=lora is not None,
        PREFETCH_W=pdl and lora is None and rows_prefetchable(weight),
        WAIT_FOR_SHRINK=pdl and lora is not None,
        ONE_SLICE_PER_TILE=all(start % block_n == 0 for start in (o1, o2, o3) if start < n),
        PRECISION=dot_precision(x.dtype),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=pow2(k, 16, (128 if wide else 256) if x.element_size() <= 2 else 64),
        PREFETCH_B=0 < rank <= block_r,  # a larger block of B would not fit in registers beside the K loop
        BLOCK_R=block_r,
        num_stages=4 if x.element_size() <= 2 else 2,
        num_warps=8 if block_t > 32 else 4,  # ptxas, sm_90a, 64 tokens: 4 warps spill ~3.9 KB a thread, 8 warps 856 B
        **(chain_launch(x) if lora is None else pair_launch(x)),
    )
    return out
