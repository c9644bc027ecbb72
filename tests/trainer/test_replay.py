"""Routing replay through the training core (CPU, fp32): the native engine's traces are the trainer's own routing of
the sampled sequences, and fed back with the sampler's logprobs they keep KL(sampler ‖ trainer) at rounding level;
a trace that names other experts changes the logprobs and the true one restores them; a datum without a trace
routes itself beside one with; a trace of the wrong length is refused before anything is computed."""

import numpy as np
import pytest
import torch

from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.models.routing import RoutingShape
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.trainer.core import AdamParams, TrainingCore
from inkwell.trainer.datums import Datum, DatumError
from inkwell.trainer.parallel import model_parallel
from inkwell.trainer.replay import record_routing
from tests.trainer.conftest import ALL_GROUPS

SPEC = LoraSpec(rank=2, alpha=4, targets=ALL_GROUPS)
PROMPTS = [[1, *range(40, 46)], [1, *range(100, 119)]]
SAMPLED = SamplingParams(
    max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True, logprobs=0, return_routing=True, prompt_routing=True
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """inkling-tiny's ops are too small to split: a second thread only spins (tests/serving/conftest.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir), load_base_weights(tiny_model_dir)


def trained(base) -> TrainingCore:
    """A core one large step in, so that every LoRA factor (the experts' too) moves the logits; the same each time."""
    core = TrainingCore(*base, SPEC, seed=0)
    ids = torch.randint(3, 300, (2, 31), generator=torch.Generator().manual_seed(9)).tolist()
    data = [Datum(x[:-1], {"target_tokens": x[1:], "weights": [1.0] * 30}) for x in ids]
    core.forward_backward(data, "cross_entropy")
    core.optim_step(AdamParams(learning_rate=2e-2))
    return core


@pytest.fixture
def core(base, world_of_one) -> TrainingCore:
    return trained(base)


@pytest.fixture(scope="module")
def data(base, tiny_model_dir) -> list[Datum]:
    """The sampler's draws under the trained adapter as RL datums with their traces, Tinker's way: the prompt and
    the tokens but the last as input, the prompt's positions without advantage."""
    with model_parallel(tp=1, ep=1, device="cpu", seed=0):
        adapter = trained(base).adapter()
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16, max_batch_tokens=16))
    engine.load_adapter("a", adapter)
    outputs = engine.generate([Request(str(i), p, SAMPLED, "a") for i, p in enumerate(PROMPTS)])
    data = []
    for i, prompt in enumerate(PROMPTS):
        prompt_routing = outputs[str(i)][0].prompt_routing  # one prompt, one routing: the first choice's
        for choice in outputs[str(i)]:
            tokens, pad = choice.token_ids, [0.0] * (len(prompt) - 1)
            inputs = {
                "target_tokens": prompt[1:] + tokens,
                "logprobs": pad + [lp.logprob for lp in choice.logprobs],
                "advantages": pad + [1.0] * len(tokens),
            }
            data.append(Datum(prompt + tokens[:-1], inputs, np.concatenate([prompt_routing, choice.routing])))
    return data


def traced(data: list[Datum], traces: list) -> list[Datum]:
    return [Datum(d.tokens, d.loss_fn_inputs, t) for d, t in zip(data, traces, strict=True)]


def test_replayed_traces_keep_the_trainer_on_the_samplers_logprobs(core, data):
    with record_routing(core.model) as own:
        routed = core.forward(traced(data, [None] * len(data)), "ppo")
    # the engine's traces are the trainer's own routing of the same sequences (one row of 64 per datum)
    shape = RoutingShape.of(core.hf_config)
    for j, layer in enumerate(shape.moe_layers):
        rows = own[layer].view(len(data), -1, shape.top_k)
        for row, datum in zip(rows, data, strict=True):
            trainer = row[: len(datum.tokens)].sort(-1).values
            assert torch.equal(trainer, torch.as_tensor(datum.routing[:, j]).long().sort(-1).values)
    replayed = core.forward(data, "ppo")
    for result in (replayed, routed):
        metrics = result.metrics
        assert abs(metrics["kl_k1:mean"]) < 1e-4 and 0 <= metrics["kl_k3:mean"] < 1e-4, metrics
        assert metrics["logprob_diff:max"] < 1e-4 and metrics["clip_fraction:mean"] == 0.0, metrics
    assert replayed.logprobs == routed.logprobs  # the same experts: the same numbers


def test_replay_decides_the_experts_and_the_true_trace_restores_the_logprobs(core, data):
    true = core.forward(data, "ppo")
    experts = core.hf_config.n_routed_experts
    other = [(torch.as_tensor(d.routing).long() + 1) % experts for d in data]  # another expert at every slot
    forced = core.forward(traced(data, other[:1] + [None] * (len(data) - 1)), "ppo")
    assert max(abs(a - b) for a, b in zip(forced.logprobs[0], true.logprobs[0], strict=True)) > 1e-2
    assert forced.metrics["logprob_diff:max"] > 1e-2 and forced.metrics["kl_k3:mean"] > 1e-5
    assert forced.logprobs[1:] == true.logprobs[1:]  # datums without a trace route themselves beside it
    assert core.forward(data, "ppo").logprobs == true.logprobs
    # a forward_backward under the forced experts, then the true ones: gradients follow the replayed routing
    core.forward_backward(traced(data, other), "importance_sampling")
    forced_grads = [p.grad.clone() for p in core.params]
    core.optim_step(AdamParams(learning_rate=0.0))
    core.forward_backward(data, "importance_sampling")
    assert any(not torch.allclose(p.grad, g) for p, g in zip(core.params, forced_grads, strict=True))


def test_a_trace_of_the_wrong_length_is_refused_naming_the_datum(core, data):
    short = traced(data, [d.routing for d in data[:2]] + [data[2].routing[1:]] + [d.routing for d in data[3:]])
    with pytest.raises(DatumError) as info:
        core.forward_backward(short, "ppo")
    assert (info.value.field, info.value.index) == ("routing", 2)
    assert f"{len(data[2].tokens) - 1} positions for {len(data[2].tokens)} tokens" in str(info.value)
    assert all(p.grad is None for p in core.params)  # nothing was computed
