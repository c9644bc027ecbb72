"""The consistency metrics by hand: KL(sampler ‖ trainer) by k1 and k3 and |Δlogprob| over the sampled tokens."""

import math

import pytest
import torch

from inkwell.trainer.consistency import METRICS, consistency_metrics


def test_the_metrics_count_the_tokens_with_an_advantage_only():
    trainer = [[-1.0, -2.0, -0.5], [-3.0, -3.0]]
    sampler = [torch.tensor([0.0, -2.1, -0.3]), torch.tensor([-1.0, -1.0])]
    advantages = [torch.tensor([0.0, 1.0, -2.0]), torch.tensor([0.0, 0.0])]  # the second datum: no sampled token
    got = consistency_metrics(trainer, sampler, advantages)
    log_r = [0.1, -0.2]  # log p - log q at the two sampled tokens
    assert got["kl_k1:mean"] == pytest.approx(0.05)
    assert got["kl_k3:mean"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / 2)
    assert got["logprob_diff:mean"] == pytest.approx(0.15) and got["logprob_diff:max"] == pytest.approx(0.2)
    assert got["kl_k3:mean"] > 0 and list(got) == list(METRICS)


def test_no_sampled_token_gives_zeros():
    got = consistency_metrics([[-1.0]], [torch.tensor([-2.0])], [torch.tensor([0.0])])
    assert got == dict.fromkeys(METRICS, 0.0)
