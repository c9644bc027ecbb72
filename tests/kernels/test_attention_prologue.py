"""The decode attention's prologue kernel (`triton_attention_prologue`) against a float64 reference: k and v through
their ShortConv step, q and k normalized, k and v written at each row's cache place (the ring's for a sliding
layer), the conv state shifted by one, and nothing else of the cache or the state touched. Run by Triton's CPU
interpreter in a child process, and compiled on the GPU at inkling-small's widths (marked gpu)."""

import os

import pytest
import torch

from tests.kernels.helpers import ChildRun, assert_close, rms_norm_f64

INTERPRETED = ChildRun.interpreted("tests.kernels.test_attention_prologue")

EPS = 1e-6


def check_prologue(
    device: str, dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int, kernel: int, ring: int | None
) -> None:
    """Rows on distinct sequence slots of a pool with more slots; qkvr a column slice of wider rows, the conv state a
    channel slice of a wider buffer, as the engine passes them."""
    from inkwell.kernels.triton_attention_prologue import decode_attention_prologue

    gen = torch.Generator().manual_seed(rows * 100 + heads * 10 + head_dim + kernel)
    q_cols, kv_cols, d_rel, length = heads * head_dim, kv_heads * head_dim, 4, ring or 12
    wide = torch.randn(rows, q_cols + 2 * kv_cols + heads * d_rel + 8, generator=gen).to(dtype)
    qkvr = wide[:, 8:]
    slots = rows + 2
    pool = torch.randn(slots, 2 * kv_cols + 8, kernel - 1, generator=gen)
    seq = torch.randperm(slots, generator=gen)[:rows]
    positions = torch.randint(0, 3 * length if ring else length, (rows,), generator=gen)  # rings wrap
    keys, values = (torch.randn(slots, length, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    conv_weight = torch.randn(2 * kv_cols, 1, kernel, generator=gen) / kernel
    q_norm, k_norm = ((1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2))

    kv = qkvr[:, q_cols : q_cols + 2 * kv_cols].double()
    window = torch.cat([pool[seq, 8:].double(), kv[:, :, None]], dim=-1)  # [rows, 2*KV*D, kernel]
    conv = (window * conv_weight[:, 0].double()).sum(-1) + kv
    k = rms_norm_f64(conv[:, :kv_cols].view(rows, kv_heads, head_dim), k_norm, EPS)
    v = conv[:, kv_cols:].view(rows, kv_heads, head_dim)
    q = rms_norm_f64(qkvr[:, :q_cols].double().view(rows, heads, head_dim), q_norm, EPS)
    places = positions % ring if ring else positions

    d_wide, d_pool, d_keys, d_values = (t.to(device) for t in (wide, pool, keys, values))
    got = decode_attention_prologue(
        d_wide[:, 8:],
        heads,
        d_pool[:, 8:],
        conv_weight.to(device),
        q_norm.to(device),
        k_norm.to(device),
        EPS,
        d_keys,
        d_values,
        seq.to(device),
        positions.to(device),
        ring,
    )
    assert got.shape == (rows, heads, head_dim) and got.dtype == dtype
    assert_close(got, q, dtype, "q normalized")
    got_keys, got_values, got_pool = d_keys.cpu(), d_values.cpu(), d_pool.cpu()
    assert_close(got_keys[seq, places], k, dtype, "k through its conv, normalized, in the cache")
    assert_close(got_values[seq, places], v, dtype, "v through its conv, in the cache")
    written = torch.zeros(slots, length, dtype=torch.bool)
    written[seq, places] = True
    assert torch.equal(got_keys[~written], keys[~written]) and torch.equal(got_values[~written], values[~written])
    assert torch.equal(got_pool[seq, 8:], window[:, :, 1:].float()), "the conv state is not shifted by one"
    others = torch.ones(slots, dtype=torch.bool)
    others[seq] = False
    assert torch.equal(got_pool[others], pool[others]) and torch.equal(got_pool[:, :8], pool[:, :8])


CASES = [  # (rows, heads, kv heads, head dim, kernel, ring): groups of 2 and 3 (not a power of two), D off one
    (3, 4, 2, 16, 4, None),
    (2, 6, 2, 24, 3, 5),
    (4, 2, 2, 8, 2, 7),
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16):  # the interpreter rounds bf16 by truncation, fp16 as the GPU
        for case in CASES:
            check_prologue("cpu", dtype, *case)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_prologue_matches_reference_in_interpreter():
    INTERPRETED.check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ring", [None, 512])
def test_prologue_on_gpu_at_inkling_small_widths(dtype, ring):
    check_prologue("cuda", dtype, 8, 16, 4, 128, 4, ring)
