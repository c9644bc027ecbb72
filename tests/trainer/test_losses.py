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


def gspo_rows(token_ratio, mask, advantages, valid, config=None):
    """(loss, d loss / d log p [rows, places], metrics) of gspo on rows of datums (one datum per row)."""
    loss = LOSSES["gspo"]
    logp = torch.full(token_ratio.shape, 0.5).log().requires_grad_(True)
    inputs = {
        "target_tokens": torch.zeros(token_ratio.shape, dtype=torch.long),
        "logprobs": logp.detach() - token_ratio.log(),
        "advantages": advantages,
        "sequence_ratio_mask": mask,
    }
    sums = loss.sums(logp, inputs, {**loss.defaults, **(config or {})}, valid)
    sums["loss"].backward()
    return sums["loss"].item(), logp.grad, metrics({k: v.item() for k, v in sums.items()})


def test_gspo_takes_one_ratio_per_datum_over_its_marked_tokens_and_clips_whole_sequences():
    """Row 0: a prompt token (unmarked, ratio 9) then three sampled tokens with ratios 1.5, 1.2, 1: s = 1.8^(1/3),
    above the default bound 1.0004 with A = +2, so the whole sequence is clipped (no gradient). Row 1: two marked
    tokens (1.1, 1) and two padding places (ratio 5): s = 1.1^(1/2) with A = -1, not clipped: each token's gradient
    is -s A, whatever its own ratio."""
    token_ratio = torch.tensor([[9.0, 1.5, 1.2, 1.0], [1.1, 1.0, 5.0, 5.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    advantages = torch.tensor([[0.0, 2.0, 2.0, 2.0], [-1.0, -1.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    s0, s1 = 1.8 ** (1 / 3), 1.1**0.5
    value, grad, out = gspo_rows(token_ratio, mask, advantages, valid)
    close(value, -(3 * 2 * (1 + 4e-4)) + 2 * s1)
    close(grad.flatten().tolist(), [0.0] * 4 + [s1, s1, 0.0, 0.0])
    assert out["clip_fraction:mean"] == 1.0  # both sequences' ratios lie outside [0.9997, 1.0004]

    value, grad, out = gspo_rows(token_ratio, mask, advantages, valid, {"clip_high_threshold": 1.3})
    close(value, -(3 * 2 * s0) + 2 * s1)
    close(grad.flatten().tolist(), [0.0] + [-2 * s0] * 3 + [s1, s1, 0.0, 0.0])
    assert out["clip_fraction:mean"] == 0.0


def test_gspo_equals_tinkers_documented_implementation():
    """tinker-docs "GSPO": per datum, the masked tokens' mean log-ratio, each token carrying its value with its own
    log p's gradient, PPO's clipped objective summed; against ours on random rows, value and gradient."""
    torch.manual_seed(0)
    rows, places, low, high = 3, 7, 0.9, 1.15
    logq = -torch.rand(rows, places) * 3
    logp0 = logq + torch.randn(rows, places) * 0.2
    mask = (torch.rand(rows, places) < 0.7).float()
    mask[:, 0] = 1.0
    advantages = torch.randn(rows, places)
    want_grad, want = torch.zeros(rows, places), 0.0
    for r in range(rows):
        lp = logp0[r].clone().requires_grad_(True)
        log_ratio = (lp.detach() - logq[r])[mask[r] != 0].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped = torch.clamp(ratio, low, high)
        term = -torch.minimum(ratio * advantages[r], clipped * advantages[r]).sum()
        term.backward()
        want, want_grad[r] = want + term.item(), lp.grad
    loss, logp = LOSSES["gspo"], logp0.clone().requires_grad_(True)
    inputs = {"logprobs": logq, "advantages": advantages, "sequence_ratio_mask": mask}
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    sums = loss.sums(logp, inputs, config, torch.ones(rows, places, dtype=torch.bool))
    sums["loss"].backward()
    close(sums["loss"].item(), want)
    torch.testing.assert_close(logp.grad, want_grad)


def test_every_loss_declares_its_inputs_and_config():
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dro"}
    assert LOSSES["cross_entropy"].inputs == ("target_tokens", "weights")
    assert LOSSES["gspo"].inputs == ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
    assert LOSSES["gspo"].defaults == pytest.approx({"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004})
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert LOSSES[name].inputs == ("target_tokens", "logprobs", "advantages")
    assert LOSSES["ppo"].defaults == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSSES["cispo"].defaults == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert set(LOSSES["dro"].defaults) == {"beta"}
