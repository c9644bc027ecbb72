"""The fused decode ShortConv step (`triton_short_conv`) against a float64 reference: conv over the saved taps and
the new input, the state shifted by one, and with a residual the add and RMSNorm. Run by Triton's CPU interpreter
in a child process, and compiled on the GPU at inkling-small's widths (marked gpu)."""

import os

import pytest
import torch

from tests.kernels.helpers import assert_close, run_in_interpreter


def reference(x, state, seq_slots, weight, residual, norm_weight, eps):
    """float64: (conv + x, or (h + it, RMSNorm(h + it)) when a residual is given; the rows' new state)."""
    xd = x.double()
    window = torch.cat([state[seq_slots].double(), xd[:, :, None]], dim=-1)  # [B, C, kernel]
    y = (window * weight[:, 0].double()).sum(-1) + xd
    new_state = window[:, :, 1:].float()
    if residual is None:
        return y, new_state
    h = residual.double() + y
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    return (h, normed), new_state


def check_short_conv(device: str, dtype: torch.dtype, rows: int, channels: int, kernel: int, norm: bool) -> None:
    """Rows on distinct sequence slots of a pool with more slots (the others must stay untouched); x a column
    slice of a wider tensor and the state a channel slice of a wider buffer, as the engine passes them."""
    from inkwell.kernels.triton_short_conv import short_conv_step

    gen = torch.Generator().manual_seed(rows * 1000 + channels + kernel)
    wide = torch.randn(rows, channels + 24, generator=gen).to(dtype)
    x = wide[:, 8 : 8 + channels]
    pool = torch.randn(rows + 3, channels + 16, kernel - 1, generator=gen)
    state = pool[:, 16:]
    seq_slots = torch.randperm(rows + 3, generator=gen)[:rows]
    weight = (torch.randn(channels, 1, kernel, generator=gen) / kernel).to(dtype)
    residual = torch.randn(rows, channels, generator=gen).to(dtype) if norm else None
    norm_weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(dtype) if norm else None
    eps = 1e-6
    expected, expected_state = reference(x, state, seq_slots, weight, residual, norm_weight, eps)
    before = pool.clone()

    def dev(t):
        return None if t is None else t.to(device)

    d_pool, d_x = pool.to(device), dev(wide)[:, 8 : 8 + channels]
    got = short_conv_step(d_x, d_pool[:, 16:], dev(seq_slots), dev(weight), dev(residual), dev(norm_weight), eps)
    got_pool = d_pool.cpu()
    assert torch.equal(got_pool[seq_slots, 16:], expected_state), "the state is not the window shifted by one"
    others = torch.ones(rows + 3, dtype=torch.bool)
    others[seq_slots] = False
    assert torch.equal(got_pool[others], before[others]), "slots of no row changed"
    assert torch.equal(got_pool[:, :16], before[:, :16]), "channels outside the state slice changed"
    if norm:
        assert_close(got[0], expected[0], dtype, "residual + conv")
        assert_close(got[1], expected[1], dtype, "its RMSNorm")
        assert got[0].dtype == got[1].dtype == dtype
    else:
        assert_close(got, expected, dtype, "conv + x")
        assert got.dtype == dtype


CASES = [  # (rows, channels, kernel): channels off a power of two, kernels of 2-4 taps
    (3, 40, 4),
    (5, 64, 3),
    (2, 17, 2),
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16):  # the interpreter rounds bf16 by truncation, fp16 as the GPU
        for rows, channels, kernel in CASES:
            for norm in (False, True):
                check_short_conv("cpu", dtype, rows, channels, kernel, norm)
    print("interpreted cases passed")


def test_short_conv_step_matches_reference_in_interpreter():
    run_in_interpreter("tests.kernels.test_short_conv")


def test_short_conv_step_rejects_mismatched_state():
    from inkwell.kernels.triton_short_conv import short_conv_step

    x, weight = torch.zeros(2, 8), torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="state"):
        short_conv_step(x, torch.zeros(3, 8, 2), torch.arange(2), weight)
    with pytest.raises(ValueError, match="fp32"):
        short_conv_step(x, torch.zeros(3, 8, 3, dtype=torch.bfloat16), torch.arange(2), weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels,norm", [(2048, True), (2048, False), (1024, False)])
def test_short_conv_step_on_gpu(dtype, channels, norm):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_short_conv("cuda", dtype, 8, channels, 4, norm)
