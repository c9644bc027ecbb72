"""The RMSNorm kernel (`triton_rms_norm`) against float64 and against the engine's torch ops: rows of a [T, D] stream
and the strided heads of a wider projection output, as the attention's q and k are. Run by Triton's CPU
interpreter in a child process, and compiled on the GPU at inkling-small's widths (marked gpu)."""

import os

import pytest
import torch

from tests.kernels.helpers import ChildRun, assert_close, rms_norm_f64

INTERPRETED = ChildRun.interpreted("tests.kernels.test_rms_norm")

EPS = 1e-6
# (tokens, heads, head dim): q and k heads of inkling-small, a whole 2,048-wide row, odd sizes that mask
SHAPES = ((37, 16, 128), (37, 4, 128), (9, 1, 2048), (5, 3, 24))


def check_rms_norm(device: str, dtype: torch.dtype, tokens: int, heads: int, dim: int) -> None:
    from inkwell.kernels.triton_rms_norm import rms_norm
    from inkwell.serving.native.model import rms_norm as torch_rms_norm

    gen = torch.Generator().manual_seed(tokens * heads + dim)
    wide = (3 * torch.randn(tokens, heads * dim + 40, generator=gen)).to(dtype)
    x, d_x = (w[:, 8 : 8 + heads * dim].view(tokens, heads, dim) for w in (wide, wide.to(device)))  # as q in qkvr
    if heads == 1:
        x, d_x = x[:, 0], d_x[:, 0]
    weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)
    xd = x.double()
    expected = rms_norm_f64(xd, weight, EPS)
    got = rms_norm(d_x, weight.to(device), EPS)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert_close(got.reshape(-1, dim), expected.reshape(-1, dim), dtype, "rms_norm")
    if device == "cuda" and dtype != torch.float32:  # where the torch ops round, but for a sum order's last bit
        twin = torch_rms_norm(x, weight, EPS)  # the torch ops, on the CPU
        assert float((got.cpu() == twin).double().mean()) >= 0.98, "not rounded where the torch ops round"


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for shape in SHAPES:  # the interpreter rounds bf16 by truncation; fp16 as the GPU does
        for dtype in (torch.float32, torch.float16):
            check_rms_norm("cpu", dtype, *shape)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_rms_norm_matches_float64_in_interpreter():
    INTERPRETED.check()


def test_rms_norm_rejects_bad_shapes():
    from inkwell.kernels.triton_rms_norm import rms_norm

    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(4, 8), torch.ones(7), EPS)
    with pytest.raises(ValueError, match="unit last stride"):
        rms_norm(torch.zeros(8, 4).t(), torch.ones(8), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_on_gpu(dtype, shape):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_rms_norm("cuda", dtype, *shape)
