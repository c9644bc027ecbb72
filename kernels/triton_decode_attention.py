"""Inkling's decode attention (one query per sequence, read straight from the KV cache) as one Triton kernel.

In torch a decode step's attention gathers each row's keys and values out of the cache, repeats them per query head,
builds the relative-position bias (a projection of r, gathered by distance and masked), scores, masks, softmaxes and
multiplies: about 25 launches per layer, each a few µs of latency for little work. Here a program per (row, kv head) and
run of keys reads its cache rows in place and does all of it in one pass over the keys, as flash decoding does: each run
of keys keeps its softmax's max and sum online and its values' weighted sum, and the runs of a row meet in the last of
its programs to finish. A row's runs depend on its own length alone (at most MAX_RUNS of whole blocks), not on the
launch (its rows, its cache's entries), so a row's result is the same bitwise in any batch (of up to SPLIT_COUNTS groups
of a row and kv head: 1,024 rows at 4 kv heads) and in a captured step as in an eager one, as with the two-pass kernel
before it (the step's GEMMs may still round a row by its batch's shape). The bias projection, q.k, its scaling and the
biased scores round to the model's dtype where the torch composite rounds them; the values are weighed by exp(score -
the run's running max), rounded to the values' dtype for the tensor-core dot, and divided by the fp32 sum at the end
(the composite rounds the normalised probabilities, which needs the row's whole sum first, a second pass over the keys),
so results agree with the composite within its dtype's rounding, not bitwise.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from inkwell.kernels.split_counts import SPLIT_COUNTS, split_counts
from inkwell.kernels.triton_lora.common import dot_precision
from inkwell.kernels.triton_pdl import chain_launch

# a masked score (torch's composite fills finfo.min): exp() of it minus any real score is 0
_MASKED = tl.constexpr(-3.0e38)


@triton.jit
def _block(
    k_base, v_base, proj_ptr, pos, ring, p0, last, P, stride_kl, stride_pi, stride_pe, head_dim, d_rel,
    SLIDING: tl.constexpr, EXTENT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_REL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """What scoring cache entries p0 .. p0 + BLOCK_P reads, all at once: their keys and values (those below
    `last`), the bias projection's columns at their distances [BLOCK_REL, BLOCK_P], and which entries the row sees."""
    j = p0 + tl.arange(0, BLOCK_P)
    if SLIDING:  # ring entry j holds the position whose distance from pos is (pos - j) mod P; ring = pos mod P
        distance = ring - j + tl.where(j > ring, P, 0)
        allowed = (j < P) & (pos - distance >= 0)
    else:
        distance = pos - j
        allowed = (j < P) & (distance >= 0)
    d = tl.arange(0, BLOCK_D)
    in_kv = ((j < last) & allowed)[:, None] & (d < head_dim)[None, :]
    keys = tl.load(k_base + j[:, None] * stride_kl + d[None, :], mask=in_kv, other=0.0)
    values = tl.load(v_base + j[:, None] * stride_kl + d[None, :], mask=in_kv, other=0.0)
    i = tl.arange(0, BLOCK_REL)
    in_proj = (i < d_rel)[:, None] & (allowed & (distance < EXTENT))[None, :]
    proj = tl.load(proj_ptr + i[:, None] * stride_pi + distance[None, :] * stride_pe, mask=in_proj, other=0.0)
    return keys, values, proj, allowed


