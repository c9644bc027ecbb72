"""Tinker's built-in losses, with Tinker's definitions (tinker-cookbook docs/losses.mdx and Tutorial 202).

Per token: log p is the trainer's log-probability of the target token (differentiable), log q the sampler's
(the `logprobs` input), A the `advantages` input and r = p / q = exp(log p - log q). Every loss is a SUM of
per-token terms over every token of every datum, with no normalisation the client did not build into its
weights or advantages. Clip thresholds bound the ratio itself (`clamp(r, clip_low_threshold,
clip_high_threshold)`), they are not epsilons: PPO's default 0.8 / 1.2 is epsilon = 0.2 on each side.

GSPO (Tinker's token-level variant, tinker-docs "GSPO") takes one ratio per datum: s = exp(mean of log p - log q
over the tokens its `sequence_ratio_mask` marks), and each token carries s's value with its own log p's gradient
(s_t = sg[s] p / sg[p]) in PPO's clipped objective, so a clip keeps or drops a whole sequence. Its default bounds are
the GSPO paper's (epsilon 3e-4 below and 4e-4 above: 0.9997 / 1.0004); Tinker's page states none.

`cross_entropy` also takes K targets per token (Tinker's top-K distillation): `target_tokens` and `weights` shaped
[N, K], the loss -sum of w[t, k] log p(target[t, k]), and the logprobs [N, K].

Metric keys are `name:reduction`, as Tinker's client merges them: `loss:sum` for every loss, and for the
clipping losses `clip_fraction:mean`, the share of tokens with a nonzero advantage whose ratio (GSPO: their
sequence's) lay outside the clip bounds.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

TARGETS = "target_tokens"  # the one integer input; every other input is a float per token
SEQUENCE_MASK = "sequence_ratio_mask"  # GSPO: the tokens a datum's sequence ratio is taken over (nonzero)

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _sequence_ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """Each datum's GSPO ratio s, detached, on every one of its tokens. The rows of `logp` are datums (the
    training core's rows of a session's request: one datum per row, then padding, whose mask is 0); a padding row
    marks nothing and gets s = 1, not a NaN that its zero gradient would still carry back."""
    marked = (inputs[SEQUENCE_MASK] != 0).to(logp.dtype)
    log_ratio = ((logp.detach() - inputs["logprobs"]) * marked).sum(-1, keepdim=True)
    return torch.exp(log_ratio / marked.sum(-1, keepdim=True).clamp(min=1)).expand_as(logp)


def _clipped(ratio: torch.Tensor, config: Config) -> torch.Tensor:
    return ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])


def _cross_entropy(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -inputs["weights"] * logp


def _importance_sampling(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -_ratio(logp, inputs) * inputs["advantages"]


def _ppo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio, advantages = _ratio(logp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * advantages, _clipped(ratio, config) * advantages)


def _gspo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio, advantages = _sequence_ratio(logp, inputs) * torch.exp(logp - logp.detach()), inputs["advantages"]
    return -torch.minimum(ratio * advantages, _clipped(ratio, config) * advantages)


def _cispo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -_clipped(_ratio(logp, inputs), config).detach() * logp * inputs["advantages"]


def _dro(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    penalty = 0.5 * config["beta"] * (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - penalty)


def _clip_problem(config: Config) -> tuple[str, str] | None:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if low < 0:
        return "clip_low_threshold", f"{low} is negative; it bounds the ratio p/q from below (PPO's default is 0.8)"
    if high < low:
        return "clip_high_threshold", f"{high} is below clip_low_threshold ({low}); the bounds are low <= high"
    return None


def _beta_problem(config: Config) -> tuple[str, str] | None:
    if config["beta"] < 0:
        return "beta", f"{config['beta']} is negative; the quadratic penalty's weight must be >= 0"
    return None


def _mask_problem(inputs: Inputs) -> tuple[str, str] | None:
    if not bool((inputs[SEQUENCE_MASK] != 0).any()):
        return SEQUENCE_MASK, "marks no token; mark the sampled tokens the sequence's ratio is taken over (nonzero)"
    return None


@dataclass(frozen=True)
class Loss:
    """One built-in loss: the datum inputs it needs, its config keys with their defaults, its per-token terms,
    the ratio its clip fraction counts (a clipping loss's), and what it refuses in a config or in one datum's
    inputs (the key and why). `per_target` names the inputs that may hold K values per token ([N, K], all of them
    alike), for K targets per position."""

    name: str
    inputs: tuple[str, ...]
    defaults: Mapping[str, float]
    terms: Callable[[torch.Tensor, Inputs, Config], torch.Tensor]
    config_problem: Callable[[Config], tuple[str, str] | None] = lambda config: None
    ratio: Callable[[torch.Tensor, Inputs], torch.Tensor] = _ratio
    datum_problem: Callable[[Inputs], tuple[str, str] | None] = lambda inputs: None
    per_target: tuple[str, ...] = ()

    def sums(self, logp: torch.Tensor, inputs: Inputs, config: Config, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """This batch's sums over its `valid` tokens (`logp` may have a trailing K: targets per token): `loss`
        (differentiable) and, for a clipping loss, the counts `clipped` and `advantaged` behind the clip fraction.
        Sums add up across batches and ranks."""
        valid = valid.reshape(*valid.shape, *[1] * (logp.dim() - valid.dim()))
        out = {"loss": torch.where(valid, self.terms(logp, inputs, config), 0.0).sum()}
        if "clip_low_threshold" in self.defaults:  # a clipping loss
            ratio = self.ratio(logp.detach(), inputs)
            outside = (ratio < config["clip_low_threshold"]) | (ratio > config["clip_high_threshold"])
            advantaged = valid & (inputs["advantages"] != 0)
            out["clipped"] = (advantaged & outside).sum()
            out["advantaged"] = advantaged.sum()
        return out


def metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Tinker's `name:reduction` metrics of a call's summed `Loss.sums`."""
    out = {"loss:sum": sums["loss"]}
    if "clipped" in sums:
        out["clip_fraction:mean"] = sums["clipped"] / sums["advantaged"] if sums["advantaged"] else 0.0
    return out


_RL_INPUTS = (TARGETS, "logprobs", "advantages")


def _clip(low: float, high: float) -> dict[str, float]:
    return {"clip_low_threshold": low, "clip_high_threshold": high}


LOSSES: dict[str, Loss] = {
    loss.name: loss
    for loss in (
        Loss("cross_entropy", (TARGETS, "weights"), {}, _cross_entropy, per_target=(TARGETS, "weights")),
        Loss("importance_sampling", _RL_INPUTS, {}, _importance_sampling),
        Loss("ppo", _RL_INPUTS, _clip(0.8, 1.2), _ppo, _clip_problem),
        Loss(
            "gspo",
            (*_RL_INPUTS, SEQUENCE_MASK),
            _clip(1 - 3e-4, 1 + 4e-4),
            _gspo,
            _clip_problem,
            _sequence_ratio,
            _mask_problem,
        ),
        # Tutorial 202: CISPO clips one side by default (no lower bound, the coefficient capped at 4)
        Loss("cispo", _RL_INPUTS, _clip(0.0, 4.0), _cispo, _clip_problem),
        # Tinker's docs give beta no default; 0.05 is the value they pass
        Loss("dro", _RL_INPUTS, {"beta": 0.05}, _dro, _beta_problem),
    )
}
CROSS_ENTROPY = LOSSES["cross_entropy"]
