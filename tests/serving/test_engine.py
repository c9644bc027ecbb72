"""The native engine against transformers' Inkling, and its batching, slots, sampling and errors."""

import pytest
import torch
from transformers import InklingForCausalLM

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.merge import merge
from inkwell.adapters.spec import LoraSpec
from inkwell.models import (
    base_model_identity,
    installed_weight_names,
    load_base_config,
    load_base_model,
    load_base_weights,
)
from inkwell.models.base import BaseModelIdentity
from inkwell.serving.contract import (
    AdapterIncompatibleError,
    EngineConfig,
    EngineError,
    Request,
    SamplingError,
    SamplingParams,
)
from inkwell.serving.native.engine import Engine
from inkwell.serving.text import TextTracker
from tests.serving.conftest import with_step_graphs

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 40))  # 30 tokens: greedy decoding to 62 crosses the window (24) and rel_extent (48)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_adapters):
    eng = Engine(tiny_model_dir, EngineConfig(max_loras_per_batch=5, max_lora_rank=16, max_batch_tokens=40))
    for i, adapter in enumerate(tiny_adapters):
        eng.load_adapter(f"a{i}", adapter)
    return eng


def merged_model(model_dir, adapter) -> InklingForCausalLM:
    config = load_base_config(model_dir)
    config._attn_implementation = "eager"
    model = InklingForCausalLM(config)
    model.load_state_dict(installed_weight_names(merge(load_base_weights(model_dir), adapter, config), model))
    return model.eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by a full forward over the whole sequence each step (no cache to get wrong)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def reference_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return log_probs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_greedy_with_adapter_equals_transformers_merged_and_is_batch_invariant(engine, tiny_model_dir, tiny_adapters):
    alone = engine.generate([Request("x", PROMPT, GREEDY, "a0")])["x"][0]
    assert len(alone.token_ids) == 32 and alone.finish_reason == "length"
    assert alone.token_ids == reference_greedy(merged_model(tiny_model_dir, tiny_adapters[0]), PROMPT, 32)

    others = [Request(f"o{i}", list(range(20 + i, 45 + 4 * i)), GREEDY, f"a{i}") for i in range(1, 5)]
    mixed = engine.generate(
        [*others[:2], Request("x", PROMPT, GREEDY, "a0"), *others[2:], Request("b", PROMPT, GREEDY)]
    )
    assert mixed["x"][0].token_ids == alone.token_ids
    # The base request in the same batch is the plain model; the adapters really changed the output.
    assert mixed["b"][0].token_ids == reference_greedy(load_base_model(tiny_model_dir), PROMPT, 32)
    assert mixed["b"][0].token_ids != alone.token_ids
    assert mixed["o4"][0].token_ids == engine.generate([others[3]])["o4"][0].token_ids


