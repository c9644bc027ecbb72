"""The context-length refusal names the field at fault and the largest value that would fit."""

import pytest

from inkwell.serving.contract import EngineError, SamplingParams
from inkwell.serving.rules import check_prompt


@pytest.mark.parametrize(
    "prompt_len,max_tokens,param,fix",
    [
        (100, 40, "max_tokens", "lower max_tokens to at most 28"),
        (127, 5, "max_tokens", "lower max_tokens to at most 1"),
        (128, 1, "prompt", "shorten the prompt to at most 127 tokens"),  # max_tokens is already the least
        (130, None, "prompt", "shorten the prompt to at most 127 tokens"),
        (129, 0, "prompt", "shorten the prompt to at most 128 tokens"),  # scoring: no token to generate
    ],
)
def test_context_length_refusal_names_what_would_fit(prompt_len, max_tokens, param, fix):
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=max_tokens == 0)
    with pytest.raises(EngineError) as err:
        check_prompt([1] * prompt_len, params, vocab=10, max_context=128)
    assert err.value.code == "context_length_exceeded" and err.value.param == param
    assert fix in str(err.value), str(err.value)


@pytest.mark.parametrize("prompt_len,max_tokens", [(100, 28), (127, None), (128, 0)])
def test_requests_that_fit_pass(prompt_len, max_tokens):
    check_prompt([1] * prompt_len, SamplingParams(max_tokens=max_tokens, prompt_logprobs=max_tokens == 0), 10, 128)
