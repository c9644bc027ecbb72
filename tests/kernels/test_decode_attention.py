"""The decode attention kernel (`triton_decode_attention`) against a float64 reference of Inkling's attention for
one query per row: GQA heads, the relative-position bias (zero past its extent), the causal mask of full layers,
the ring of sliding layers (entries not yet written are masked) and log scaling. Run by Triton's CPU interpreter
in a child process, and compiled on the GPU at inkling-small's sizes (marked gpu)."""

import math
import os

import pytest
import torch

from tests.kernels.helpers import ChildRun, assert_close

INTERPRETED = ChildRun.interpreted("tests.kernels.test_decode_attention")


def reference(q, r, keys, values, proj, seq, pos, entries, sliding, log_scaling):
    """float64 [B, H, D], one row at a time."""
    heads, kv_heads = q.shape[1], keys.shape[2]
    extent = proj.shape[1]
    out = []
    for b in range(q.shape[0]):
        p, j = int(pos[b]), torch.arange(entries)
        distance = (p - j) % entries if sliding else p - j
        allowed = (p - distance >= 0) if sliding else (distance >= 0)
        k = keys[seq[b], :entries].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, P, D]
        v = values[seq[b], :entries].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        tau = 1.0
        if log_scaling is not None and not sliding:
            floor, alpha = log_scaling
            tau = 1.0 + alpha * math.log(max((p + 1) / floor, 1.0))
        rel = r[b].double() @ proj.double()  # [H, extent]
        bias = rel[:, distance.clamp(0, extent - 1)] * ((distance >= 0) & (distance < extent))
        scores = (q[b].double()[:, None, :] * tau * k).sum(-1) / q.shape[2] + bias * tau
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        out.append((probs[:, :, None] * v).sum(1))
    return torch.stack(out)


def check_decode_attention(
    device, dtype, rows, heads, kv_heads, head_dim, d_rel, extent, entries, sliding, log, **blocks
):
    """Rows on distinct sequence slots of a larger cache, q and r as strided column slices, positions that reach
    past the ring (sliding) or stop short of the last entries (full); `blocks` (block_p, runs) as the kernel
    takes them, its defaults where absent."""
    from inkwell.kernels.triton_decode_attention import decode_attention

    gen = torch.Generator().manual_seed(rows * 100 + entries + head_dim + sliding)
    cache = (rows + 2, entries + 5, kv_heads, head_dim)
    keys, values = (torch.randn(cache, generator=gen).to(dtype) for _ in range(2))
    wide = torch.randn(rows, heads, head_dim + d_rel + 3, generator=gen).to(dtype)
    q, r = wide[:, :, :head_dim] * 4, wide[:, :, head_dim + 3 :]  # larger q: peaked softmaxes
    proj = (torch.randn(d_rel, extent, generator=gen) / d_rel**0.5).to(dtype)  # a bias of about unit size
    seq = torch.randperm(rows + 2, generator=gen)[:rows]
    top = 3 * entries if sliding else entries
    pos = torch.randint(0, top, (rows,), generator=gen)
    pos[0], pos[-1] = 1, top - 1  # a ring not yet full / the last entry
    if rows > 2:
        pos[1] = min(16, top - 1)  # the row's own key first in a block of 16 (the loops stop after it)
    log_scaling = (4.0, 0.1) if log else None
    expected = reference(q, r, keys, values, proj, seq, pos, entries, sliding, log_scaling)
    q, r = q.contiguous(), r  # r stays a strided view, as the engine's r is a column slice of q/k/v/r
    got = decode_attention(
        q.to(device), r.to(device), keys.to(device), values.to(device), proj.to(device),
        seq.to(device), pos.to(device), entries, sliding, log_scaling, **blocks,
    )  # fmt: skip
    assert got.shape == expected.shape and got.dtype == dtype
    assert_close(got.reshape(rows, -1), expected.reshape(rows, -1), dtype, f"attention (sliding={sliding})")