@pytest.mark.parametrize("adapter_index", [None, 0])
def test_prompt_logprobs_match_transformers(engine, tiny_model_dir, tiny_adapters, adapter_index):
    """Past the sliding window (24) and the relative extent (48), with and without an adapter."""
    ids = [1] + [7 + (i * 37) % 250 for i in range(109)]  # 110 tokens, prefilled in 40-token chunks
    key = None if adapter_index is None else f"a{adapter_index}"
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=True, logprobs=2)  # score only
    choice = engine.generate([Request("p", ids, params, key)])["p"][0]
    got = choice.prompt_logprobs
    assert choice.token_ids == [] and choice.finish_reason == "length"
    assert choice.prompt_top_logprobs[0] == [] and all(len(t) == 2 for t in choice.prompt_top_logprobs[1:])
    model = load_base_model(tiny_model_dir) if key is None else merged_model(tiny_model_dir, tiny_adapters[0])
    assert got[0] is None and len(got) == len(ids)
    diff = (torch.tensor(got[1:]) - reference_prompt_logprobs(model, ids)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("groups,adapter_index", [(("experts",), 2), (("shared_experts", "lm_head"), 4)])
def test_engine_with_one_expert_group_equals_transformers_merged(tiny_model_dir, tiny_adapters, groups, adapter_index):
    """Slots over routed experts only (or shared experts only) cover part of the expert id space: the eager
    prefill and the bucketed decode (run eagerly on the CPU) must leave the other experts' rows alone."""
    eng = Engine(tiny_model_dir, EngineConfig(max_loras_per_batch=2, max_lora_rank=16, lora_groups=groups))
    with_step_graphs(eng)
    eng.load_adapter("a", tiny_adapters[adapter_index])
    got = eng.generate([Request("x", PROMPT, GREEDY, "a"), Request("b", PROMPT, GREEDY)])
    merged = merged_model(tiny_model_dir, tiny_adapters[adapter_index])
    assert got["x"][0].token_ids == reference_greedy(merged, PROMPT, 32)
    assert got["b"][0].token_ids == reference_greedy(load_base_model(tiny_model_dir), PROMPT, 32)


def test_decode_across_window_edge_matches_full_forward(tiny_model_dir):
    """Decoding one token at a time from a 20-token prompt to 64 tokens: ring cache and conv state."""
    eng = Engine(tiny_model_dir, EngineConfig(max_batch_tokens=8))
    prompt = [1] + list(range(50, 69))
    out = eng.generate(
        [Request("d", prompt, SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True, logprobs=0))]
    )
    choice = out["d"][0]
    ids = prompt + choice.token_ids
    ref = reference_prompt_logprobs(load_base_model(tiny_model_dir), ids)[len(prompt) - 1 :]
    got = torch.tensor([lp.logprob for lp in choice.logprobs])
    assert (got - ref).abs().max().item() < 1e-4


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = engine.generate([Request("s", PROMPT, params, "a1")])["s"][0].token_ids
    batch = engine.generate([Request("t", PROMPT[:9], GREEDY, "a2"), Request("s", PROMPT, params, "a1")])
    assert batch["s"][0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=43, ignore_eos=True)
    assert engine.generate([Request("s", PROMPT, other_seed, "a1")])["s"][0].token_ids != alone


def test_n_choices_logprobs_and_tiny_top_p(engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, n=3, seed=1, logprobs=3, ignore_eos=True)
    choices = engine.generate([Request("n", PROMPT, params, "a3")])["n"]
    greedy = engine.generate(
        [Request("g", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), "a3")]
    )
    assert [c.token_ids for c in choices] == [greedy["g"][0].token_ids] * 3  # top_p -> only the argmax survives
    for step in choices[0].logprobs:
        assert len(step.top) == 3 and step.top[0][0] == step.token_id
        assert step.logprob == pytest.approx(step.top[0][1]) and step.top[0][1] >= step.top[1][1] >= step.top[2][1]


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-7])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(engine, temperature):
    """Found by the API fuzz (tests/service/test_fuzz.py): temperature 5e-324 is 0 in fp32 and the logits divided
    by 1e-40 overflow it, so the draw was NaN, indexed past the vocabulary and killed the serving worker. Below
    GREEDY_TEMPERATURE (SGLang's own threshold) a request decodes greedily, as SGLang's engine does."""
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True)
    tiny = engine.generate([Request("t", PROMPT, params, "a1"), Request("g", PROMPT, GREEDY, "a1")])
    assert tiny["t"][0].token_ids == tiny["g"][0].token_ids[:6]


def test_stop_string_cuts_text_and_stop_token_ends(engine):
    full = engine.generate([Request("f", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))])[
        "f"
    ][0]
    assert len(full.text) >= 6
    stop = full.text[3:5]
    cut = engine.generate([Request("c", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))])["c"][0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    first = full.token_ids[2]
    by_id = engine.generate(
        [Request("i", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(first,)))]
    )
    assert by_id["i"][0].token_ids == full.token_ids[:3] and by_id["i"][0].finish_reason == "stop"


