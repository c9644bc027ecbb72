"""The MoE layer's row bookkeeping as Triton kernels: the dispatch (each token's (token, expert) rows sorted by
expert) and the combine (each token's rows weighted and summed back into one).

In torch (`torch_ops.moe_dispatch`, `moe_combine`) the dispatch is a stable argsort (a radix sort of several
launches), a division, searchsorted and four gathers, and the combine a cast, a product, a scatter, a sum and a cast:
about fifteen launches per MoE layer for a few KB at decode. Here the dispatch is one program, a stable counting
sort: it counts each expert's rows, then gives each row its place (its expert's first place, plus the rows of that
expert before it) and writes every output there. The combine is one program per (token, column block), summing
the token's rows in its own order, so the result does not depend on the sort.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _keys(index_ptr, i, M, E):
    """Rows i's sort keys: the expert id, ids past the last expert all as E; -1 past the last row."""
    return tl.where(i < M, tl.minimum(tl.load(index_ptr + i, mask=i < M, other=0), E), -1)


@triton.jit
def _dispatch_kernel(
    index_ptr, weight_ptr, slot_ptr, order_ptr, tokens_ptr, experts_ptr, w_out_ptr, slots_out_ptr, places_ptr,
    ends_ptr, M, E, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for m0 in range(0, M, BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        counts += tl.sum((_keys(index_ptr, i, M, E)[:, None] == e[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(ends_ptr + e, ends, mask=e < E)
    first = ends - counts  # each key's next free place
    for m0 in range(0, M, BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        valid = i < M
        hit = (_keys(index_ptr, i, M, E)[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_M, BLOCK_E]
        earlier = tl.cumsum(hit, axis=0) - hit  # rows of the same key before row i in this block
        place = tl.sum(hit * (first[None, :] + earlier), axis=1).to(tl.int64)
        first += tl.sum(hit, axis=0)
        token = i // K
        tl.store(places_ptr + i, place, mask=valid)
        tl.store(order_ptr + place, i.to(tl.int64), mask=valid)
        tl.store(tokens_ptr + place, token.to(tl.int64), mask=valid)
        tl.store(experts_ptr + place, tl.load(index_ptr + i, mask=valid), mask=valid)
        tl.store(w_out_ptr + place, tl.load(weight_ptr + i, mask=valid), mask=valid)
        tl.store(slots_out_ptr + place, tl.load(slot_ptr + token, mask=valid), mask=valid)


def moe_dispatch(
    index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, ...]:
    """`torch_ops.moe_dispatch` as one Triton program (a stable counting sort over the experts)."""
    tokens, k = index.shape
    rows = tokens * k
    index, weights = index.contiguous(), weights.contiguous()
    device = index.device
    order, row_tokens, experts, places = (torch.empty(rows, dtype=torch.long, device=device) for _ in range(4))
    row_weights = torch.empty(rows, dtype=weights.dtype, device=device)
    row_slots = torch.empty(rows, dtype=slots.dtype, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    if rows:
        _dispatch_kernel[(1,)](
            index, weights, slots, order, row_tokens, experts, row_weights, row_slots, places, ends, rows,
            num_experts, K=k, BLOCK_M=min(triton.next_power_of_2(rows), 256),
            BLOCK_E=triton.next_power_of_2(num_experts + 1), num_warps=4,
        )  # fmt: skip
    else:
        ends.zero_()
    return order, row_tokens, experts, row_weights, row_slots, ends, places


@triton.jit
def _combine_kernel(
    out_ptr, w_ptr, places_ptr, result_ptr, H, stride_om, stride_rt, K: tl.constexpr, BLOCK_H: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_c = c < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(K):
        place = tl.load(places_ptr + t * K + j)
        weight = tl.load(w_ptr + place).to(tl.float32)
        acc += tl.load(out_ptr + place * stride_om + c, mask=in_c, other=0.0).to(tl.float32) * weight
    tl.store(result_ptr + t * stride_rt + c, acc.to(result_ptr.dtype.element_ty), mask=in_c)


def moe_combine(
    out: torch.Tensor, weights: torch.Tensor, places: torch.Tensor, tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """`torch_ops.moe_combine` as one Triton kernel, a program per (token, 1,024 columns)."""
    rows, width = out.shape
    if out.stride(1) != 1 or rows % max(tokens, 1) or places.shape != (rows,) or weights.shape != (rows,):
        raise ValueError(
            f"moe_combine needs rows out [T*k, H] with unit column stride, weights and places [T*k]; got out "
            f"{list(out.shape)} (strides {out.stride()}), weights {list(weights.shape)}, places "
            f"{list(places.shape)}, T {tokens}"
        )
    result = torch.empty(tokens, width, dtype=dtype, device=out.device)
    if result.numel():
        block = min(triton.next_power_of_2(width), 1024)
        grid = (tokens, triton.cdiv(width, block))
        _combine_kernel[grid](
            out, weights, places, result, width, out.stride(0), result.stride(0), K=rows // tokens, BLOCK_H=block
        )
    return result


@triton.jit
def _expert_matmul_kernel(
    x_ptr, w_ptr, ends_ptr, tokens_ptr, out_ptr, N, K, stride_xm, stride_we, stride_wn, stride_om,
    GATHER: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Expert e's rows m_block*BLOCK_M .. (of its own) times its weight's columns n_block*BLOCK_N ..: programs past
    the expert's rows return at once."""
    n_block = tl.program_id(0)
    m_block = tl.program_id(1)
    e = tl.program_id(2)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    first = start + m_block * BLOCK_M
    if first >= end:
        return
    r = first + tl.arange(0, BLOCK_M)
    in_r = r < end
    src = tl.load(tokens_ptr + r, mask=in_r, other=0).to(tl.int64) if GATHER else r
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src[:, None] * stride_xm + k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = (k0 + k) < K
        a = tl.load(a_ptrs + k0, mask=in_r[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=in_n[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee" if IEEE else None)
    tl.store(out_ptr + r[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=in_r[:, None] & in_n)


def expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, tokens: torch.Tensor | None, max_rows: int
) -> torch.Tensor:
    """`torch_ops.expert_matmul` as one Triton kernel, a program per (column block, block of an expert's rows,
    expert), each streaming its expert's weight block once for up to 64 rows: at decode sizes (a few rows per
    expert) it reads the weights near the memory's speed, where a grouped GEMM's 128-row tiles do not."""
    experts, width, depth = weight.shape
    rows = tokens.shape[0] if tokens is not None else x.shape[0]
    if x.shape[-1] != depth or x.stride(-1) != 1 or weight.stride(-1) != 1 or ends.shape != (experts,):
        raise ValueError(
            f"expert_matmul needs x [., K] and weight [E, N, K] with unit stride along K, ends [E]; got x "
            f"{list(x.shape)} (strides {x.stride()}), weight {list(weight.shape)}, ends {list(ends.shape)}"
        )
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(max_rows)))
    block_n, block_k = 64, 128
    grid = (triton.cdiv(width, block_n), triton.cdiv(max_rows, block_m), experts)
    _expert_matmul_kernel[grid](
        x, weight, ends, tokens if tokens is not None else ends, out, width, depth, x.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), GATHER=tokens is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F, stride_xm, stride_om, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_c = c < F
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + m * stride_xm + c, mask=in_c, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + m * stride_xm + F + c, mask=in_c, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + (libdevice.exp(-gate) if PRECISE else tl.exp(-gate)))).to(dtype)
    tl.store(out_ptr + m * stride_om + c, (silu.to(tl.float32) * up).to(dtype), mask=in_c)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`torch_ops.silu_mul` as one Triton kernel, torch's formula x / (1 + exp(-x)) with CUDA's exp (libdevice)."""
    rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul needs rows [M, 2F] with unit column stride, got {list(gate_up.shape)}")
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(triton.next_power_of_2(width // 2), 1024)
        grid = (rows, triton.cdiv(width // 2, block))
        _silu_mul_kernel[grid](
            gate_up, out, width // 2, gate_up.stride(0), out.stride(0), PRECISE=gate_up.is_cuda, BLOCK=block
        )
    return out
