"""Next-token selection on the device with a per-sequence generator.

Each sequence owns a CPU torch.Generator (seeded from the request's seed and its choice index) that gives
one uniform per token it draws; the draw itself runs on the logits' device, row by row, so a seeded
request draws at the same uniforms alone or in any batch, and its logits never need to reach the host. Its
tokens are the same where its logits are: the model's GEMMs may round a row differently as the batch around it
changes size, which can move a draw that sits near the boundary between two tokens.
"""

import torch


def make_generator(seed: int | None) -> torch.Generator:
    """A choice's CPU generator: seeded with `SamplingParams.choice_seed`, or at random for None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def greedy_scores(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's fp32 logits [N, V] and each row's greedy token (its argmax: the first of equal values) from the LM
    head's output [N, V]; on CUDA one Triton kernel (`kernels.triton_greedy`) in place of a cast and an argmax."""
    if logits.is_cuda:
        from inkwell.kernels.triton_greedy import logits_greedy

        return logits_greedy(logits)
    scores = logits.float()
    return scores, scores.argmax(-1)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """One token per row of fp32 logits [n, V], drawn with the row's temperature (at least GREEDY_TEMPERATURE, so
    that the logits divided by it stay finite), top_k and top_p at its uniform u in [0, 1): in order of falling
    probability, among the row's top_k tokens (`top_k` < 1: all), the first token whose cumulative probability
    within the top_p prefix exceeds u times that prefix's total. Every op works row by row, so a row's token
    depends on its own logits and u alone, whatever else is in the batch; on the GPU nothing waits for the host."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(logits.shape[-1], device=logits.device)
    in_top_k = (top_k[:, None] < 1) | (rank[None, :] < top_k[:, None])
    # the smallest prefix reaching top_p (>= 1 token), cut at top_k
    kept = torch.where((before < top_p[:, None]) & in_top_k, sorted_probs, 0.0)
    cdf = kept.cumsum(dim=-1)
    # u < 1 puts u * total below the total (fp32 rounds it down or to a neighbour), so the first cdf entry above it
    # is a kept token of non-zero probability: [cdf[i-1], cdf[i]) is token i's share of [0, total)
    pick = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    return order.gather(-1, pick)[:, 0]


def token_logprobs(log_probs: torch.Tensor, token: int, top: int | None) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the `top` most likely (token, logprob) pairs from log_softmax [V]."""
    chosen = float(log_probs[token])
    if not top:
        return chosen, []
    values, ids = torch.topk(log_probs, top)
    return chosen, list(zip(ids.tolist(), values.tolist(), strict=True))
