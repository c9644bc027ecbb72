"""How far the trainer's logprobs are from the sampler's on the sampled tokens: an RL step's consistency metrics.

For a sampled token, log q is the sampler's logprob (the datum's `logprobs` input), log p the trainer's and
r = p / q. The sampled tokens are those with a nonzero advantage, the tokens the losses learn from and the clip
fraction counts (a prompt position carries none). KL(sampler ‖ trainer) is estimated from the sampler's own draws
with Schulman's estimators, k1 = mean(log q - log p) (unbiased, either sign) and k3 = mean(r - 1 - log r)
(unbiased, never negative, lower variance); |log p - log q| is reported by its mean and its max. With routing
replay the two sides differ by rounding only; without it, a near-tie that the sampler routed one way and the
trainer the other shows up here.
"""

from collections.abc import Sequence

import torch

METRICS = ("kl_k1:mean", "kl_k3:mean", "logprob_diff:mean", "logprob_diff:max")


def consistency_metrics(
    trainer: Sequence[Sequence[float]], sampler: Sequence[torch.Tensor], advantages: Sequence[torch.Tensor]
) -> dict[str, float]:
    """The metrics over every datum's sampled tokens (all 0.0 when there are none): per datum the trainer's
    logprobs, the sampler's and the advantages, one per token."""
    log_p = torch.cat([torch.tensor(values, dtype=torch.float64) for values in trainer])
    sampled = torch.cat(list(advantages)) != 0
    diff = (log_p - torch.cat(list(sampler)).double())[sampled]  # log r
    if not len(diff):
        return dict.fromkeys(METRICS, 0.0)
    values = ((-diff).mean(), (torch.expm1(diff) - diff).mean(), diff.abs().mean(), diff.abs().max())
    return {name: value.item() for name, value in zip(METRICS, values, strict=True)}
