"""Inkling's prefill attention (a chunk of queries per sequence, continuing from the sequence's cached history) as
one Triton kernel, flash-attention style.

In torch a chunk's attention gathers the history's keys and values out of the cache and joins the chunk's own,
repeats them per query head, gathers the relative-position bias out of the [B, L, H, extent] projection of r,
masks it, scales, scores, masks and softmaxes a [B, H, L, history + L] table in fp32 and multiplies: a dozen
launches, most of them moving that table through memory. Here the projection of r stays one torch matmul (the
same GEMM as the composite, so the same rounding and the same [B, L, H, extent] buffer), and one program per
(chunk, head, block of queries) walks its kv head's keys a block at a time: the cached history in place (a full
layer's positions 0 .. start - 1, a sliding layer's ring), then the chunk's own keys up to the causal diagonal,
with an online softmax (running max and sum) so that no score leaves the chip. q.k and the weighted values are
tensor-core dots (fp32 accumulation); the bias is gathered by distance from the projection with one masked load
per block (distances differ per query and key), then multiplied by the identity (exact) to bring it into the
scores' register layout, which keeps the compiler from running the softmax twice.

Rounding follows the composite: q.k, its scaling and the biased scores are rounded to the model's dtype, as are
log scaling's q * tau and bias * tau. The probabilities are rounded before they weigh the values as the
composite's are, but unnormalised (exp of the score minus the running max; the sum is divided out at the end), so
results agree with the composite to a rounding of the probabilities, not bitwise.

Key blocks come in kinds, each a loop of its own so the common ones skip work: on full layers, blocks all of whose
distances are past the bias's extent load no bias; blocks below the diagonal need no mask; only the diagonal
blocks (and the history's last, partial one) are masked. Sliding layers mask every block by the window.
"""

import torch
import triton
import triton.language as tl

