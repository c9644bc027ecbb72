"""The forward's first op (`triton_embed`): the embedding rows, the embedding norm and the first layer's input norm
in one kernel, against float64 and against the ops it replaces. Run by Triton's CPU interpreter in a child process,
and compiled on the GPU at inkling-small's width (marked gpu)."""

import os

import pytest
import torch

from tests.kernels.helpers import ChildRun, assert_close, rms_norm_f64

INTERPRETED = ChildRun.interpreted("tests.kernels.test_embed")

EPS = 1e-6
# (tokens, vocab, dim): a decode batch at inkling-small's width, a prefill block of odd size, a width that masks
SHAPES = ((8, 512, 2048), (37, 100, 256), (5, 7, 24))


def reference(ids: torch.Tensor, table: torch.Tensor, embed_norm: torch.Tensor, input_norm: torch.Tensor):
    """h and x in float64, an id outside the table a zero row."""
    known = (ids >= 0) & (ids < table.shape[0])
    rows = torch.where(known[:, None], table.double()[ids.clamp(0, table.shape[0] - 1)], 0.0)
    h = rms_norm_f64(rows, embed_norm, EPS)
    return h, rms_norm_f64(h, input_norm, EPS)


def check_embed_norms(device: str, dtype: torch.dtype, tokens: int, vocab: int, dim: int) -> None:
    from inkwell.kernels.triton_embed import embed_norms
    from inkwell.kernels.triton_rms_norm import rms_norm

    gen = torch.Generator().manual_seed(tokens + vocab + dim)
    table = (3 * torch.randn(vocab, dim, generator=gen)).to(dtype)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    ids[1], ids[-1] = vocab, -1  # outside the table: zero rows, not a read past it
    embed_norm, input_norm = ((1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2))
    on = dict(device=device)
    h, x = embed_norms(ids.to(**on), table.to(**on), embed_norm.to(**on), input_norm.to(**on), EPS)
    assert h.shape == x.shape == (tokens, dim) and h.dtype == x.dtype == dtype
    want_h, want_x = reference(ids, table, embed_norm, input_norm)
    assert_close(h, want_h, dtype, "h")
    assert_close(x, want_x, dtype, "x")
    assert not h[1].any() and not x[-1].any(), "an id outside the table must give a zero row"
    if device == "cuda":  # bitwise the ops it replaces: the gather, then triton_rms_norm twice
        known = ids.clamp(0, vocab - 1).to(**on)
        twin_h = rms_norm(torch.nn.functional.embedding(known, table.to(**on)), embed_norm.to(**on), EPS)
        twin_x = rms_norm(twin_h, input_norm.to(**on), EPS)
        inside = torch.ones(tokens, dtype=torch.bool)
        inside[1] = inside[-1] = False
        assert torch.equal(h[inside.to(**on)], twin_h[inside.to(**on)]), "h not bitwise the gather + rms_norm"
        assert torch.equal(x[inside.to(**on)], twin_x[inside.to(**on)]), "x not bitwise rms_norm of h"


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for shape in SHAPES:  # the interpreter rounds bf16 by truncation; fp16 as the GPU does
        for dtype in (torch.float32, torch.float16):
            check_embed_norms("cpu", dtype, *shape)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_embed_norms_match_float64_in_interpreter():
    INTERPRETED.check()


def test_embed_norms_reject_bad_shapes():
    from inkwell.kernels.triton_embed import embed_norms

    ids, table, norm = torch.zeros(4, dtype=torch.long), torch.zeros(10, 8), torch.ones(8)
    with pytest.raises(ValueError, match="ids \\[T\\]"):
        embed_norms(ids[None], table, norm, norm, EPS)
    with pytest.raises(ValueError, match="unit last stride"):
        embed_norms(ids, torch.zeros(8, 10).t(), norm, norm, EPS)
    with pytest.raises(ValueError, match="weights must be \\[8\\]"):
        embed_norms(ids, table, torch.ones(7), norm, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_embed_norms_on_gpu(dtype, shape):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_embed_norms("cuda", dtype, *shape)
