"""The prefill attention kernel (`triton_prefill_attention`) against a float64 reference of Inkling's attention for
chunks of queries continuing their sequences: the cached history (full layers' positions from 0, sliding layers'
ring, wrapped), the chunk's own keys up to the diagonal, GQA heads, the relative-position bias (zero past its
extent), log scaling, chunks with no history, of one token, of none, and padding rows. Run by Triton's CPU
interpreter in a child process, and compiled on the GPU at inkling-small's sizes (marked gpu). The reference is
checked against the model's own eager `InklingModel.attend`, fed as the chunk forward feeds it."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import TOLERANCE, ChildRun, assert_close, row_error

INTERPRETED = ChildRun.interpreted("tests.kernels.test_prefill_attention")


def reference(q, k, v, r, proj, cache_k, cache_v, seq, starts, lengths, window, log_scaling):
    """float64 [B, L, H, D], one query at a time; padding rows zero."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    extent = proj.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        start, slot, real = int(starts[b]), int(seq[b]), int(lengths[b])
        # the positions any of the chunk's queries may see, in order: first .. start + real - 1
        first = 0 if window is None else max(0, start - window + 1)
        places = [p if window is None else p % window for p in range(first, start)]
        keys = torch.cat([cache_k[slot, places], k[b, :real]]).double()  # [N, KV, D], key n at position first + n
        values = torch.cat([cache_v[slot, places], v[b, :real]]).double()
        rel = r[b, :real].double() @ proj.double()  # [real, H, extent]
        for i in range(real):
            t = start + i
            lo = first if window is None else max(first, t - window + 1)
            seen = slice(lo - first, t - first + 1)
            distance = t - torch.arange(lo, t + 1)
            tau = 1.0
            if log_scaling is not None and window is None:
                floor, alpha = log_scaling
                tau = 1.0 + alpha * math.log(max((t + 1) / floor, 1.0))
            bias = rel[i][:, distance.clamp(max=extent - 1)] * (distance < extent)  # [H, N]
            qk = torch.einsum("kgd,nkd->kgn", q[b, i].double().view(kv_heads, groups, head_dim), keys[seen])
            scores = tau * (qk.reshape(heads, -1) / head_dim + bias)
            probs = torch.softmax(scores, dim=-1).view(kv_heads, groups, -1)
            out[b, i] = torch.einsum("kgn,nkd->kgd", probs, values[seen]).reshape(heads, head_dim)
    return out


