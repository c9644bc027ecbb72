"""The step's last op (`triton_greedy`): the LM head's logits as fp32 and each row's greedy token in one kernel,
against `logits.float()` and torch's `argmax` exactly: ties (the first index wins), NaN (the first NaN wins), rows of
-inf, strided rows (a padded vocabulary cut to its real columns). Run by Triton's CPU interpreter in a child
process, and on the GPU (marked gpu)."""

import os

import pytest
import torch

from tests.kernels.helpers import ChildRun

INTERPRETED = ChildRun.interpreted("tests.kernels.test_greedy")


def cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits [N, V] whose argmax is easy to get wrong, one wide padded case among them."""
    gen = torch.Generator().manual_seed(7)
    tied = torch.randint(-3, 3, (6, 5000), generator=gen).to(dtype)  # many equal maxima in a row
    tied[2, 4999] = 9  # the max in the last column, past every block but the last
    tied[3, 0] = 9  # ... and in the first
    tied[4, 1000::1500] = 7  # equal maxima in several blocks and lanes
    special = torch.randn(5, 3000, generator=gen).to(dtype)
    special[0] = float("-inf")  # all -inf: index 0, as torch
    special[1, 17] = special[1, 2500] = float("nan")  # the first NaN wins over any number
    special[2, 5] = float("inf")
    special[3, 100] = special[3, 2999] = float("inf")
    special[4, 2047:2049] = 50  # a tie across a block boundary
    padded = torch.randn(3, 32256, generator=gen).to(dtype)[:, :32000]  # strided rows: the unpadded vocabulary
    return [tied, special, padded, torch.randn(1, 1, generator=gen).to(dtype)]


def check_logits_greedy(device: str, dtype: torch.dtype) -> None:
    from inkwell.kernels.triton_greedy import logits_greedy

    for logits in cases(dtype):
        scores, greedy = logits_greedy(logits.to(device))
        want = logits.float()
        assert scores.dtype == torch.float32 and scores.is_contiguous() and greedy.dtype == torch.long
        assert torch.equal(scores.cpu().nan_to_num(), want.nan_to_num()), "not logits.float()"
        assert torch.equal(greedy.cpu(), want.argmax(-1)), (greedy.cpu().tolist(), want.argmax(-1).tolist())


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # a cast to fp32 is exact from each
        check_logits_greedy("cpu", dtype)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_logits_greedy_matches_torch_in_interpreter():
    INTERPRETED.check()


def test_logits_greedy_rejects_bad_shapes():
    from inkwell.kernels.triton_greedy import logits_greedy

    with pytest.raises(ValueError, match="unit last stride"):
        logits_greedy(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="V > 0"):
        logits_greedy(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="logits \\[N, V\\]"):
        logits_greedy(torch.zeros(3))


def test_greedy_scores_on_the_cpu_are_the_cast_and_argmax():
    from inkwell.serving.native.sampling import greedy_scores

    logits = cases(torch.bfloat16)[0]
    scores, greedy = greedy_scores(logits)
    assert scores.dtype == torch.float32 and torch.equal(scores, logits.float())
    assert torch.equal(greedy, logits.float().argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logits_greedy_on_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_logits_greedy("cuda", dtype)
