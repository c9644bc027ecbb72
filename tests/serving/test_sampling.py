"""`sample_rows`: temperature, top_k and top_p draws at given uniforms, row by row."""

import torch

from inkwell.serving.native.sampling import sample_rows


def draws(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor, top_k: int = -1
) -> torch.Tensor:
    """One row's tokens at each uniform, all rows in one batch."""
    n = uniforms.numel()
    rows = logits.expand(n, -1)
    return sample_rows(rows, torch.full((n,), temperature), torch.full((n,), top_p), torch.full((n,), top_k), uniforms)


def test_uniforms_on_a_grid_give_the_tempered_distribution():
    """Uniforms (i + 1/2) / N draw each token about N times its probability at that temperature."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2
    n = 20_000
    uniforms = (torch.arange(n) + 0.5) / n
    for temperature in (0.5, 1.0, 1.7):
        counts = torch.bincount(draws(logits, temperature, 1.0, uniforms), minlength=50)
        expected = torch.softmax(logits / temperature, dim=-1) * n
        assert (counts - expected).abs().max() <= 1.0


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])  # probabilities in order: token 1, 3, 2, 0, 4
    probs = torch.softmax(logits, dim=-1)
    prefix = probs[1] + probs[3]
    uniforms = (torch.arange(10_000) + 0.5) / 10_000
    drawn = draws(logits, 1.0, float(prefix) - 1e-4, uniforms)  # tokens 1 and 3 reach it
    assert set(drawn.tolist()) == {1, 3}
    share = (drawn == 1).float().mean()
    assert abs(float(share) - float(probs[1] / prefix)) < 1e-3
    assert set(draws(logits, 1.0, 1e-6, uniforms).tolist()) == {1}  # only the most likely token
    # u at the top of [0, 1) stays inside the kept prefix, even where u * total rounds up to the total
    assert draws(logits, 1.0, 0.5, torch.tensor([1.0 - 2**-24])).item() == 1
    assert draws(logits, 1.0, float(prefix) - 1e-4, torch.tensor([1.0 - 2**-24])).item() == 3


def test_top_k_keeps_the_k_most_likely_tokens_in_proportion():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])  # probabilities in order: token 1, 3, 2, 0, 4
    probs = torch.softmax(logits, dim=-1)
    uniforms = (torch.arange(10_000) + 0.5) / 10_000
    drawn = draws(logits, 1.0, 1.0, uniforms, top_k=3)
    assert set(drawn.tolist()) == {1, 3, 2}
    share = (drawn == 3).float().mean()
    assert abs(float(share) - float(probs[3] / (probs[1] + probs[3] + probs[2]))) < 1e-3
    assert set(draws(logits, 1.0, 1.0, uniforms, top_k=1).tolist()) == {1}  # top_k 1 is greedy
    assert set(draws(logits, 1.0, 1.0, uniforms, top_k=-1).tolist()) == {0, 1, 2, 3, 4}
    # the tighter of top_k and top_p wins
    assert set(draws(logits, 1.0, float(probs[1]) - 1e-4, uniforms, top_k=3).tolist()) == {1}


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen)
    temperature, top_p, uniforms = torch.rand(6, generator=gen) + 0.3, torch.rand(6, generator=gen), torch.rand(6)
    top_k = torch.tensor([-1.0, 1.0, 5.0, 50.0, 300.0, 1000.0])
    together = sample_rows(logits, temperature, top_p, top_k, uniforms)
    alone = [
        sample_rows(logits[i : i + 1], temperature[i : i + 1], top_p[i : i + 1], top_k[i : i + 1], uniforms[i : i + 1])
        for i in range(6)
    ]
    assert together.tolist() == torch.cat(alone).tolist()
    order = torch.randperm(6, generator=gen)
    assert (
        sample_rows(logits[order], temperature[order], top_p[order], top_k[order], uniforms[order]).tolist()
        == together[order].tolist()
    )
