"""How far the trainer's logprobs are from the sampler's on the sampled tokens: an RL step's consistency metrics.

For a sampled token, log q is the sampler's logprob (the datum's `logprobs` input), log p the trainer's and
r = p / q. The sampled tokens are the completion's: the positions whose datum carries a sampler logprob or an
advantage. Tinker's RL datums (tinker-cookbook's, `inkwell.recipes.rl`'s) give the prompt's positions logprob 0 and
advantage 0 and drop the mask that says which is which, so a position with both 0 counts as a prompt position; a
sampled token looks like that only if the sampler gave it probability 1 to float precision and its group's rewards
were all equal. Counting the tokens with a nonzero advantage only would drop every token of such a group, and
those are sampled as much as any.

KL(sampler ‖ trainer) is estimated from the sampler's own draws with Schulman's estimators, k1 = mean(log q - log p)
(unbiased, either sign) and k3 = mean(r - 1 - log r) (unbiased, never negative, lower variance); |log p - log q| is
reported by its mean and its max, and `ratio_clip_fraction:mean` is the share of sampled tokens whose r lies outside
[low, high]: PPO's clip thresholds where the loss is `ppo` (its `loss_fn_config`), else [0.8, 1.2] (PPO's default,
epsilon 0.2 on each side; CISPO's thresholds cap a weight, 0 to 4 by default, and are no trust region). It is not
the loss's own `clip_fraction:mean`, which counts the tokens with a nonzero advantage (Tinker's definition). With
routing replay the two sides differ by rounding only; without it, a near-tie that the sampler routed one way and
the trainer the other shows up here.
"""

from collections.abc import Mapping, Sequence

import torch

from inkwell.trainer.losses import LOSSES

METRICS = ("kl_k1:mean", "kl_k3:mean", "logprob_diff:mean", "logprob_diff:max", "ratio_clip_fraction:mean")


def ratio_bounds(loss_fn: str, config: Mapping[str, float]) -> tuple[float, float]:
    """The bounds of r that `ratio_clip_fraction:mean` counts against for a call of `loss_fn` with `config` (its
    defaults filled in): the call's own clip thresholds for ppo, PPO's defaults for every other loss."""
    bounds = config if loss_fn == "ppo" else LOSSES["ppo"].defaults
    return bounds["clip_low_threshold"], bounds["clip_high_threshold"]


RATIO_BOUNDS = ratio_bounds("ppo", LOSSES["ppo"].defaults)  # what r is counted against for every loss but ppo


def consistency_metrics(
    trainer: Sequence[Sequence[float]],
    sampler: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    bounds: tuple[float, float] = RATIO_BOUNDS,
) -> dict[str, float]:
    """The metrics over every datum's sampled tokens (all 0.0 when there are none): per datum the trainer's
    logprobs, the sampler's and the advantages, one per token; `bounds` those of the ratio (`ratio_bounds`)."""
    log_p = torch.cat([torch.tensor(values, dtype=torch.float64) for values in trainer])
    log_q = torch.cat(list(sampler)).double()
    sampled = (log_q != 0) | (torch.cat(list(advantages)) != 0)
    diff = (log_p - log_q)[sampled]  # log r
    if not len(diff):
        return dict.fromkeys(METRICS, 0.0)
    ratio = torch.exp(diff)
    outside = ((ratio < bounds[0]) | (ratio > bounds[1])).double()
    values = (-diff.mean(), (torch.expm1(diff) - diff).mean(), diff.abs().mean(), diff.abs().max(), outside.mean())
    return {name: value.item() for name, value in zip(METRICS, values, strict=True)}
