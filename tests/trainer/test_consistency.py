"""The consistency metrics by hand: KL(sampler ‖ trainer) by k1 and k3, |Δlogprob| and the ratio's clip fraction
over the sampled tokens (the positions with a sampler logprob or an advantage, not the prompt's)."""

import math

import pytest
import torch

from inkwell.trainer.consistency import METRICS, RATIO_BOUNDS, consistency_metrics, ratio_bounds
from inkwell.trainer.losses import LOSSES


def test_the_metrics_count_the_sampled_tokens_only():
    trainer = [[-1.0, -2.0, -0.5], [-3.0, -1.2, -0.9]]
    # the first position of each datum is the prompt's (logprob 0, advantage 0); the second datum's group had
    # equal rewards (advantage 0), its tokens are sampled all the same
    sampler = [torch.tensor([0.0, -2.1, -0.3]), torch.tensor([0.0, -1.0, -1.0])]
    advantages = [torch.tensor([0.0, 1.0, -2.0]), torch.tensor([0.0, 0.0, 0.0])]
    got = consistency_metrics(trainer, sampler, advantages)
    log_r = [0.1, -0.2, -0.2, 0.1]  # log p - log q at the four sampled tokens
    assert list(got) == list(METRICS)
    assert got["kl_k1:mean"] == pytest.approx(-sum(log_r) / 4)
    assert got["kl_k3:mean"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / 4)
    assert got["logprob_diff:mean"] == pytest.approx(0.15) and got["logprob_diff:max"] == pytest.approx(0.2)
    # r = exp(-0.2) = 0.819 and exp(0.1) = 1.105: inside [0.8, 1.2]; inside [0.9, 1.1] only for no token
    assert got["ratio_clip_fraction:mean"] == 0.0
    assert consistency_metrics(trainer, sampler, advantages, (0.9, 1.1))["ratio_clip_fraction:mean"] == 1.0
    assert consistency_metrics(trainer, sampler, advantages, (0.85, 1.2))["ratio_clip_fraction:mean"] == 0.5


def test_a_sampled_token_of_probability_one_counts_where_it_has_an_advantage():
    got = consistency_metrics([[-0.5, -0.25]], [torch.tensor([0.0, 0.0])], [torch.tensor([0.0, 1.0])])
    assert got["kl_k1:mean"] == pytest.approx(0.25) and got["ratio_clip_fraction:mean"] == 1.0  # r = 0.78


def test_no_sampled_token_gives_zeros():
    got = consistency_metrics([[-1.0]], [torch.tensor([0.0])], [torch.tensor([0.0])])
    assert got == dict.fromkeys(METRICS, 0.0)


def test_the_ratio_bounds_are_ppos_own_and_epsilon_0_2_otherwise():
    assert ratio_bounds("ppo", LOSSES["ppo"].defaults) == (0.8, 1.2) == RATIO_BOUNDS
    assert ratio_bounds("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}) == (0.9, 1.3)
    for loss in ("importance_sampling", "cispo", "dro"):
        assert ratio_bounds(loss, LOSSES[loss].defaults) == RATIO_BOUNDS
