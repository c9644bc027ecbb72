"""Every rule a training session's request must follow, each broken once: the DatumError names the field and the
datum, and says what to do."""

import math

import numpy as np
import pytest
import torch

from inkwell.models.routing import RoutingShape
from inkwell.trainer.datums import Datum, DatumError, check_request

VOCAB, CONTEXT = 50, 16
ROUTING = RoutingShape(moe_layers=(1, 3), top_k=2, experts=8)


def rl(n: int = 4, **change) -> Datum:
    inputs = {"target_tokens": [1] * n, "logprobs": [-0.5] * n, "advantages": [1.0] * n}
    return Datum([2] * n, {**inputs, **change})


def ce(n: int = 4, **change) -> Datum:
    return Datum([2] * n, {"target_tokens": [3] * n, "weights": [1.0] * n, **change})


def traced(trace, n: int = 4) -> Datum:
    return Datum([2] * n, rl(n).loss_fn_inputs, trace)


def trace(n: int = 4, ids=(0, 5)) -> list:
    return [[list(ids), [7, 1]] for _ in range(n)]


def check(data, loss_fn="importance_sampling", config=None):
    return check_request(data, loss_fn, config, VOCAB, CONTEXT, ROUTING)


def test_a_good_request_comes_back_as_tensors_of_one_length_per_datum():
    request = check([rl(3), rl(5, target_tokens=[4.0] * 5)], "ppo", {"clip_high_threshold": 1.3})
    assert request.loss.name == "ppo" and request.config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
    assert [len(t) for t in request.tokens] == [3, 5]
    assert request.inputs[1]["target_tokens"].tolist() == [4] * 5  # whole-number floats are token ids
    assert request.inputs[1]["target_tokens"].dtype.is_floating_point is False
    assert request.routing == [None, None]


def test_k_targets_per_token_come_back_as_n_by_k_tensors():
    request = check([ce(3, target_tokens=[[3, 4]] * 3, weights=[[0.75, 0.25]] * 3)] * 2, "cross_entropy")
    assert request.inputs[1]["target_tokens"].tolist() == [[3, 4]] * 3
    assert request.inputs[1]["target_tokens"].dtype == torch.long and request.inputs[0]["weights"].shape == (3, 2)


def test_routing_traces_come_back_as_long_tensors():
    request = check([traced(trace(3), 3), rl(), traced(np.array(trace(), dtype=np.uint8))])
    assert request.routing[0].tolist() == trace(3) and request.routing[0].dtype == torch.long
    assert request.routing[1] is None and request.routing[2].tolist() == trace()


def test_routing_traces_are_refused_where_the_model_is_not_known():
    with pytest.raises(DatumError, match=r"data\[0\]\.routing: routing traces are not taken here"):
        check_request([traced(trace())], "importance_sampling", None, VOCAB, CONTEXT)


