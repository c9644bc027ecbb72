"""transformers' Inkling RMSNorm as one Triton kernel: each row normalized in fp32, rounded to its dtype, times the
weight, rounded.

In torch that is four launches and four passes over the tensor, two of them in fp32 (the cast up, the norm, the
cast down, the weight): a prefill step of 8 x 1,024 tokens normalizes every layer's queries and keys, 40 MB a layer
in bf16, so the torch ops move ~5x the bytes the norm needs. Here one program reads a block of rows once and writes
them once. The rows may be strided heads of a wider projection output ([T, H, D] with a row and a head stride), as
the attention's q and k are; the output is contiguous. Sums run in another order than torch's, so results agree to
fp32 rounding before the cast, not bitwise.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_short_conv import rms_norm_rows


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, rows, heads, dim, eps, stride_xt, stride_xh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows r = t * heads + h of x [T, heads, dim] (BLOCK_R of them a program) -> out [rows, dim] contiguous."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    in_tile = (r < rows)[:, None] & (d < dim)[None, :]
    t, h = (r // heads).to(tl.int64), r % heads
    x = tl.load(x_ptr + t[:, None] * stride_xt + h[:, None] * stride_xh + d[None, :], mask=in_tile, other=0.0)
    weight = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
    y = rms_norm_rows(x.to(tl.float32), weight, dim, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * dim + d[None, :], y, mask=in_tile)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (2 or 3 dims, unit last stride; other strides free) by `weight` [D]
    in x's dtype: a contiguous tensor of x's shape."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm needs x [T, D] or [T, H, D] with unit last stride and weight [D]; got x {list(x.shape)} "
            f"(strides {x.stride()}), weight {list(weight.shape)}"
        )
    x3 = x if x.dim() == 3 else x[:, None]
    tokens, heads, dim = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    if rows == 0:
        return out
    block_r, block_d, warps = norm_launch(dim)
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x3, weight, out, rows, heads, dim, eps, x3.stride(0), x3.stride(1),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return out


def norm_launch(dim: int) -> tuple[int, int, int]:
    """(rows a program, its block of columns, warps) for rows of `dim`: the layout fixes a row's sum order, so every
    kernel norming with it rounds as this one does (`triton_embed`)."""
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(64, 4096 // block_d))
    return block_r, block_d, 4 if block_r * block_d <= 2048 else 8