# a masked score (torch's composite fills finfo.min): exp() of it minus any real score is 0
_MASKED = tl.constexpr(-3.0e38)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc) in fp32; IEEE: fp32 inputs multiplied as fp32 (not tf32)."""
    out = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
    return out


@triton.jit
def _rows(base, offsets, keep, MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows base + offsets [BLOCK_N] of a key or value table, [BLOCK_N, BLOCK_D] (0 where not kept, or every row
    kept without MASK)."""
    d = tl.arange(0, BLOCK_D)
    pointers = base + offsets[:, None] + d[None, :]
    if BLOCK_D == HEAD_DIM:
        rows = tl.load(pointers, mask=keep[:, None], other=0.0) if MASK else tl.load(pointers)
    else:
        rows = tl.load(pointers, mask=keep[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    return rows


@triton.jit
def _step(
    acc, top, total, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, k_offsets, v_offsets, p, keep,
    scale, extent, window, MASK: tl.constexpr, BIAS: tl.constexpr, SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr,
    IEEE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One block of keys, at positions p [BLOCK_N] (`keep`: the real ones), into the running softmax (acc, top,
    total) of the queries at positions t [BLOCK_M]. MASK: mask keys not kept, ahead of the query or (sliding) out
    of its window (without it every key is real and seen by every query). BIAS: add the relative bias (without it
    every distance is past the extent)."""
    dtype = q.dtype
    keys = _rows(k_base, k_offsets, keep, MASK, HEAD_DIM, BLOCK_D)
    qk = _dot(q, tl.trans(keys), None, IEEE)
    scores = (qk.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    distance = t[:, None] - p[None, :]
    if BIAS:
        near = rows_ok[:, None] & keep[None, :] & (distance >= 0) & (distance < extent)
        bias = tl.load(rel_base + (rel_rows[:, None] + distance), mask=near, other=0.0)
        # times the identity (exact): added as loaded, the compiler runs the softmax a second time in the load's
        # layout (or converts the scores to it) every block; the dot's result is in the scores' own layout
        n = tl.arange(0, BLOCK_N)
        bias = _dot(bias, (n[:, None] == n[None, :]).to(dtype), None, IEEE)
        if LOG_SCALE:
            bias = (bias * tau[:, None]).to(dtype).to(tl.float32)
        scores = (scores + bias).to(dtype).to(tl.float32)
    if MASK:
        allowed = keep[None, :] & (distance >= 0)
        if SLIDING:
            allowed = allowed & (distance < window)
        scores = tl.where(allowed, scores, _MASKED)
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    rescale = tl.exp(top - new_top)
    weights = tl.exp(scores - new_top[:, None])  # unnormalised probabilities: rounded, they weigh the values
    total = total * rescale + tl.sum(weights, axis=1)
    values = _rows(v_base, v_offsets, keep, MASK, HEAD_DIM, BLOCK_D)
    acc = _dot(weights.to(dtype), values, acc * rescale[:, None], IEEE)
    return acc, new_top, total


@triton.jit
def _walk(
    acc, top, total, lo, hi, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, stride_k, stride_v, first,
    bound, scale, extent, window, RING: tl.constexpr, MASK: tl.constexpr, BIAS: tl.constexpr,
    SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr, IEEE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Key blocks x = lo .. hi of one table (the cache's history, x its positions; or the chunk's own keys, x
    their indices), at positions first + x and table rows x (RING: x % window); keys x >= bound are not real."""
    for x0 in range(lo, hi, BLOCK_N):
        x = x0 + tl.arange(0, BLOCK_N)
        rows = x % window if RING else x
        acc, top, total = _step(
            acc, top, total, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, rows * stride_k,
            rows * stride_v, first + x, x < bound, scale, extent, window, MASK, BIAS, SLIDING, LOG_SCALE, IEEE,
            HEAD_DIM, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    return acc, top, total


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, rel_ptr, seq_ptr, start_ptr, length_ptr, out_ptr,
    L, heads, extent, window, scale, log_floor, log_alpha,
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    stride_cks, stride_ckl, stride_ckh, stride_cvs, stride_cvl, stride_cvh,
    stride_rb, stride_rl, stride_rh, stride_ob, stride_ol, stride_oh,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # the longest (causal) query blocks start first
    b64 = b.to(tl.int64)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int32)
    length = tl.minimum(tl.load(length_ptr + b).to(tl.int32), L)
    active = m0 < length  # else every row is padding: no keys, zeros out
    i = m0 + tl.arange(0, BLOCK_M)
    rows_ok = i < length
    t = start + i  # the queries' positions
    d = tl.arange(0, BLOCK_D)
    in_q = rows_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b64 * stride_qb + h * stride_qh + i[:, None] * stride_ql + d[None, :], mask=in_q, other=0.0)
    tau = tl.full((BLOCK_M,), 1.0, tl.float32)
    if LOG_SCALE:  # full layers: q and the bias scaled by 1 + alpha * log(max((t + 1) / floor, 1))
        tau = 1.0 + log_alpha * tl.log(tl.maximum((t + 1).to(tl.float32) / log_floor, 1.0))
        q = (q.to(tl.float32) * tau[:, None]).to(q.dtype)
    rel_base = rel_ptr + b64 * stride_rb + h * stride_rh
    rel_rows = i * stride_rl  # each query's bias at distance 0, from rel_base
    kv_head = h // GROUPS
    ck_base = ck_ptr + seq * stride_cks + kv_head * stride_ckh
    cv_base = cv_ptr + seq * stride_cvs + kv_head * stride_cvh
    k_base = k_ptr + b64 * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b64 * stride_vb + kv_head * stride_vh
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    top = tl.full((BLOCK_M,), _MASKED, tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    history = tl.where(active, start, 0)  # cached positions 0 .. history - 1 (those the layer keeps)
    own_end = tl.where(active, tl.minimum(m0 + BLOCK_M, length), 0)  # the chunk's keys, to the diagonal
    if SLIDING:  # every block masked by the window; the block's queries see positions > start + m0 - window
        lo = tl.maximum(start + m0 - window + 1, 0)
        acc, top, total = _walk(
            acc, top, total, lo, history, q, t, rows_ok, tau, rel_base, rel_rows, ck_base, cv_base, stride_ckl,
            stride_cvl, 0, history, scale, extent, window, True, True, True, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, top, total = _walk(
            acc, top, total, lo, own_end, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, stride_kl,
            stride_vl, start, length, scale, extent, window, False, True, True, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
    else:  # the history's blocks whose distances are all past the extent (no bias), then the near ones
        far = tl.minimum(tl.maximum(start + m0 - extent + 1, 0), history) // BLOCK_N * BLOCK_N
        acc, top, total = _walk(
            acc, top, total, 0, far, q, t, rows_ok, tau, rel_base, rel_rows, ck_base, cv_base, stride_ckl,
            stride_cvl, 0, history, scale, extent, window, False, False, False, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
        acc, top, total = _walk(
            acc, top, total, far, history, q, t, rows_ok, tau, rel_base, rel_rows, ck_base, cv_base, stride_ckl,
            stride_cvl, 0, history, scale, extent, window, False, True, True, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
        # the chunk's own keys below the diagonal block (BLOCK_N divides BLOCK_M), far then near, then the diagonal
        below = tl.where(active, m0, 0)
        far = tl.minimum(tl.maximum(m0 - extent + 1, 0), below) // BLOCK_N * BLOCK_N
        acc, top, total = _walk(
            acc, top, total, 0, far, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, stride_kl, stride_vl,
            start, length, scale, extent, window, False, False, False, SLIDING, LOG_SCALE, IEEE, HEAD_DIM, BLOCK_N,
            BLOCK_D,
        )  # fmt: skip
        acc, top, total = _walk(
            acc, top, total, far, below, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, stride_kl,
            stride_vl, start, length, scale, extent, window, False, False, True, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
        acc, top, total = _walk(
            acc, top, total, m0, own_end, q, t, rows_ok, tau, rel_base, rel_rows, k_base, v_base, stride_kl,
            stride_vl, start, length, scale, extent, window, False, True, True, SLIDING, LOG_SCALE, IEEE, HEAD_DIM,
            BLOCK_N, BLOCK_D,
        )  # fmt: skip
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out = tl.where(rows_ok[:, None], out, 0.0)  # padding rows: zeros
    in_out = (i < L)[:, None] & (d < HEAD_DIM)[None, :]
    out_ptrs = out_ptr + b64 * stride_ob + h * stride_oh + i[:, None] * stride_ol + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_out)


def default_blocks(dtype: torch.dtype, length: int) -> dict:
    """The launch configuration for chunks of `length` places: (block_m, block_n, num_warps, num_stages).

    16-bit: 128 queries a program over 64-key blocks, 8 warps and a 2-stage pipeline (on an H200 through Triton
    3.6: about 220-250 registers a thread and no spills; wider key blocks or 4 warps spill), 64 queries for short
    chunks. fp32 (tests, references) multiplies without tensor cores to stay fp32: small blocks, or the
    compiler spills and takes minutes."""
    if dtype == torch.float32:
        return dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
    return dict(block_m=128 if length > 64 else 64, block_n=64, num_warps=8, num_stages=2)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    proj: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    seq_slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
    log_scaling: tuple[float, float] | None = None,
    **blocks: int,
) -> torch.Tensor:
    """Attention of B chunks of queries, each continuing its sequence: q [B, L, H, D] and r [B, L, H, d_rel] (may
    be strided views), the chunks' own keys and values k, v [B, L, KV, D] (not yet in the cache); chunk b's rows
    0 .. lengths[b] - 1 are its tokens at positions starts[b] + i, the rest padding. The history is read in place
    from cache_k, cache_v [S, P, KV, D] at slot seq_slots[b]. KV divides H: head h reads kv head h // (H / KV).

    A full layer (`window` None) sees the cached positions 0 .. start - 1 (entry p is position p) and the chunk's
    keys up to its own; a sliding layer's cache is a ring of `window` entries (position p at p % window) and a
    query at position t sees the positions t - window < p <= t, cached or the chunk's own. Scores are q.k / D plus
    the bias (r_t @ proj)[t - p] for distances below the extent (proj [d_rel, extent]), 0 past it; full layers with
    `log_scaling` = (n_floor, alpha) scale q and the bias by 1 + alpha * log(max((t + 1) / n_floor, 1)) (sliding
    layers ignore it, as the composite does). Returns [B, L, H, D] in q's dtype, padding rows zero.

    starts, lengths and seq_slots are device tensors, read only by the kernel, and the grid depends on shapes
    only: the call can be captured in a CUDA graph. `blocks` override `default_blocks` (block_m, block_n,
    num_warps, num_stages): each program takes block_m queries of one (chunk, head) and walks the keys block_n at
    a time (block_n dividing block_m, both powers of two >= 16).
    """
    config = default_blocks(q.dtype, q.shape[1] if q.dim() == 4 else 0)
    unknown = set(blocks) - set(config)
    if unknown:
        raise ValueError(f"prefill_attention takes blocks {sorted(config)}; got {sorted(unknown)}")
    config.update(blocks)
    block_m, block_n = config["block_m"], config["block_n"]
    _check(q, k, v, r, proj, cache_k, cache_v, seq_slots, starts, lengths, window, block_m, block_n)
    batch, length, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    rel = r @ proj  # [B, L, H, extent]: the composite's GEMM, so its rounding
    sliding = window is not None
    log = log_scaling is not None and not sliding
    floor, alpha = log_scaling if log else (1.0, 0.0)
    grid = (batch * heads, triton.cdiv(length, block_m))
    _prefill_attention_kernel[grid](
        q, k, v, cache_k, cache_v, rel, seq_slots, starts, lengths, out,
        length, heads, proj.shape[1], window if sliding else 1, 1.0 / head_dim, float(floor), float(alpha),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_v.stride(0), cache_v.stride(1),
        cache_v.stride(2), rel.stride(0), rel.stride(1), rel.stride(2), out.stride(0), out.stride(1), out.stride(2),
        GROUPS=heads // k.shape[2], HEAD_DIM=head_dim, SLIDING=sliding, LOG_SCALE=log, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out


def _check(q, k, v, r, proj, cache_k, cache_v, seq_slots, starts, lengths, window, block_m, block_n) -> None:
    """ValueError naming what does not fit."""
    tensors = dict(q=q, k=k, v=v, r=r, cache_k=cache_k, cache_v=cache_v)
    if any(t.dim() != 4 for t in tensors.values()) or proj.dim() != 2:
        dims = ", ".join(f"{name} {t.dim()}" for name, t in {**tensors, "proj": proj}.items())
        raise ValueError(f"prefill_attention needs 4-d q, k, v, r, cache_k, cache_v and a 2-d proj; got dims {dims}")
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    d_rel = proj.shape[0]
    if (
        k.shape != (batch, length, kv_heads, head_dim)
        or v.shape != k.shape
        or kv_heads == 0
        or heads % kv_heads
        or r.shape != (batch, length, heads, d_rel)
        or cache_k.shape != cache_v.shape
        or cache_k.shape[2:] != (kv_heads, head_dim)
        or any(t.shape != (batch,) for t in (seq_slots, starts, lengths))
    ):
        shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in {**tensors, "proj": proj}.items())
        index_shapes = ", ".join(f"{list(t.shape)}" for t in (seq_slots, starts, lengths))
        raise ValueError(
            f"prefill_attention needs q [B, L, H, D], k = v [B, L, KV, D] with KV dividing H, r [B, L, H, d_rel], "
            f"proj [d_rel, extent], cache_k = cache_v [S, P, KV, D] and seq_slots, starts, lengths [B]; got {shapes}, "
            f"seq_slots/starts/lengths {index_shapes}"
        )
    if window is not None and not 1 <= window <= cache_k.shape[1]:
        raise ValueError(f"prefill_attention's sliding window {window} must be in 1 .. the cache's {cache_k.shape[1]}")
    if proj.shape[1] < 1:
        raise ValueError("prefill_attention needs a bias extent (proj's columns) of at least 1")
    rows = (length * max(t.stride(1), 1) for t in (q, k, v))
    slots = (cache_k.shape[1] * max(t.stride(1), 1) for t in (cache_k, cache_v))
    spans = (*rows, *slots, length * heads * proj.shape[1])
    if max(spans) >= 2**31:  # offsets within a chunk, its bias rows and a cache slot are int32
        raise ValueError(f"prefill_attention: a chunk or cache slot spans over 2**31 elements ({max(spans)})")
    if any(t.stride(-1) != 1 for t in tensors.values()):
        raise ValueError("prefill_attention needs unit stride along the last dimension of q, k, v, r, cache_k, cache_v")
    dtypes = {t.dtype for t in (*tensors.values(), proj)}
    if len(dtypes) != 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"prefill_attention needs one float dtype (fp16, bf16 or fp32) throughout; got {dtypes}")
    if any(t.dtype.is_floating_point for t in (seq_slots, starts, lengths)):
        raise ValueError("prefill_attention needs integer seq_slots, starts and lengths")
    powers = all(x >= 16 and x & (x - 1) == 0 for x in (block_m, block_n))
    if not powers or block_m % block_n:
        raise ValueError(f"prefill_attention needs power-of-two blocks >= 16, block_n dividing block_m; got "
                         f"block_m {block_m}, block_n {block_n}")  # fmt: skip