def test_slots_evict_least_recently_used_and_pins_stay(tiny_model_dir, tiny_adapters):
    short_greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(tiny_model_dir, EngineConfig(max_loras_per_batch=2, max_lora_rank=16))
    eng.load_adapter("pinned", tiny_adapters[3], pinned=True)
    eng.load_adapter("b", tiny_adapters[1])
    eng.load_adapter("c", tiny_adapters[2])
    short = SamplingParams(max_tokens=2, temperature=0.0)
    eng.generate([Request("1", PROMPT, short, "b")])
    assert set(eng.lora.resident()) == {"pinned", "b"}
    eng.generate([Request("2", PROMPT, short, "c")])
    assert set(eng.lora.resident()) == {"pinned", "c"}
    # Three adapters wanted at once with two slots: the third waits for a slot and still gets its own output.
    reqs = [Request(k, PROMPT, short_greedy, k) for k in ("b", "c")] + [Request("p", PROMPT, short_greedy, "pinned")]
    got = eng.generate(reqs)
    alone = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16))
    alone.load_adapter("b", tiny_adapters[1])
    assert got["b"][0].token_ids == alone.generate([Request("b", PROMPT, short_greedy, "b")])["b"][0].token_ids


def test_pinning_beyond_the_slots_is_refused_and_nothing_is_kept(tiny_model_dir, tiny_adapters):
    eng = Engine(tiny_model_dir, EngineConfig(max_loras_per_batch=1, max_lora_rank=16))
    eng.load_adapter("first", tiny_adapters[0], pinned=True)
    with pytest.raises(EngineError) as info:
        eng.load_adapter("second", tiny_adapters[1], pinned=True)
    assert info.value.code == "no_free_slot" and "max_loras_per_batch" in str(info.value)
    assert list(eng.adapters) == ["first"] and eng.lora.resident() == ["first"]
    eng.load_adapter("second", tiny_adapters[1])  # unpinned it waits for the slot instead


def test_new_version_is_a_new_key_and_running_requests_keep_theirs(engine, tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    v2 = init_adapter(config, LoraSpec(rank=8), base_model_identity(tiny_model_dir), seed=99, b_std=0.05)
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    old = engine.generate([Request("v1", PROMPT, short, "a1")])["v1"][0].token_ids
    engine.add_request(Request("v1-running", PROMPT, short, "a1"))
    outputs = engine.step()
    engine.load_adapter("a1@2", v2)
    engine.add_request(Request("v2", PROMPT, short, "a1@2"))
    while engine.has_work():
        outputs += engine.step()
    tokens = {rid: [t for o in outputs if o.request_id == rid for t in o.token_ids] for rid in ("v1-running", "v2")}
    assert tokens["v1-running"] == old
    assert len(tokens["v2"]) == 12 and tokens["v2"] != old
    engine.unload_adapter("a1@2")


def test_bad_requests_and_adapters_are_refused(engine, tiny_model_dir, tiny_adapters):
    with pytest.raises(EngineError, match="not loaded"):
        engine.add_request(Request("u", PROMPT, GREEDY, "nope"))
    with pytest.raises(EngineError, match="context") as err:
        engine.add_request(Request("l", [5] * 1020, SamplingParams(max_tokens=10)))
    assert err.value.param == "max_tokens"
    for bad, param in [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(logprobs=50), "logprobs"),
    ]:
        with pytest.raises(SamplingError) as err:
            engine.add_request(Request("b", PROMPT, bad))
        assert err.value.param == param
    config = load_base_config(tiny_model_dir)
    other_base = init_adapter(config, LoraSpec(rank=4), BaseModelIdentity("other", "0" * 64), seed=1)
    with pytest.raises(AdapterIncompatibleError, match="other"):
        engine.load_adapter("o", other_base)
    too_big = init_adapter(config, LoraSpec(rank=32), base_model_identity(tiny_model_dir), seed=1)
    with pytest.raises(AdapterIncompatibleError, match="max_lora_rank"):
        engine.load_adapter("big", too_big)
    assert not engine.has_work()


