"""The Triton multi-LoRA kernels against their pure-torch twins, run by Triton's CPU interpreter.

Triton picks interpreter or compiler when a kernel is defined, so the kernels run in a child
process started with TRITON_INTERPRET=1; the checks themselves (`lora_checks.check_*`, shared with
the GPU tests) compare every op with the torch twins computed in float64 on the same inputs.
"""

import os

import pytest
import torch

from inkwell.kernels import dispatch
from tests.kernels.helpers import ChildRun
from tests.kernels.lora_checks import (
    check_expand_walk,
    check_experts,
    check_linear,
    check_plain_linear,
    check_projection,
    check_sliced,
)

INTERPRETED = ChildRun.interpreted("tests.kernels.test_triton_interpret")


def run_interpreted_cases() -> None:
    """Small shapes that still cross every tile edge: several token tiles, rank tiles, K and N tails."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from inkwell.kernels.triton_lora import dense, expand, expert

    dev, expert_dev = dict(ops=dense, device="cpu"), dict(ops=expert, device="cpu")
    for dtype in (torch.float32, torch.float16):
        check_linear(**dev, dtype=dtype, tokens=5, num_slots=3, used=2, rank=8, k=40, n=24)
        check_linear(**dev, dtype=dtype, tokens=70, num_slots=4, used=3, rank=16, k=72, n=130)
        check_linear(**dev, dtype=dtype, tokens=260, num_slots=3, used=3, rank=8, k=24, n=40)  # slot loop
        # decode sizes: the shrink's K loop split over 2-3 programs, the last of which sums their partials
        check_linear(**dev, dtype=dtype, tokens=9, num_slots=4, used=3, rank=8, k=300, n=24)
        check_sliced(**dev, dtype=dtype, tokens=9, num_slots=3, rank=8, k=32, offsets=(0, 20, 36, 52, 60))
        check_sliced(**dev, dtype=dtype, tokens=66, num_slots=2, rank=16, k=48, offsets=(0, 80, 160))
        # the slot walk (prefill) over column tiles that straddle slices
        check_sliced(**dev, dtype=dtype, tokens=270, num_slots=3, rank=8, k=32, offsets=(0, 20, 36, 52, 60))
        check_sliced(**dev, dtype=dtype, tokens=260, num_slots=2, rank=16, k=48, offsets=(0, 80, 160))
        # decode sizes, each slot's programs and the walk over a tile's slots alike: 2 token tiles of mixed slots
        check_expand_walk(expand, "cpu", dtype, tokens=70, num_slots=4, rank=8, offsets=(0, 20, 36, 52, 60))
        check_expand_walk(expand, "cpu", dtype, tokens=70, num_slots=3, rank=16, offsets=(0, 130))
        check_projection(**dev, dtype=dtype, tokens=5, num_slots=3, rank=8, k=40, offsets=(0, 20, 36, 52, 60))
        check_projection(**dev, dtype=dtype, tokens=20, num_slots=4, rank=24, k=300, offsets=(0, 70))  # 2 K tiles
        # slices on tile edges (one rank block of y per tile), then a rank past the early-loaded block of B
        check_projection(**dev, dtype=dtype, tokens=7, num_slots=3, rank=16, k=40, offsets=(0, 32, 64, 96, 150))
        check_projection(**dev, dtype=dtype, tokens=6, num_slots=2, rank=40, k=40, offsets=(0, 64, 96))
        check_plain_linear(**dev, dtype=dtype, tokens=5, k=300, n=40)  # the decode GEMM alone: K and N tails
        check_plain_linear(**dev, dtype=dtype, tokens=33, k=40, n=18)
        # past 64 tokens the one-GEMM projection runs two token tiles, the second one partial
        check_projection(**dev, dtype=dtype, tokens=100, num_slots=3, rank=16, k=40, offsets=(0, 32, 64, 96, 150))
        check_projection(**dev, dtype=dtype, tokens=90, num_slots=4, rank=8, k=40, offsets=(0, 20, 36, 52, 60))
        check_plain_linear(**dev, dtype=dtype, tokens=100, k=40, n=40)
        # slices on the 64-column tiles' edges past 64 tokens (the interpreter counts one SM), rank past one B block
        check_projection(**dev, dtype=dtype, tokens=80, num_slots=3, rank=12, k=40, offsets=(0, 64, 128, 150))
        for covered in ("both", "routed", "shared"):
            check_experts(
                **expert_dev, dtype=dtype, rows=37, num_slots=3, experts=5, rank=8, k=24, n=40, covered=covered
            )
        check_experts(**expert_dev, dtype=dtype, rows=260, num_slots=3, experts=3, rank=8, k=24, n=40)  # slot loop
    check_linear(**dev, dtype=torch.float32, tokens=20, num_slots=2, used=2, rank=80, k=16, n=16)  # 2 rank tiles
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_triton_kernels_match_torch_twins_in_interpreter():
    INTERPRETED.check()


def test_dispatch_torch_path_of_sliced_and_fused_ops():
    """On CPU tensors dispatch runs the torch twins; the sliced and fused ops compose them per slice."""
    check_linear(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, used=2, rank=8, k=16, n=12)
    check_sliced(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, rank=4, k=16, offsets=(0, 8, 12, 16, 20))
    check_projection(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, rank=4, k=16, offsets=(0, 8, 12, 16, 20))
    for covered in ("both", "routed", "shared"):
        check_experts(dispatch, "cpu", torch.float32, 11, num_slots=3, experts=4, rank=4, k=8, n=12, covered=covered)


def test_triton_launchers_reject_bad_shapes():
    from inkwell.kernels.triton_lora import dense

    x, slots = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    bad = [
        (lambda: dense.lora_shrink(x, torch.zeros(2, 4, 9), slots), "K=9"),
        (lambda: dense.lora_shrink(x, torch.zeros(2, 4, 8), slots[:3]), "token_slots"),
        (
            lambda: dense.lora_expand_sliced(
                torch.zeros(4, 6), torch.zeros(2, 6, 4), slots, torch.ones(2), torch.zeros(4, 6), (0, 4, 6)
            ),
            "columns",
        ),
        (
            lambda: dense.lora_expand(torch.zeros(4, 4), torch.zeros(2, 6, 4), slots, torch.ones(3), x),
            "out must be",
        ),
        (
            lambda: dense.lora_expand(torch.zeros(4, 4), torch.zeros(2, 6, 4), slots, torch.ones(3), x[:, :6]),
            "scalings",
        ),
        (
            lambda: dense.lora_expand_sliced(
                torch.zeros(4, 8), torch.zeros(2, 6, 4), slots, torch.ones(2), x[:, :6], (0, 5, 4, 6)
            ),
            "increase",
        ),
        (
            lambda: dense.lora_linear(x, torch.zeros(6, 9), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), slots, x),
            "K=8",
        ),
        (
            lambda: dense.lora_linear(
                x, torch.zeros(6, 8), torch.zeros(2, 4, 8), torch.zeros(2, 5, 4), slots, torch.ones(2)
            ),
            "N=5",
        ),
        (
            lambda: dense.lora_linear(
                x, torch.zeros(6, 8), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), slots, torch.ones(2), (0, 3, 6)
            ),
            "[S, 2*R, K]",
        ),
    ]
    for call, words in bad:
        try:
            call()
        except ValueError as err:
            assert words in str(err), str(err)
        else:
            raise AssertionError("bad shapes were accepted")


@pytest.mark.parametrize(
    "slots",
    [torch.zeros(5, 4, dtype=torch.long)[:, 3], torch.zeros(1, dtype=torch.long).expand(5)],
    ids=["table_column", "broadcast"],
)
def test_strided_token_slots_are_refused_on_every_device(slots):
    """The kernels read slots with stride 1: a column of a packed table or a broadcast slot would be misread on the
    GPU, so every device refuses them (the CPU tests then catch what the GPU would misread)."""
    with pytest.raises(ValueError, match="token_slots must be contiguous"):
        dispatch.lora_shrink(torch.zeros(5, 8), torch.zeros(2, 4, 8), slots)
    with pytest.raises(ValueError, match="token_slots must be contiguous"):
        dispatch.lora_linear(
            torch.zeros(5, 8), torch.zeros(6, 8), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), slots, torch.ones(2)
        )