CASES = [  # (rows, heads, kv_heads, head_dim, d_rel, extent, entries, sliding, log)
    (3, 4, 2, 16, 4, 10, 20, True, False),  # a ring of 20 with an extent of 10
    (4, 4, 2, 16, 4, 10, 70, False, False),  # most keys past the extent
    (3, 4, 1, 24, 3, 100, 30, False, True),  # head and rel widths off a power of two, log scaling
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16):  # the interpreter rounds bf16 by truncation, fp16 as the GPU
        for case in CASES:
            for runs in (1, 3):  # one run per row; up to three, fewer for a short row
                check_decode_attention("cpu", dtype, *case, block_p=16, runs=runs)  # several blocks per run
        for case in CASES:
            check_rows_alone_equal_batched(dtype, *case)
    print("interpreted cases passed")


def check_rows_alone_equal_batched(dtype, rows, heads, kv_heads, head_dim, d_rel, extent, entries, sliding, log):
    """Each row alone (a full layer's cache cut at the row's own key) gives bitwise the output it gets in the
    whole batch over all `entries`: a row's runs, and so its rounding, depend on its length, not on the launch."""
    from inkwell.kernels.triton_decode_attention import decode_attention

    gen = torch.Generator().manual_seed(rows + entries)
    keys, values = (torch.randn(rows, entries, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype) * 4
    r = torch.randn(rows, heads, d_rel, generator=gen).to(dtype)
    proj = (torch.randn(d_rel, extent, generator=gen) / d_rel**0.5).to(dtype)
    seq = torch.arange(rows)
    pos = torch.randint(entries // 2, 3 * entries if sliding else entries, (rows,), generator=gen)
    log_scaling = (4.0, 0.1) if log else None
    batched = decode_attention(q, r, keys, values, proj, seq, pos, entries, sliding, log_scaling, block_p=16, runs=3)
    for b in range(rows):
        own = entries if sliding else int(pos[b]) + 1  # a ring's size is the layer's; a full cache holds what is seen
        alone = decode_attention(
            q[b : b + 1], r[b : b + 1], keys, values, proj, seq[b : b + 1], pos[b : b + 1], own, sliding,
            log_scaling, block_p=16, runs=3,
        )  # fmt: skip
        assert torch.equal(alone[0], batched[b]), f"row {b} alone differs from its batch (sliding={sliding})"


@pytest.mark.child(INTERPRETED)
def test_decode_attention_matches_reference_in_interpreter():
    INTERPRETED.check()


def test_decode_attention_rejects_mismatched_shapes():
    from inkwell.kernels.triton_decode_attention import decode_attention

    q, r, cache = torch.zeros(2, 4, 8), torch.zeros(2, 4, 2), torch.zeros(3, 10, 3, 8)
    with pytest.raises(ValueError, match="KV dividing H"):
        decode_attention(q, r, cache, cache, torch.zeros(2, 5), torch.arange(2), torch.arange(2), 10, False)


def test_a_launch_has_a_program_for_each_run_of_its_longest_row():
    from inkwell.kernels.triton_decode_attention import MAX_RUNS, attention_splits

    assert attention_splits(8 * 4, 512, 64) == MAX_RUNS  # 8 rows of 4 kv heads on a 512-entry ring
    assert attention_splits(128 * 4, 512, 64) == MAX_RUNS  # the same per row in a larger batch
    assert attention_splits(8 * 4, 160, 64) == 3  # no more runs than blocks of entries
    assert attention_splits(8 * 4, 512, 64, runs=2) == 2
    assert attention_splits(100_000, 4096, 128) == 1  # more groups than the split counts serve


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("entries,sliding,log", [(512, True, False), (256, False, False), (1024, False, True)])
@pytest.mark.parametrize("runs", [None, 1, 5])
def test_decode_attention_on_gpu(dtype, entries, sliding, log, runs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    blocks = {} if runs is None else {"runs": runs}
    check_decode_attention("cuda", dtype, 8, 16, 4, 128, 16, 1024, entries, sliding, log, **blocks)