def test_streamed_text_never_shows_what_a_stop_string_removes(engine):
    """Fed one token at a time, the tracker holds back a possible stop prefix and partial UTF-8."""
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("caf\u00e9 is wonderful", add_special_tokens=False)
    tracker = TextTracker(tokenizer, ("wond",))
    shown, stopped = "", False
    for i in range(1, len(ids) + 1):
        delta, stopped = tracker.update(ids[:i], final=False)
        shown += delta
        assert "\ufffd" not in shown and "won" not in shown
        if stopped:
            break
    assert stopped and shown == "caf\u00e9 is "


def test_queueing_and_a_five_token_budget_still_match_full_forward(tiny_model_dir):
    """More requests than sequence slots, prefill chunked to 5 tokens per step shared with decodes,
    one-token prompts: every chosen token's logprob equals transformers' over the whole sequence."""
    eng = Engine(tiny_model_dir, EngineConfig(max_batch_tokens=5, max_seqs=3))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = {"a": [1], "b": [1, *range(5, 15)], "c": [1, 2], "d": [1] + [9] * 6}
    got = eng.generate([Request(k, p, params) for k, p in prompts.items()])
    model = load_base_model(tiny_model_dir)
    for key, prompt in prompts.items():
        choice = got[key][0]
        ids = prompt + choice.token_ids
        want = reference_prompt_logprobs(model, ids)[len(prompt) - 1 :]
        assert (torch.tensor([s.logprob for s in choice.logprobs]) - want).abs().max().item() < 1e-4, key


def test_host_copies_beyond_max_loaded_adapters_go_least_recently_used(tiny_model_dir, tiny_adapters):
    eng = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16, max_loaded_adapters=2))
    eng.load_adapter("a", tiny_adapters[1])
    eng.load_adapter("b", tiny_adapters[2])
    eng.generate([Request("r", PROMPT, SamplingParams(max_tokens=1), "a")])  # "a" is now the more recent
    eng.load_adapter("c", tiny_adapters[3])
    assert set(eng.adapters) == {"a", "c"}
    eng.load_adapter("p", tiny_adapters[4], pinned=True)
    eng.add_request(Request("busy", PROMPT, SamplingParams(max_tokens=1), "c"))  # queued: "c" stays
    with pytest.raises(EngineError, match="pinned or in use"):
        eng.load_adapter("d", tiny_adapters[0])
    assert set(eng.adapters) == {"c", "p"}


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_rows_are_grouped_by_adapter_slot(tiny_model_dir, tiny_adapters, overlap):
    """Requests arriving with their adapters interleaved decode in rows grouped by adapter slot (planned steps and
    the overlapped follow-ups alike), so a LoRA kernel's token tile holds few adapters; each request still gets
    the tokens it gets alone."""
    eng = Engine(tiny_model_dir, EngineConfig(max_lora_rank=16, max_loras_per_batch=3, overlap_decode=overlap))
    for i in range(2):
        eng.load_adapter(f"a{i}", tiny_adapters[i])
    adapters = ["a1", None, "a0", "a1", None, "a0"]
    requests = [Request(f"r{i}", list(range(10 + i, 20 + i)), GREEDY, key) for i, key in enumerate(adapters)]
    decode_slots: list[list[int]] = []
    launch = eng._launch

    def recording(chunks, ids, logit_rows):
        if all(c.length == 1 for c in chunks):
            decode_slots.append([c.seq.lora_slot for c in chunks])
        return launch(chunks, ids, logit_rows)

    eng._launch = recording
    together = eng.generate(requests)
    assert decode_slots and all(slots == sorted(slots) for slots in decode_slots), decode_slots
    assert len(set(decode_slots[0])) == 3  # base rows and both adapters' rows in one step
    for request in requests[:3]:
        assert together[request.request_id][0].token_ids == eng.generate([request])[request.request_id][0].token_ids
