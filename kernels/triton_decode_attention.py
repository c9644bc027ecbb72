"""Inkling's decode attention (one query per sequence, read straight from the KV cache) as one Triton kernel.

In torch a decode step's attention gathers each row's keys and values out of the cache, repeats them per query
head, builds the relative-position bias (a projection of r, gathered by distance and masked), scores, masks,
softmaxes and multiplies: about 25 launches per layer, each a few µs of latency for little work. Here one program
per (row, head) reads its kv head's cache rows in place and does all of it, in two passes over the keys (the
softmax's max and sum, then the weighted values), so that it can round where the torch composite rounds: the bias
projection, q.k, its scaling and the biased scores to the model's dtype, the probabilities to it before they weigh
the values. Sums run in another order, so results agree with the composite to fp32 rounding, not bitwise.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_pdl import chain_launch, chain_start

# a masked score (torch's composite fills finfo.min): exp() of it minus any real score is 0
_MASKED = tl.constexpr(-3.0e38)


@triton.jit
def _scores(
    q, r, tau, pos, ring, p0, k_base, proj_ptr, out_ptr, P, stride_kl, stride_pi, stride_pe, scale, head_dim, d_rel,
    SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr, EXTENT: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_REL: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Biased, masked scores [BLOCK_P] of cache entries p0 .. p0 + BLOCK_P (fp32 holding values of the output's
    dtype)."""
    dtype = out_ptr.dtype.element_ty
    j = p0 + tl.arange(0, BLOCK_P)
    if SLIDING:  # ring entry j holds the position whose distance from pos is (pos - j) mod P; ring = pos mod P
        distance = ring - j + tl.where(j > ring, P, 0)
        allowed = (j < P) & (pos - distance >= 0)
    else:
        distance = pos - j
        allowed = (j < P) & (distance >= 0)
    d = tl.arange(0, BLOCK_D)
    in_keys = allowed[:, None] & (d < head_dim)[None, :]
    keys = tl.load(k_base + j[:, None] * stride_kl + d[None, :], mask=in_keys, other=0.0)
    qk = tl.sum(q[None, :] * keys.to(tl.float32), axis=1).to(dtype).to(tl.float32)
    qk = (qk * scale).to(dtype).to(tl.float32)
    in_extent = allowed & (distance < EXTENT)
    i = tl.arange(0, BLOCK_REL)
    in_proj = (i < d_rel)[:, None] & in_extent[None, :]
    proj = tl.load(proj_ptr + i[:, None] * stride_pi + distance[None, :] * stride_pe, mask=in_proj, other=0.0)
    bias = tl.sum(r[:, None] * proj.to(tl.float32), axis=0).to(dtype).to(tl.float32)
    if LOG_SCALE:
        bias = (bias * tau).to(dtype).to(tl.float32)
    scores = (qk + bias).to(dtype).to(tl.float32)
    return tl.where(allowed, scores, _MASKED)


