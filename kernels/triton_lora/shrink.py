"""The shrink y = x @ A[slot, expert]^T over token tiles, for the dense projections and the experts' rows alike.

Its launcher can let the next kernel start early (programmatic dependent launch), which `lora_linear` uses to
run its base GEMM beside the shrink.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from inkwell.kernels.triton_lora.common import _NONE, SLOT_LOOP_MIN_TOKENS, _pow2, _precision, _row_keys, _row_slots


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
