"""A forward's first op as one Triton kernel: each token's embedding row, transformers' embedding RMSNorm (the
residual stream h), then the first layer's input RMSNorm (x, the first block's input).

In torch that is a gather and two norms, three launches: a decode step's first three kernels, ~11 µs of a batch-8
step on an H100 (the gather alone 8) for eight 4 KB rows. Here a program gathers a block of rows once and writes h
and x. Both norms are `rms_norm_rows` at `triton_rms_norm`'s block shapes and warps, so h and x are bitwise what
that kernel gives run twice on the gathered rows. Ids outside the table give zero rows (h = x = 0), where a gather
would read past it.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_rms_norm import norm_launch
from inkwell.kernels.triton_short_conv import rms_norm_rows


@triton.jit
def _embed_norms_kernel(
    ids_ptr, table_ptr, embed_norm_ptr, input_norm_ptr, h_ptr, x_ptr, tokens, vocab, dim, eps, stride_table,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows r of h and x [tokens, dim] (BLOCK_R a program) from table [vocab, dim] rows ids[r]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    in_d = d < dim
    in_r = r < tokens
    ids = tl.load(ids_ptr + r, mask=in_r, other=-1)
    known = in_r & (ids >= 0) & (ids < vocab)
    rows = tl.load(
        table_ptr + ids.to(tl.int64)[:, None] * stride_table + d[None, :], mask=known[:, None] & in_d[None, :], other=0
    )
    dtype = h_ptr.dtype.element_ty
    embed_norm = tl.load(embed_norm_ptr + d, mask=in_d, other=0.0).to(tl.float32)
    h = rms_norm_rows(rows.to(tl.float32), embed_norm, dim, eps, dtype)
    out = r.to(tl.int64)[:, None] * dim + d[None, :]
    in_tile = in_r[:, None] & in_d[None, :]
    tl.store(h_ptr + out, h, mask=in_tile)
    input_norm = tl.load(input_norm_ptr + d, mask=in_d, other=0.0).to(tl.float32)
    tl.store(x_ptr + out, rms_norm_rows(h.to(tl.float32), input_norm, dim, eps, dtype), mask=in_tile)


def embed_norms(
    ids: torch.Tensor, table: torch.Tensor, embed_norm: torch.Tensor, input_norm: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = RMSNorm(table[ids]) by `embed_norm` and x = RMSNorm(h) by `input_norm` [T, D], in the table's dtype, for
    token ids [T] (long) of a contiguous-row table [V, D]."""
    if ids.dim() != 1 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(
            f"embed_norms needs ids [T] and a table [V, D] with unit last stride; got ids {list(ids.shape)}, "
            f"table {list(table.shape)} (strides {table.stride()})"
        )
    dim = table.shape[1]
    if embed_norm.shape != (dim,) or input_norm.shape != (dim,):
        raise ValueError(f"the norms' weights must be [{dim}]; got {list(embed_norm.shape)}, {list(input_norm.shape)}")
    h = torch.empty((ids.shape[0], dim), dtype=table.dtype, device=table.device)
    x = torch.empty_like(h)
    if ids.shape[0] == 0:
        return h, x
    block_r, block_d, warps = norm_launch(dim)
    _embed_norms_kernel[(triton.cdiv(ids.shape[0], block_r),)](
        ids, table, embed_norm, input_norm, h, x, ids.shape[0], table.shape[0], dim, eps, table.stride(0),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return h, x
