"""Seeds: every 64-bit seed a request may carry gives each choice its own generator, repeatably, and one that no
64-bit reading allows is refused where the request is checked (never inside the worker, which it would kill)."""

import pytest
from pydantic import ValidationError

from inkwell.service.openai_protocol import CompletionRequest
from inkwell.serving.contract import EngineConfig, Request, SamplingError, SamplingParams, generate
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.sampling import make_generator

SEEDS = [0, 7, 18446744073709551, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_64_bit_seed_seeds_16_distinct_generators(seed):
    params = SamplingParams(seed=seed, n=16)
    params.validate()
    seeds = [params.choice_seed(i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)  # SGLang's sampling_seed is an i64
    draws = [make_generator(s).initial_seed() for s in seeds]
    assert draws == seeds and seeds == [params.choice_seed(i) for i in range(16)]


def test_seeds_that_fit_keep_their_draws():
    """Seeds whose mix already fit keep the generators (and so the tokens) they had."""
    assert [SamplingParams(seed=42).choice_seed(i) for i in range(3)] == [42 * 1009, 42 * 1009 + 1, 42 * 1009 + 2]
    assert SamplingParams().choice_seed(0) is None


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, "7", True])
def test_seeds_beyond_64_bits_are_sampling_errors(seed):
    with pytest.raises(SamplingError) as err:
        SamplingParams(seed=seed).validate()
    assert err.value.param == "seed"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, "7", True, [1]])
def test_the_wire_refuses_seeds_beyond_64_bits(seed):
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": seed})
    assert err.value.errors()[0]["loc"] == ("seed",)


@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1, -(2**63)])
def test_the_wire_takes_every_64_bit_seed(seed):
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": seed}).sampling(4, None).seed == seed


def test_the_engine_samples_a_huge_seed_repeatably_and_per_choice(tiny_model_dir):
    engine = Engine(tiny_model_dir, EngineConfig(max_batch_tokens=64))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=18446744073709551, n=3, ignore_eos=True)
    one, two = (generate(engine, [Request("r", list(range(10, 20)), params)])["r"] for _ in range(2))
    assert [c.token_ids for c in one] == [c.token_ids for c in two]
    assert len({tuple(c.token_ids) for c in one}) == 3
