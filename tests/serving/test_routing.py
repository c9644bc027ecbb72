"""Routing traces from the native engine (CPU): every generated token gets the routing of the forward that scored
it and the prompt its tokens 1..P-1, the same however the prompt is chunked and whether decode steps run eagerly
or through the bucketed decoder; engines that cannot record them refuse the request. That the traces are the
trainer's own routing of the same sequence, and that replaying them matters, is tests/trainer/test_replay.py."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from inkwell.models import load_base_config
from inkwell.models.routing import RoutingShape
from inkwell.serving.contract import Choice, EngineConfig, EngineError, Request, SamplingParams, StepOutput
from inkwell.serving.native.engine import Engine
from inkwell.serving.rules import check_routing
from inkwell.serving.sglang.engine import SglangEngine
from tests.serving.conftest import with_step_graphs

PROMPT = [1, *range(40, 60)]
TRACED = SamplingParams(max_tokens=9, temperature=1.0, seed=7, n=2, ignore_eos=True, return_routing=True)
WITH_PROMPT = replace(TRACED, prompt_routing=True)


def traced(engine: Engine, params: SamplingParams) -> list[Choice]:
    return engine.generate([Request("r", PROMPT, params, "a")])["r"]


def canonical(trace: np.ndarray) -> np.ndarray:
    """A trace with each position's ids in order (the top-k order is no part of a routing)."""
    return np.sort(trace, axis=-1)


@pytest.fixture(scope="module")
def shape(tiny_model_dir) -> RoutingShape:
    return RoutingShape.of(load_base_config(tiny_model_dir))


@pytest.fixture
def reference(tiny_model_dir, tiny_adapters) -> list[Choice]:
    """Traced choices of an engine that prefills the prompt in one step (on the conftest's one thread)."""
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16, max_batch_tokens=64))
    engine.load_adapter("a", tiny_adapters[0])
    return traced(engine, WITH_PROMPT)


def test_every_token_and_prompt_token_gets_its_routing(reference, shape):
    assert shape.moe_layers == (1, 2, 3) and shape.dtype == np.uint8
    for choice in reference:
        assert choice.routing.shape == (len(choice.token_ids), 3, shape.top_k) == (9, 3, 2)
        assert choice.routing.dtype == np.uint8
        assert (choice.routing < shape.experts).all() and (np.diff(canonical(choice.routing)) > 0).all()
    first, second = reference
    # one prompt, one routing: the first choice's (the second starts from its prompt state in the prefix cache)
    assert first.prompt_routing.shape == (len(PROMPT) - 1, 3, 2) and first.prompt_routing.dtype == np.uint8
    assert second.prompt_routing is None
    assert not np.array_equal(first.routing, second.routing)  # the choices drew apart


def test_chunked_prefill_and_the_bucketed_decoder_record_the_same_routing(tiny_model_dir, tiny_adapters, reference):
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16, max_batch_tokens=8))  # 3 prompt chunks
    with_step_graphs(engine)
    engine.load_adapter("a", tiny_adapters[0])
    got = traced(engine, WITH_PROMPT)
    for ours, theirs in zip(got, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert np.array_equal(canonical(ours.routing), canonical(theirs.routing))
    assert np.array_equal(canonical(got[0].prompt_routing), canonical(reference[0].prompt_routing))


def test_scoring_a_sequence_returns_its_prompt_routing_only(tiny_model_dir, tiny_adapters, reference):
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16))
    engine.load_adapter("a", tiny_adapters[0])
    full = PROMPT + reference[0].token_ids
    (scored,) = engine.generate([Request("s", full, SamplingParams(max_tokens=0, prompt_routing=True), "a")])["s"]
    assert scored.token_ids == [] and scored.routing is None and len(scored.prompt_routing) == len(full) - 1
    # what sampling recorded is the routing the whole sequence gets when it is scored
    expected = np.concatenate([reference[0].prompt_routing, reference[0].routing])
    assert np.array_equal(canonical(scored.prompt_routing), canonical(expected))
    untraced = engine.generate([Request("u", PROMPT, SamplingParams(max_tokens=3), "a")])["u"][0]
    assert untraced.routing is None and untraced.prompt_routing is None


def test_outputs_add_up_to_one_trace():
    choice = Choice()
    parts = [np.full((n, 3, 2), n, dtype=np.uint8) for n in (2, 0, 1)]
    for part in parts:
        choice.extend(StepOutput("r", 0, [0] * len(part), "", [], None, 3, 3, routing=part))
    assert np.array_equal(choice.routing, np.concatenate(parts))


def test_engines_that_cannot_record_routing_refuse_it(tiny_model_dir):
    for params in (SamplingParams(return_routing=True), SamplingParams(prompt_routing=True)):
        check_routing(params, "native")
        with pytest.raises(EngineError) as info:
            check_routing(params, "sglang")
        assert info.value.code == "routing_not_supported" and "sglang engine" in str(info.value)
    # the SGLang engine itself refuses before it starts a stream (its own checks need no SGLang)
    config = load_base_config(tiny_model_dir)
    engine = SimpleNamespace(adapters={}, model_config=config, max_context=1024, config=EngineConfig())
    with pytest.raises(EngineError) as info:
        SglangEngine.add_request(engine, Request("r", PROMPT, SamplingParams(return_routing=True)))
    assert (info.value.code, info.value.param) == ("routing_not_supported", "return_routing")
