"""Overlapped decode steps (`EngineConfig.overlap_decode`): the next greedy step is queued on the device before this
one's tokens reach the host, and every output is what synchronous steps give."""

import dataclasses

import pytest

from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Without the prefix cache: outputs are compared bit for bit, and a prompt prefix cached earlier in another batch
# (the two engines run different histories) differs from one computed in this batch by rounding.
CONFIG = EngineConfig(max_loras_per_batch=5, max_lora_rank=16, max_seqs=6, max_batch_tokens=48, prefix_cache=False)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters) -> tuple[Engine, Engine]:
    """(overlapped, synchronous) engines with the same five adapters."""
    pair = Engine(tiny_model_dir, CONFIG), Engine(tiny_model_dir, dataclasses.replace(CONFIG, overlap_decode=False))
    for engine in pair:
        for i, adapter in enumerate(tiny_adapters):
            engine.load_adapter(f"a{i}", adapter)
    return pair


def prompt(i: int) -> list[int]:
    return [1, *range(11 + 3 * i, 30 + 4 * i)]


def run(engine: Engine, requests: list[Request]) -> tuple[dict, int]:
    """Each request's outputs in order, and how many steps left the next one queued."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    queued = 0
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
        queued += engine._queued is not None
    return outputs, queued


def test_overlapped_steps_give_every_output_of_synchronous_steps(engines):
    """Greedy requests ending by length, by a stop token and by a stop string, n=2, with and without adapters:
    the same outputs step by step as synchronous decoding, and most steps overlapped."""
    overlapped, synchronous = engines
    plain = [Request(f"r{i}", prompt(i), GREEDY, f"a{i}" if i < 5 else None) for i in range(6)]
    tokens = {k: [t for o in v for t in o.token_ids] for k, v in run(synchronous, plain)[0].items()}
    stop_token = tokens["r1"][7]  # the eighth token of r1 ends it
    text = synchronous.tokenizer.decode(tokens["r3"])
    requests = [
        Request("length", prompt(0), dataclasses.replace(GREEDY, max_tokens=5), "a0"),
        Request("stop_token", prompt(1), dataclasses.replace(GREEDY, stop_token_ids=(stop_token,)), "a1"),
        Request("stop_string", prompt(3), dataclasses.replace(GREEDY, stop=(text[len(text) // 2 :][:2],)), "a3"),
        Request("choices", prompt(2), dataclasses.replace(GREEDY, n=2, max_tokens=17), "a2"),
        Request("base", prompt(5), GREEDY),
    ]
    expected, none_queued = run(synchronous, requests)
    got, queued = run(overlapped, requests)
    assert got == expected
    assert none_queued == 0 and queued >= 15
    assert expected["stop_token"][-1].finish_reason == "stop" and expected["stop_token"][-1].token_ids[-1] == stop_token
    assert expected["stop_string"][-1].finish_reason == "stop"
    assert [o.finish_reason for o in expected["length"]][-1] == "length"


def test_rows_that_report_logprobs_wait_for_their_logits_and_sampled_rows_overlap(engines):
    """A step with a row that reports logprobs brings its logits to the host before the next step is planned; rows
    that sample draw on the device and overlap like greedy ones. Every output is the synchronous one, seeded draws
    included."""
    overlapped, synchronous = engines
    requests = [
        Request("greedy", prompt(0), GREEDY, "a0"),
        Request("sampled", prompt(1), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=7), "a1"),
        Request("logprobs", prompt(2), dataclasses.replace(GREEDY, max_tokens=8, logprobs=3), "a2"),
    ]
    expected, _ = run(synchronous, requests)
    for request in requests:
        overlapped.add_request(request)
    got: dict[str, list] = {r.request_id: [] for r in requests}
    queued, ends = [], {}
    while overlapped.has_work():
        for out in overlapped.step():
            got[out.request_id].append(out)
            if out.finish_reason is not None:
                ends[out.request_id] = len(queued) + 1  # steps up to and including this one
        queued.append(overlapped._queued is not None)
    logprobs_end = ends["logprobs"]
    assert got == expected
    # nothing queued while the logprobs request ran; then every step but the last queued the next
    assert not any(queued[:logprobs_end]) and all(queued[logprobs_end:-1]) and not queued[-1]
    assert ends["sampled"] > logprobs_end + 1  # overlapped steps drew the sampled request's last tokens


def test_abort_and_a_new_request_while_a_step_is_queued(engines):
    """Aborting a request whose next step is already queued ends it with no more tokens; a request arriving then
    is admitted within two steps into the freed state slot and decodes as it does alone."""
    overlapped, _ = engines
    alone = run(overlapped, [Request("late", prompt(4), GREEDY, "a4")])[0]["late"]
    keep = run(overlapped, [Request("keep", prompt(0), GREEDY, "a0")])[0]["keep"]
    overlapped.add_request(Request("keep", prompt(0), GREEDY, "a0"))
    overlapped.add_request(Request("gone", prompt(1), GREEDY, "a1"))
    seen: dict[str, list] = {"keep": [], "gone": [], "late": []}
    for _ in range(4):
        for out in overlapped.step():
            seen[out.request_id].append(out)
    assert overlapped._queued is not None
    (aborted,) = overlapped.abort("gone")
    assert aborted.finish_reason == "abort"
    before_abort = len(seen["gone"])
    overlapped.add_request(Request("late", prompt(4), GREEDY, "a4"))
    steps_to_admit = 0
    while not overlapped.running or len(overlapped.running) < 2:
        steps_to_admit += 1
        for out in overlapped.step():
            seen[out.request_id].append(out)
    assert steps_to_admit <= 2
    while overlapped.has_work():
        for out in overlapped.step():
            seen[out.request_id].append(out)
    assert len(seen["gone"]) == before_abort  # nothing after the abort, though its next step was queued
    assert [t for o in seen["keep"] for t in o.token_ids] == [t for o in keep for t in o.token_ids]
    assert [t for o in seen["late"] for t in o.token_ids] == [t for o in alone for t in o.token_ids]
    assert overlapped.state.free_slots == overlapped.state.max_seqs and overlapped._queued is None


def test_a_request_arriving_while_steps_overlap_is_admitted_by_the_second_step(engines):
    overlapped, _ = engines
    alone = run(overlapped, [Request("late", prompt(4), GREEDY, "a4")])[0]["late"]
    overlapped.add_request(Request("first", prompt(0), GREEDY, "a0"))
    for _ in range(3):
        overlapped.step()
    assert overlapped._queued is not None
    overlapped.add_request(Request("late", prompt(4), GREEDY, "a4"))
    late = []
    for _ in range(2):
        late += [o for o in overlapped.step() if o.request_id == "late"]
    assert len(overlapped.running) == 2
    while overlapped.has_work():
        late += [o for o in overlapped.step() if o.request_id == "late"]
    assert [t for o in late for t in o.token_ids] == [t for o in alone for t in o.token_ids]


def test_a_request_waiting_for_an_adapter_slot_does_not_stop_the_overlap(tiny_model_dir, tiny_adapters):
    """With both adapter slots held by running requests, a request for a third adapter cannot be admitted: steps
    keep overlapping until a slot frees, then it is admitted and decodes as it does alone."""
    engine = Engine(tiny_model_dir, dataclasses.replace(CONFIG, max_loras_per_batch=2))
    for i, adapter in enumerate(tiny_adapters[:3]):
        engine.load_adapter(f"a{i}", adapter)
    alone = run(engine, [Request("late", prompt(2), GREEDY, "a2")])[0]["late"]
    short = dataclasses.replace(GREEDY, max_tokens=10)
    engine.add_request(Request("first", prompt(0), short, "a0"))
    engine.add_request(Request("second", prompt(1), GREEDY, "a1"))
    engine.add_request(Request("late", prompt(2), GREEDY, "a2"))
    late, queued = [], []
    while engine.has_work():
        late += [o for o in engine.step() if o.request_id == "late"]
        queued.append(engine._queued is not None)
        if len(queued) == 5:
            assert [s.request.request_id for s in engine.waiting] == ["late"]
    assert all(queued[2:8])  # "late" waits for a slot while the others' steps overlap
    assert [t for o in late for t in o.token_ids] == [t for o in alone for t in o.token_ids]
