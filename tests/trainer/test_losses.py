"""Tinker's losses on hand-computed tokens: each loss's value, its gradient per token (which tokens a clip
silences), its clip fraction, and that tokens outside the datum (padding) count for nothing."""

import math

import pytest
import torch

from inkwell.trainer.losses import LOSSES, metrics

# Five real tokens and one padding token (valid False) with values that would change every sum if it counted.
P = [0.5, 0.5, 0.4, 0.4, 0.25, 0.9]
RATIO = [1.5, 1.5, 0.5, 0.5, 1.0, 7.0]  # p / q per token
ADVANTAGES = [1.0, -1.0, -1.0, 1.0, 2.0, 3.0]
VALID = torch.tensor([True, True, True, True, True, False])


def run(name: str, config: dict | None = None, **extra) -> tuple[float, list[float], dict[str, float]]:
    """(loss, d loss / d log p per token, metrics) of loss `name` on the tokens above."""
    loss = LOSSES[name]
    logp = torch.tensor(P).log().requires_grad_(True)
    inputs = {
        "target_tokens": torch.zeros(6, dtype=torch.long),
        "logprobs": logp.detach() - torch.tensor(RATIO).log(),
        "advantages": torch.tensor(ADVANTAGES),
        **extra,
    }
    sums = loss.sums(logp, inputs, {**loss.defaults, **(config or {})}, VALID)
    sums["loss"].backward()
    return sums["loss"].item(), logp.grad.tolist(), metrics({k: v.item() for k, v in sums.items()})


def close(a, b):
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (a, b)


def test_cross_entropy_is_the_weighted_negative_log_likelihood():
    weights = [1.0, 0.0, 2.0, 0.5, 1.0, 9.0]
    value, grad, out = run("cross_entropy", weights=torch.tensor(weights))
    close(value, -sum(w * math.log(p) for w, p in zip(weights[:5], P[:5], strict=True)))
    close(grad, [-w for w in weights[:5]] + [0.0])
    assert out == {"loss:sum": pytest.approx(value)}


def test_importance_sampling_is_the_ratio_times_the_advantage():
    value, grad, _ = run("importance_sampling")
    close(value, -sum(r * a for r, a in zip(RATIO[:5], ADVANTAGES[:5], strict=True)))
    # d(-r A)/d log p = -r A: the REINFORCE gradient reweighted by the ratio
    close(grad, [-r * a for r, a in zip(RATIO[:5], ADVANTAGES[:5], strict=True)] + [0.0])


def test_ppo_clips_where_the_ratio_leaves_its_bounds():
    value, grad, out = run("ppo")  # bounds 0.8 and 1.2
    # r=1.5 A=+1: min(1.5, 1.2) -> clipped; r=1.5 A=-1: min(-1.5, -1.2) = -1.5 -> not; r=0.5 A=-1: min(-0.5, -0.8)
    # -> clipped; r=0.5 A=+1: min(0.5, 0.8) = 0.5 -> not; r=1 A=2: inside
    close(value, -(1.2 - 1.5 - 0.8 + 0.5 + 2.0))
    close(grad, [0.0, 1.5, 0.0, -0.5, -2.0, 0.0])
    assert out["clip_fraction:mean"] == pytest.approx(4 / 5)  # four of five advantaged tokens outside [0.8, 1.2]

    value, grad, out = run("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 1.6})
    close(value, -sum(r * a for r, a in zip(RATIO[:5], ADVANTAGES[:5], strict=True)))
    assert out["clip_fraction:mean"] == 0.0


def test_cispo_weights_the_log_likelihood_by_the_clipped_ratio_without_differentiating_it():
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    value, grad, out = run("cispo", config)
    clipped = [1.2, 1.2, 0.8, 0.8, 1.0]
    close(value, -sum(c * math.log(p) * a for c, p, a in zip(clipped, P, ADVANTAGES, strict=False)))
    # the coefficient is a constant: every token keeps a gradient, bounded by the clip
    close(grad, [-c * a for c, a in zip(clipped, ADVANTAGES, strict=False)] + [0.0])
    assert out["clip_fraction:mean"] == pytest.approx(4 / 5)
    # by default only the upper side is capped (at 4): none of these ratios is clipped
    _, grad, out = run("cispo")
    close(grad, [-r * a for r, a in zip(RATIO[:5], ADVANTAGES[:5], strict=True)] + [0.0])
    assert out["clip_fraction:mean"] == 0.0


def test_dro_penalises_the_squared_log_ratio():
    beta = 0.5
    value, grad, out = run("dro", {"beta": beta})
    log_ratio = [math.log(r) for r in RATIO[:5]]
    close(
        value,
        -sum(math.log(p) * a - 0.5 * beta * d**2 for p, a, d in zip(P, ADVANTAGES, log_ratio, strict=False)),
    )
    close(grad, [-(a - beta * d) for a, d in zip(ADVANTAGES, log_ratio, strict=False)] + [0.0])
    assert set(out) == {"loss:sum"}


def test_every_loss_declares_its_inputs_and_config():
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
    assert LOSSES["cross_entropy"].inputs == ("target_tokens", "weights")
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert LOSSES[name].inputs == ("target_tokens", "logprobs", "advantages")
    assert LOSSES["ppo"].defaults == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSSES["cispo"].defaults == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert set(LOSSES["dro"].defaults) == {"beta"}