@triton.jit
def _decode_attention_kernel(
    q_ptr, r_ptr, k_ptr, v_ptr, proj_ptr, seq_ptr, pos_ptr, out_ptr,
    P, scale, log_floor, log_alpha,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ks, stride_kl, stride_kh, stride_pi, stride_pe,
    stride_ob, stride_oh,
    head_dim, d_rel,
    GROUPS: tl.constexpr, SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr, EXTENT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_REL: tl.constexpr, BLOCK_P: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    chain_start(CHAINED)
    b = tl.program_id(0)
    h = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    seq = tl.load(seq_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    ring = pos % P  # once here, not a modulo per key
    d = tl.arange(0, BLOCK_D)
    in_d = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=in_d, other=0.0).to(tl.float32)
    tau = 1.0
    if LOG_SCALE:  # full layers: q and the bias scaled by 1 + alpha * log(max((pos + 1) / floor, 1))
        tau = 1.0 + log_alpha * tl.log(tl.maximum((pos + 1).to(tl.float32) / log_floor, 1.0))
        q = (q * tau).to(dtype).to(tl.float32)
    i = tl.arange(0, BLOCK_REL)
    r = tl.load(r_ptr + b * stride_rb + h * stride_rh + i, mask=i < d_rel, other=0.0).to(tl.float32)
    kv_offset = seq * stride_ks + (h // GROUPS) * stride_kh
    k_base, v_base = k_ptr + kv_offset, v_ptr + kv_offset
    top = tl.full((), _MASKED, tl.float32)
    total = tl.zeros((), tl.float32)
    # entries past min(pos + 1, P) hold no key the row sees (a ring fills from entry 0): the loops stop there
    seen = tl.minimum(pos + 1, P)
    for p0 in range(0, seen, BLOCK_P):  # pass 1: the softmax's max and sum (online)
        s = _scores(
            q, r, tau, pos, ring, p0, k_base, proj_ptr, out_ptr, P, stride_kl, stride_pi, stride_pe, scale, head_dim,
            d_rel, SLIDING, LOG_SCALE, EXTENT, BLOCK_D, BLOCK_REL, BLOCK_P,
        )  # fmt: skip
        new_top = tl.maximum(top, tl.max(s, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top), axis=0)
        top = new_top
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for p0 in range(0, seen, BLOCK_P):  # pass 2: probabilities, rounded, times the values
        s = _scores(
            q, r, tau, pos, ring, p0, k_base, proj_ptr, out_ptr, P, stride_kl, stride_pi, stride_pe, scale, head_dim,
            d_rel, SLIDING, LOG_SCALE, EXTENT, BLOCK_D, BLOCK_REL, BLOCK_P,
        )  # fmt: skip
        probs = (tl.exp(s - top) / total).to(dtype).to(tl.float32)
        j = p0 + tl.arange(0, BLOCK_P)
        in_values = (probs > 0)[:, None] & in_d[None, :]
        values = tl.load(v_base + j[:, None] * stride_kl + d[None, :], mask=in_values, other=0.0)
        acc += tl.sum(probs[:, None] * values.to(tl.float32), axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, acc.to(dtype), mask=in_d)


def decode_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    proj: torch.Tensor,
    seq_slots: torch.Tensor,
    positions: torch.Tensor,
    entries: int,
    sliding: bool,
    log_scaling: tuple[float, float] | None = None,
    block_p: int = 256,
    num_warps: int = 8,
) -> torch.Tensor:
    """Attention of one query per row: q [B, H, D] and r [B, H, d_rel] (rows may be strided) against the first
    `entries` cache entries of sequence `seq_slots[b]` in keys/values [S, L, KV, D], which already hold the row's
    own key at `positions[b]`.

    A full layer's entry j is position j (keys past the row's position are masked); a sliding layer's cache is a
    ring of `entries` positions (position p at p % entries). The bias is `proj` [d_rel, extent] at each key's
    distance (0 past the extent); full layers with `log_scaling` = (n_floor, alpha) scale q and the bias by
    1 + alpha * log(max((pos + 1) / n_floor, 1)). Returns [B, H, D] in q's dtype. Each program walks the keys
    `block_p` at a time (a step is one round trip to memory, so wide blocks and many warps keep more in flight).
    """
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    d_rel, extent = proj.shape
    if (
        keys.shape != values.shape
        or keys.stride() != values.stride()
        or keys.shape[3] != head_dim
        or heads % kv_heads
        or r.shape[:2] != (rows, heads)
        or r.shape[2] != d_rel
        or entries > keys.shape[1]
    ):
        raise ValueError(
            f"decode_attention needs q [B, H, D], r [B, H, d_rel], keys = values [S, L, KV, D] with KV dividing H "
            f"and L >= entries, proj [d_rel, extent]; got q {list(q.shape)}, r {list(r.shape)}, keys "
            f"{list(keys.shape)}, values {list(values.shape)}, proj {list(proj.shape)}, entries {entries}"
        )
    if any(t.stride(-1) != 1 for t in (q, r, keys)):
        raise ValueError("decode_attention needs unit stride along the head dimension of q, r, keys and values")
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    floor, alpha = log_scaling if log_scaling is not None and not sliding else (1.0, 0.0)
    _decode_attention_kernel[(rows, heads)](
        q, r, keys, values, proj, seq_slots, positions, out,
        entries, 1.0 / head_dim, floor, alpha,
        q.stride(0), q.stride(1), r.stride(0), r.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        proj.stride(0), proj.stride(1), out.stride(0), out.stride(1), head_dim, d_rel,
        GROUPS=heads // kv_heads, SLIDING=sliding, LOG_SCALE=log_scaling is not None and not sliding, EXTENT=extent,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_REL=triton.next_power_of_2(d_rel), BLOCK_P=block_p,
        num_warps=num_warps, **chain_launch(q),
    )  # fmt: skip
    return out