def make_inputs(dtype, batch, length, heads, kv_heads, head_dim, d_rel, extent, window, starts, lengths, seed=0):
    """Inputs of `prefill_attention` on the CPU (clean: every entry finite), the chunks on distinct cache slots of
    a larger cache, r a strided column slice as the engine's is. The cache holds the history each chunk may see."""
    gen = torch.Generator().manual_seed(seed)
    slots = batch + 2
    places = window if window is not None else max(starts) + length + 3
    cache_k, cache_v = (torch.randn(slots, places, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    wide = torch.randn(batch, length, heads, head_dim + d_rel + 3, generator=gen).to(dtype)
    q, r = (wide[..., :head_dim] * 4).contiguous(), wide[..., head_dim + 3 :]  # larger q: peaked softmaxes
    k, v = (torch.randn(batch, length, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    proj = (torch.randn(d_rel, extent, generator=gen) / d_rel**0.5).to(dtype)  # a bias of about unit size
    seq = torch.randperm(slots, generator=gen)[:batch]
    return q, k, v, r, proj, cache_k, cache_v, seq, torch.tensor(starts), torch.tensor(lengths)


def poisoned(inputs, window):
    """NaN wherever the kernel must not read: padding rows of q, k, v and r, cache entries at or past a chunk's
    start (on a ring: places no position has reached yet, and the oldest entry) and the slots of no chunk."""
    q, k, v, r, proj, cache_k, cache_v, seq, starts, lengths = (t.clone() for t in inputs)
    nan = float("nan")
    for b in range(q.shape[0]):
        q[b, lengths[b] :], k[b, lengths[b] :], v[b, lengths[b] :], r[b, lengths[b] :] = nan, nan, nan, nan
        unwritten = starts[b] if window is None else min(int(starts[b]), window)
        cache_k[seq[b], unwritten:], cache_v[seq[b], unwritten:] = nan, nan
        if window is not None and starts[b] >= window:  # the ring's oldest entry, out of every query's window
            cache_k[seq[b], starts[b] % window], cache_v[seq[b], starts[b] % window] = nan, nan
    others = [s for s in range(cache_k.shape[0]) if s not in seq.tolist()]
    cache_k[others], cache_v[others] = nan, nan
    return q, k, v, r, proj, cache_k, cache_v, seq, starts, lengths


def check_prefill_attention(device, dtype, window, log, shape, starts, lengths, **blocks):
    from inkwell.kernels.triton_prefill_attention import prefill_attention

    inputs = make_inputs(dtype, *shape, window, starts, lengths, seed=sum(starts) + len(lengths))
    log_scaling = (4.0, 0.1) if log else None
    expected = reference(*inputs, window, log_scaling)
    got = prefill_attention(*(t.to(device) for t in poisoned(inputs, window)), window, log_scaling, **blocks)
    assert got.shape == expected.shape and got.dtype == dtype
    real = torch.arange(shape[1])[None, :] < torch.tensor(lengths)[:, None]
    what = f"prefill attention (window={window}, log={log})"
    # the composite's own rounding in this dtype sets the bar where it exceeds the dtype's tolerance (bf16 with log
    # scaling far out: its scaled scores are sharper); a wrong kernel errs by about a row's whole norm
    composite = row_error(via_attend(*inputs, window, log_scaling)[real].flatten(1), expected[real].flatten(1))
    tolerance = max(TOLERANCE[dtype], 1.25 * composite)
    assert_close(got.cpu()[real].flatten(1), expected[real].flatten(1), dtype, what, tolerance)
    assert bool((got.cpu()[~real] == 0).all()), f"{what}: padding rows not zero"


# shape: (batch, length, heads, kv_heads, head_dim, d_rel, extent); every case has a chunk with no history, one of
# a single token and padding rows
CASES = [  # (window, log, shape, starts, lengths, blocks)
    # full, an extent of 10: history and own keys past it, far blocks (no bias) in both loops, 2 diagonal blocks,
    # a padding chunk (length 0)
    (None, False, (4, 40, 4, 2, 16, 4, 10), [0, 37, 5, 70], [40, 1, 23, 0], dict(block_m=32, block_n=16)),
    # full with log scaling, head and rel widths off a power of two, 4 heads on 1 kv head, most keys in the extent;
    # the default blocks (fp16: 64 queries, past the 33 places)
    (None, True, (3, 33, 4, 1, 24, 3, 100), [0, 50, 9], [33, 1, 20], {}),
    # sliding, a ring of 20 and an extent of 12: chunks longer than the window, histories that wrap the ring, a
    # ring not yet full
    (20, False, (4, 50, 4, 2, 16, 4, 12), [0, 47, 5, 33], [50, 1, 45, 0], dict(block_m=32, block_n=16)),
    # sliding, an extent past the window, log scaling (which sliding layers ignore), off-power-of-two widths
    (16, True, (3, 30, 4, 1, 24, 3, 40), [0, 16, 41], [30, 1, 17], dict(block_m=16, block_n=16)),
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16):  # the interpreter rounds bf16 by truncation, fp16 as the GPU
        for window, log, shape, starts, lengths, blocks in CASES:
            check_prefill_attention("cpu", dtype, window, log, shape, starts, lengths, **blocks)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_prefill_attention_matches_reference_in_interpreter():
    INTERPRETED.check()


def via_attend(q, k, v, r, proj, cache_k, cache_v, seq, starts, lengths, window, log_scaling):
    """`InklingModel.attend` fed as `ExtendForward._attention` feeds it: a sliding layer's ring joined with the
    chunk's keys, a full layer's keys written into the cache and read back up to the longest context."""
    from inkwell.serving.native.model import InklingModel

    floor, alpha = log_scaling if log_scaling is not None else (None, 0.1)
    config = SimpleNamespace(
        layer_types=["hybrid" if window is None else "hybrid_sliding"],
        log_scaling_n_floor=floor,
        log_scaling_alpha=alpha,
        sliding_window_size=window,
    )
    model = SimpleNamespace(config=config, w={"model.layers.0.self_attn.rel_logits_proj.proj": proj})
    length = q.shape[1]
    positions = starts[:, None] + torch.arange(length)[None, :]
    if window is not None:
        last = (starts - 1)[:, None]
        ring_pos = last - (last - torch.arange(window)[None, :]) % window
        keys, values = torch.cat([cache_k[seq], k], dim=1), torch.cat([cache_v[seq], v], dim=1)
        k_pos = torch.cat([ring_pos, positions], dim=1)
        return InklingModel.attend(model, 0, q, keys, values, r, positions, k_pos, valid=k_pos >= 0)
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    for b in range(q.shape[0]):
        cache_k[seq[b], starts[b] : starts[b] + length] = k[b]
        cache_v[seq[b], starts[b] : starts[b] + length] = v[b]
    context = int((starts + length).max())
    k_pos = torch.arange(context)[None].expand(q.shape[0], -1)
    return InklingModel.attend(model, 0, q, cache_k[seq, :context], cache_v[seq, :context], r, positions, k_pos)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_model_attend(case):
    """The reference's reading of the semantics is the model's: in float64, real rows agree to fp32 rounding (the
    composite's softmax runs in fp32)."""
    window, log, shape, starts, lengths, _ = CASES[case]
    inputs = make_inputs(torch.float64, *shape, window, starts, lengths, seed=case)
    log_scaling = (4.0, 0.1) if log else None
    real = torch.arange(shape[1])[None, :] < torch.tensor(lengths)[:, None]
    got = via_attend(*inputs, window, log_scaling)[real]
    assert_close(got.flatten(1), reference(*inputs, window, log_scaling)[real].flatten(1), torch.float32, "attend")


def test_prefill_attention_rejects_mismatched_shapes():
    from inkwell.kernels.triton_prefill_attention import prefill_attention

    q, kv, r, cache = torch.zeros(2, 5, 4, 8), torch.zeros(2, 5, 3, 8), torch.zeros(2, 5, 4, 2), torch.zeros(3, 9, 3, 8)
    index = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="KV dividing H"):
        prefill_attention(q, kv, kv, r, torch.zeros(2, 6), cache, cache, index, index, index, None)
    kv, cache = torch.zeros(2, 5, 2, 8), torch.zeros(3, 9, 2, 8)
    with pytest.raises(ValueError, match="sliding window 16"):
        prefill_attention(q, kv, kv, r, torch.zeros(2, 6), cache, cache, index, index, index, 16)
    with pytest.raises(ValueError, match="takes blocks"):
        prefill_attention(q, kv, kv, r, torch.zeros(2, 6), cache, cache, index, index, index, None, block_k=16)
    with pytest.raises(ValueError, match="block_n dividing block_m"):
        prefill_attention(q, kv, kv, r, torch.zeros(2, 6), cache, cache, index, index, index, None, block_m=16,
                          block_n=32)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "window,log,starts,lengths",
    [
        (512, False, [0, 700, 100, 1500], [600, 1, 600, 37]),  # longer than the window; rings full and not
        (None, False, [0, 400, 1100, 9], [600, 1, 350, 0]),  # history past the extent
        (None, True, [0, 900, 2000, 3], [600, 1, 512, 599]),
    ],
)
def test_prefill_attention_on_gpu(dtype, window, log, starts, lengths):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_prefill_attention("cuda", dtype, window, log, (4, 600, 16, 4, 128, 16, 1024), starts, lengths)