@triton.jit
def _accumulate(
    q, r, tau, keys, values, proj, allowed, top, total, acc, scale, dtype, LOG_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax of a kv head's query heads [BLOCK_G] over one block: their biased, masked scores (rounded
    to `dtype` where the torch composite rounds them), the running maxima `top`, the sums of exp(score - top) and
    the values weighted by them, each product a tensor-core dot."""
    qk = tl.dot(q, tl.trans(keys), input_precision=PRECISION).to(dtype).to(tl.float32)
    qk = (qk * scale).to(dtype).to(tl.float32)
    bias = tl.dot(r, proj, input_precision=PRECISION).to(dtype).to(tl.float32)
    if LOG_SCALE:
        bias = (bias * tau).to(dtype).to(tl.float32)
    scores = tl.where(allowed[None, :], (qk + bias).to(dtype).to(tl.float32), _MASKED)
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    rescale = tl.exp(top - new_top)
    weights = tl.where(allowed[None, :], tl.exp(scores - new_top[:, None]), 0.0)  # 0 in a block the row sees none of
    total = total * rescale + tl.sum(weights, axis=1)
    weighted = tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
    return new_top, total, acc * rescale[:, None] + weighted


@triton.jit
def _decode_attention_kernel(
    q_ptr, r_ptr, k_ptr, v_ptr, proj_ptr, seq_ptr, pos_ptr, out_ptr, part_ptr, stat_ptr, count_ptr,
    P, scale, log_floor, log_alpha,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_ks, stride_kl, stride_kh, stride_pi, stride_pe,
    stride_ob, stride_oh,
    head_dim, d_rel,
    GROUPS: tl.constexpr, SLIDING: tl.constexpr, LOG_SCALE: tl.constexpr, EXTENT: tl.constexpr, RUNS: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_REL: tl.constexpr,
    BLOCK_P: tl.constexpr, CHAINED: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """One run of a row's keys for the GROUPS query heads of one kv head (a tile of BLOCK_G rows, those past GROUPS
    unused), so each key and value is read once for them all. SPLITS programs per (row, kv head) are launched, at
    least as many as any row's runs; those past a row's last run return at once. Chained with EARLY, it reads its
    first block before its wait: the step's inputs (sequence slot, position) and the cache entries of earlier steps,
    which no kernel of this step writes; only the row's own entry, which the prologue before it writes, is read again
    after the wait."""
    if CHAINED:
        gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    dtype = out_ptr.dtype.element_ty
    seq = tl.load(seq_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    ring = pos % P  # once here, not a modulo per key
    own = ring if SLIDING else pos  # the entry of the row's own key
    kv_offset = seq * stride_ks + kv_head * stride_kh
    k_base, v_base = k_ptr + kv_offset, v_ptr + kv_offset
    # entries past min(pos + 1, P) hold no key the row sees (a ring fills from entry 0); the seen entries are cut
    # into at most RUNS runs of whole blocks, `runs` of them, this program's run first .. last (empty past them)
    seen = tl.minimum(pos + 1, P)
    run = tl.cdiv(tl.cdiv(seen, RUNS), BLOCK_P) * BLOCK_P
    runs = tl.cdiv(seen, run)
    if split >= runs:  # past the row's last run: nothing to read (the next kernel's wait is for the whole grid)
        return
    first = split * run
    last = tl.minimum(first + run, seen)
    d = tl.arange(0, BLOCK_D)
    in_d = d < head_dim
    if CHAINED and not EARLY:
        gdc_wait()
    keys, values, proj, allowed = _block(
        k_base, v_base, proj_ptr, pos, ring, first, last, P, stride_kl, stride_pi, stride_pe, head_dim, d_rel,
        SLIDING, EXTENT, BLOCK_D, BLOCK_REL, BLOCK_P,
    )  # fmt: skip
    if CHAINED and EARLY:  # the row's own key and value, written by the prologue, if they are in the block read early
        gdc_wait()
        j = first + tl.arange(0, BLOCK_P)
        mine = (own >= first) & (own < first + BLOCK_P) & (own < last)
        own_key = tl.load(k_base + own * stride_kl + d, mask=in_d & mine, other=0.0)
        own_value = tl.load(v_base + own * stride_kl + d, mask=in_d & mine, other=0.0)
        keys = tl.where((j == own)[:, None], own_key[None, :], keys)
        values = tl.where((j == own)[:, None], own_value[None, :], values)
    g = tl.arange(0, BLOCK_G)
    in_g = g < GROUPS
    heads = kv_head * GROUPS + g
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=in_g[:, None] & in_d[None, :], other=0.0).to(tl.float32)
    tau = 1.0
    if LOG_SCALE:  # full layers: q and the bias scaled by 1 + alpha * log(max((pos + 1) / floor, 1))
        tau = 1.0 + log_alpha * tl.log(tl.maximum((pos + 1).to(tl.float32) / log_floor, 1.0))
    q = (q * tau).to(dtype)
    i = tl.arange(0, BLOCK_REL)
    r_ptrs = r_ptr + b * stride_rb + heads[:, None] * stride_rh + i[None, :]
    r = tl.load(r_ptrs, mask=in_g[:, None] & (i < d_rel)[None, :], other=0.0).to(dtype)
    top = tl.full((BLOCK_G,), _MASKED, tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    top, total, acc = _accumulate(
        q, r, tau, keys, values, proj, allowed, top, total, acc, scale, dtype, LOG_SCALE, PRECISION
    )  # fmt: skip
    for p0 in range(first + BLOCK_P, last, BLOCK_P):  # one pass, the softmax online
        keys, values, proj, allowed = _block(
            k_base, v_base, proj_ptr, pos, ring, p0, last, P, stride_kl, stride_pi, stride_pe, head_dim, d_rel,
            SLIDING, EXTENT, BLOCK_D, BLOCK_REL, BLOCK_P,
        )  # fmt: skip
        top, total, acc = _accumulate(
            q, r, tau, keys, values, proj, allowed, top, total, acc, scale, dtype, LOG_SCALE, PRECISION
        )  # fmt: skip
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    in_out = in_g[:, None] & in_d[None, :]
    if SPLITS == 1 or runs == 1:  # the first run holds the row's every key: no partials, no count
        tl.store(out_ptrs, (acc / total[:, None]).to(dtype), mask=in_out)
    else:  # the row's runs meet: each writes its partial, the last one to count weighs and sums them
        group = b * tl.num_programs(1) + kv_head
        ours = (group * SPLITS + split) * GROUPS + g  # this run's row of partials per query head
        tl.store(part_ptr + ours[:, None] * BLOCK_D + d[None, :], acc, mask=in_g[:, None])
        tl.store(stat_ptr + ours * 2, top, mask=in_g)
        tl.store(stat_ptr + ours * 2 + 1, total, mask=in_g)
        tl.debug_barrier()  # every thread's stores before the count's release (one thread adds for the program)
        if tl.atomic_add(count_ptr + group, 1) == runs - 1:  # the other runs' partials are visible now
            # unrolled over the launch's SPLITS, those past the row's runs masked: a masked run adds exp(_MASKED -
            # row_top) x 0 = 0 to the sums, so they are bitwise those of a loop over the row's runs
            row_top = tl.full((BLOCK_G,), _MASKED, tl.float32)
            for other in tl.static_range(SPLITS):
                stats = stat_ptr + ((group * SPLITS + other) * GROUPS + g) * 2
                ran = in_g & (other < runs)
                row_top = tl.maximum(row_top, tl.load(stats, mask=ran, other=_MASKED, cache_modifier=".cg"))
            row_total = tl.zeros((BLOCK_G,), tl.float32)
            row = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
            for other in tl.static_range(SPLITS):  # in run order
                at = (group * SPLITS + other) * GROUPS + g
                ran = in_g & (other < runs)
                run_top = tl.load(stat_ptr + at * 2, mask=ran, other=_MASKED, cache_modifier=".cg")
                run_total = tl.load(stat_ptr + at * 2 + 1, mask=ran, other=0.0, cache_modifier=".cg")
                part = tl.load(part_ptr + at[:, None] * BLOCK_D + d[None, :], mask=ran[:, None], other=0.0)
                weight = tl.exp(run_top - row_top)
                row_total += run_total * weight
                row += part * weight[:, None]
            tl.store(out_ptrs, (row / row_total[:, None]).to(dtype), mask=in_out)
            tl.atomic_xchg(count_ptr + group, 0)


# The most runs a row's keys are cut into: each (row, kv head) is a few round trips to memory per block of keys, so
# one program each (32 for 8 rows of 4 kv heads) leaves most of a 132-SM GPU idle while it walks its row's keys;
# cut into runs, 8 rows fill the GPU with 256 programs of a few blocks each. A constant, not a count fitted to the
# launch, so that a row's runs, and so its result's rounding, do not depend on its batch.
MAX_RUNS = 8


def attention_splits(row_kv_heads: int, entries: int, block_p: int, runs: int = MAX_RUNS) -> int:
    """Programs per (row, kv head) for rows cut into at most `runs` runs of whole `block_p` blocks: as many as the
    longest row (`entries` keys) can have, and 1 where the launch has more (row, kv head) groups than the split
    counts serve (its rows are then one run each, as a row of at most `block_p` keys always is)."""
    if row_kv_heads > SPLIT_COUNTS:
        return 1
    return max(1, min(triton.cdiv(entries, block_p), runs))


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
    block_p: int = 64,
    num_warps: int = 4,
    runs: int = MAX_RUNS,
    early: bool = True,
) -> torch.Tensor:
    """Attention of one query per row: q [B, H, D] and r [B, H, d_rel] (rows may be strided) against the first
    `entries` cache entries of sequence `seq_slots[b]` in keys/values [S, L, KV, D], which already hold the row's
    own key at `positions[b]`.

    A full layer's entry j is position j (keys past the row's position are masked); a sliding layer's cache is a
    ring of `entries` positions (position p at p % entries). The bias is `proj` [d_rel, extent] at each key's
    distance (0 past the extent); full layers with `log_scaling` = (n_floor, alpha) scale q and the bias by
    1 + alpha * log(max((pos + 1) / n_floor, 1)). Returns [B, H, D] in q's dtype.

    Each row's keys are cut into at most `runs` runs of whole `block_p` blocks (a function of the row's length
    alone, so its result does not depend on the launch), a program per run and kv head for all the kv head's query
    heads; the last of a row's programs to finish weighs and sums their partials. With `early` (chained on CUDA),
    each program reads its first block before it waits for the kernel before it (see `_decode_attention_kernel`).
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
    block_p, block_d = max(16, block_p), max(16, triton.next_power_of_2(head_dim))  # a tensor-core dot's sides: >= 16
    splits = attention_splits(rows * kv_heads, entries, block_p, runs)
    parts = stats = counts = out  # read only by a split launch
    if splits > 1:
        parts = torch.empty(rows * heads * splits * block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows * heads * splits * 2, dtype=torch.float32, device=q.device)
        counts = split_counts("decode_attention", q.device)
    _decode_attention_kernel[(rows, kv_heads, splits)](
        q, r, keys, values, proj, seq_slots, positions, out, parts, stats, counts,
        entries, 1.0 / head_dim, floor, alpha,
        q.stride(0), q.stride(1), r.stride(0), r.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        proj.stride(0), proj.stride(1), out.stride(0), out.stride(1), head_dim, d_rel,
        GROUPS=heads // kv_heads, SLIDING=sliding, LOG_SCALE=log_scaling is not None and not sliding, EXTENT=extent,
        RUNS=runs if splits > 1 else 1, SPLITS=splits, PRECISION=dot_precision(q.dtype),
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_D=block_d, BLOCK_REL=max(16, triton.next_power_of_2(d_rel)), BLOCK_P=block_p, EARLY=early,
        num_warps=num_warps, **chain_launch(q),
    )  # fmt: skip
    return out