BAD = [
    # (data, loss_fn, config, field, index, words in the message)
    ([], "cross_entropy", None, "data", None, "at least one"),
    ([ce(), Datum([], {"target_tokens": [], "weights": []})], "cross_entropy", None, "tokens", 1, "empty"),
    (
        [ce(), ce(), ce(), ce(9, weights=[1.0] * 7)],
        "cross_entropy",
        None,
        "loss_fn_inputs.weights",
        3,
        "7 values for 9",
    ),
    ([rl(advantages=[1.0] * 5)], "ppo", None, "loss_fn_inputs.advantages", 0, "5 values for 4"),
    ([ce(), Datum([2, 2], {"target_tokens": [3, 3]})], "cross_entropy", None, "loss_fn_inputs.weights", 1, "missing"),
    ([rl(mask=[1.0] * 4)], "importance_sampling", None, "loss_fn_inputs.mask", 0, "not an input"),
    ([ce(weights=[1.0] * 4, logprobs=[0.0] * 4)], "cross_entropy", None, "loss_fn_inputs.logprobs", 0, "not an input"),
    ([rl(target_tokens=[1, 2, VOCAB, 3])], "dro", None, "loss_fn_inputs.target_tokens", 0, "position 2"),
    ([rl(target_tokens=[1, -1, 1, 1])], "dro", None, "loss_fn_inputs.target_tokens", 0, "vocabulary"),
    ([rl(target_tokens=[1, 1.5, 1, 1])], "dro", None, "loss_fn_inputs.target_tokens", 0, "not a token id"),
    ([rl(), Datum([2, 99, 2, 2], rl().loss_fn_inputs)], "cispo", None, "tokens", 1, "vocabulary"),
    ([rl(logprobs=[0.0, math.nan, 0.0, 0.0])], "ppo", None, "loss_fn_inputs.logprobs", 0, "finite"),
    ([rl(advantages=[math.inf, 0.0, 0.0, 0.0])], "cispo", None, "loss_fn_inputs.advantages", 0, "finite"),
    ([ce(weights=[1.0, 1e39, 1.0, 1.0])], "cross_entropy", None, "loss_fn_inputs.weights", 0, "finite"),
    ([ce(weights=["a", 1.0, 1.0, 1.0])], "cross_entropy", None, "loss_fn_inputs.weights", 0, "numbers"),
    ([ce(weights=[[1.0]] * 4)], "cross_entropy", None, "loss_fn_inputs.weights", 0, "shaped unlike the others"),
    ([rl(advantages=[[1.0]] * 4)], "importance_sampling", None, "loss_fn_inputs.advantages", 0, "flat list"),
    ([ce(weights=[[[1.0]]] * 4)], "cross_entropy", None, "loss_fn_inputs.weights", 0, "K numbers per token"),
    (
        [ce(target_tokens=[[3, 4]] * 4, weights=[[1.0, 0.5, 0.5]] * 4)],
        "cross_entropy",
        None,
        "loss_fn_inputs.weights",
        0,
        "target_tokens [4, 2], weights [4, 3]",
    ),
    (
        [ce(target_tokens=[[3, 4]] * 4, weights=[[1.0, 0.5]] * 4), ce()],
        "cross_entropy",
        None,
        "loss_fn_inputs.target_tokens",
        1,
        "1 target(s) per token where data[0] has 2",
    ),
    (
        [ce(target_tokens=[[3, 4], [3, 4], [3, VOCAB], [3, 4]], weights=[[1.0, 0.5]] * 4)],
        "cross_entropy",
        None,
        "loss_fn_inputs.target_tokens",
        0,
        f"{VOCAB} at position 2, target 1 is not a token id",
    ),
    ([ce(), ce(CONTEXT + 1)], "cross_entropy", None, "tokens", 1, f"context ({CONTEXT}"),
    ([rl()], "ppo", {"clip_epsilon": 0.2}, "loss_fn_config.clip_epsilon", None, "clip_low_threshold"),
    ([ce()], "cross_entropy", {"beta": 0.1}, "loss_fn_config.beta", None, "no keys"),
    ([rl()], "ppo", {"clip_low_threshold": 1.3}, "loss_fn_config.clip_high_threshold", None, "below"),
    ([rl()], "cispo", {"clip_low_threshold": -0.1}, "loss_fn_config.clip_low_threshold", None, "negative"),
    ([rl()], "dro", {"beta": -1.0}, "loss_fn_config.beta", None, "negative"),
    ([rl()], "dro", {"beta": math.nan}, "loss_fn_config.beta", None, "finite"),
    ([rl()], "dro", {"beta": "big"}, "loss_fn_config.beta", None, "finite"),
    ([rl(), traced(trace(5))], "ppo", None, "routing", 1, "5 positions for 4 tokens"),
    ([traced(trace(3))], "ppo", None, "routing", 0, "3 positions for 4 tokens"),
    ([traced([[[0, 1]]] * 4)], "ppo", None, "routing", 0, "shaped [4, 1, 2]; must be expert ids shaped"),
    ([traced([[[0, 1, 2], [3, 4, 5]]] * 4)], "ppo", None, "routing", 0, "[4][2][2]"),
    ([traced(trace(ids=(0, 8)))], "ppo", None, "routing", 0, "8 at [0, 0, 1] is not a routed expert (0..7)"),
    ([traced(trace(ids=(-1, 2)))], "ppo", None, "routing", 0, "not a routed expert"),
    ([traced(trace(ids=(3, 3)))], "ppo", None, "routing", 0, "[0, 0] names one expert twice"),
    ([traced(trace(ids=(0.5, 3)))], "ppo", None, "routing", 0, "must be expert ids"),
    ([traced([[[0, 1], [2]]] * 4)], "ppo", None, "routing", 0, "must be expert ids"),
    ([traced(trace(ids=(0, 10**30)))], "ppo", None, "routing", 0, "must be expert ids"),
    ([rl()], "gspo", None, "loss_fn_inputs.sequence_ratio_mask", 0, "missing; gspo needs"),
    (
        [rl(sequence_ratio_mask=[0.0, 1.0, 1.0, 1.0]), rl(sequence_ratio_mask=[0.0] * 4)],
        "gspo",
        None,
        "loss_fn_inputs.sequence_ratio_mask",
        1,
        "marks no token",
    ),
    (
        [rl(sequence_ratio_mask=[1.0] * 4)],
        "gspo",
        {"clip_high_threshold": 0.5},
        "loss_fn_config.clip_high_threshold",
        None,
        "below",
    ),
]


@pytest.mark.parametrize("data,loss_fn,config,field,index,words", BAD)
def test_bad_requests_are_refused_with_field_and_datum(data, loss_fn, config, field, index, words):
    with pytest.raises(DatumError) as info:
        check(data, loss_fn, config)
    error = info.value
    assert (error.field, error.index) == (field, index), str(error)
    assert words in str(error)
    where = field if index is None else f"data[{index}].{field}"
    assert str(error) == f"{where}: {error.reason}"


@pytest.mark.parametrize("name", ["stable_reinforce", "custom", "Cross_Entropy", ""])
def test_losses_we_do_not_implement_are_refused_naming_those_we_do(name):
    with pytest.raises(DatumError) as info:
        check([rl()], name)
    assert info.value.field == "loss_fn" and info.value.index is None
    for supported in ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dro"):
        assert supported in str(info.value)
