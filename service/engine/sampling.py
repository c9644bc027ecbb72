"""Sampling parameters and next-token selection with a per-sequence generator.

Each sequence owns a CPU torch.Generator (seeded from the request's seed and its choice index) that gives
one uniform per token it draws; the draw itself runs on the logits' device, row by row, so a seeded
request draws the same tokens alone or in any batch, and its logits never need to reach the host.
Logprobs are those of the model's distribution (before temperature and top_p), as OpenAI reports.
"""

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling parameter outside its legal range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus the top k
    prompt_logprobs: bool = False
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs else 1):
            raise SamplingError(
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens} (0 only scores the prompt: echo with logprobs)",
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError("temperature", f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.n <= 16:
            raise SamplingError("n", f"n must be between 1 and 16, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise SamplingError("stop", "stop takes at most 4 non-empty strings")


def make_generator(seed: int | None, index: int) -> torch.Generator:
    """The CPU generator of choice `index` of a request: seeded if the request has a seed."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed * 1009 + index)
    return gen


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """One token per row of fp32 logits [n, V], drawn with the row's temperature (> 0) and top_p at its uniform
    u in [0, 1): in order of falling probability, the first token whose cumulative probability within the top_p
    prefix exceeds u times that prefix's total. Every op works row by row, so a row's token depends on its own
    logits and u alone, whatever else is in the batch; on the GPU nothing waits for the host."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = torch.where(before < top_p[:, None], sorted_probs, 0.0)  # the smallest prefix reaching top_p (>= 1)
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
