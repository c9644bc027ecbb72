"""The native engine's prefix cache: with it, generation equals generation without it, prefixes never cross adapters,
eviction keeps within the budget, and prompts that share a prefix share its prefill.

inkling-tiny's sliding window is 24 tokens, its relative extent 48, its ShortConv keeps 3 inputs; the cache's blocks
are 16 tokens and the token budget of a step (40) is not a whole number of blocks, so the shared prefixes below cross
each of these."""

from dataclasses import replace

import numpy as np
import pytest

from inkwell.serving.contract import Choice, EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from tests.serving.conftest import with_step_graphs

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
# every prompt's last whole block cached, however short: the tests below cross block boundaries with short prompts
CONFIG = EngineConfig(max_lora_rank=16, max_batch_tokens=40, prefix_cache_min_gain=0)
SHARED_LENGTHS = (5, 16, 23, 25, 33, 49, 64)
BLOCK = CONFIG.prefix_cache_block


def cached_engine(model_dir, adapters, **config) -> Engine:
    engine = Engine(model_dir, replace(CONFIG, **config))
    for i, adapter in enumerate(adapters[:2]):
        engine.load_adapter(f"a{i}", adapter)
    return engine


@pytest.fixture(scope="module")
def uncached(tiny_model_dir, tiny_adapters) -> Engine:
    return cached_engine(tiny_model_dir, tiny_adapters, prefix_cache=False)


def run(engine: Engine, prompt: list[int], adapter: str | None = None, params: SamplingParams = GREEDY) -> Choice:
    return engine.generate([Request("r", prompt, params, adapter)])["r"][0]


def assert_same(ours: Choice, theirs: Choice) -> None:
    assert ours.token_ids == theirs.token_ids
    np.testing.assert_allclose(
        [t.logprob for t in ours.logprobs], [t.logprob for t in theirs.logprobs], rtol=0, atol=1e-5
    )


def generate_all(engine: Engine, prompts: list[list[int]], adapter: str | None) -> dict[tuple[int, ...], Choice]:
    """Each prompt's choice, all in one batch."""
    requests = [Request(str(i), prompt, GREEDY, adapter) for i, prompt in enumerate(prompts)]
    choices = engine.generate(requests)
    return {tuple(r.prompt_ids): choices[r.request_id][0] for r in requests}


def cached_by(engine: Engine, prompt: list[int], adapter: str | None = None, params: SamplingParams = GREEDY):
    """The prompt's choice and how many of its tokens came from the cache."""
    before = engine.prefix_cache.stats.cached_tokens
    choice = run(engine, prompt, adapter, params)
    return choice, engine.prefix_cache.stats.cached_tokens - before


def counted_rows(engine: Engine) -> list[int]:
    """A counter of the token rows the engine's (real) forward computes from now on."""
    rows = [0]
    forward = engine.model.forward

    def counting(batch, *args):
        rows[0] += len(batch.input_ids)
        return forward(batch, *args)

    engine.model.forward = counting
    return rows


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "step_graphs"])
@pytest.mark.parametrize("adapter", [None, "a0"])
def test_shared_prefixes_of_every_length_generate_as_without_the_cache(
    tiny_model_dir, tiny_adapters, uncached, adapter, graphs
):
    """With step graphs (a CUDA engine's bucketed forwards, eager here) a prompt's tail after its cached prefix is a
    short prefill chunk through the chunk forward: the same results."""
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    starts: list[int] = []  # the first positions of the chunks through the chunk forward
    if graphs:
        step_graphs = with_step_graphs(engine)
        extend = step_graphs.extend
        step_graphs.extend = lambda *chunks: starts.extend(chunks[2]) or extend(*chunks)
    common = list(range(10, 90))
    # pairs of prompts that share `shared` tokens: the first leaves its state there, the second starts from it
    pairs = [[[*common[:shared], *range(200 + k, 209 + k)] for k in (0, 50)] for shared in SHARED_LENGTHS]
    expected = generate_all(uncached, [prompt for pair in pairs for prompt in pair], adapter)
    for shared, (first, second) in zip(SHARED_LENGTHS, pairs, strict=True):
        assert_same(run(engine, first, adapter), expected[tuple(first)])
        choice, cached = cached_by(engine, second, adapter)
        assert cached == shared // BLOCK * BLOCK
        assert_same(choice, expected[tuple(second)])
    # all the first prompts again, at once: each starts from its last whole block (one to 16 tokens computed)
    before = engine.prefix_cache.stats.cached_tokens
    again = generate_all(engine, [first for first, _ in pairs], adapter)
    assert engine.prefix_cache.stats.cached_tokens - before == sum((len(p) - 1) // BLOCK * BLOCK for p, _ in pairs)
    for prompt, choice in again.items():
        assert_same(choice, expected[prompt])
    assert (max(starts, default=0) >= 64) == graphs  # tails after cached prefixes went through the chunk forward


def test_a_prefix_computed_under_one_adapter_is_never_reused_for_another_or_the_base(
    tiny_model_dir, tiny_adapters, uncached
):
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    prompt = list(range(30, 71))
    results = {}
    for adapter in ("a0", None, "a1"):
        first, cached = cached_by(engine, prompt, adapter)
        assert cached == 0
        assert_same(first, run(uncached, prompt, adapter))
        again, cached = cached_by(engine, prompt, adapter)
        assert cached == 32
        assert_same(again, first)
        results[adapter] = first.token_ids
    assert len({tuple(tokens) for tokens in results.values()}) == 3  # reusing across them would have shown

    # a key unloaded and loaded again may name another adapter: nothing cached under it survives
    engine.unload_adapter("a1")
    engine.load_adapter("a1", tiny_adapters[2])
    uncached.load_adapter("other", tiny_adapters[2])
    try:
        choice, cached = cached_by(engine, prompt, "a1")
        assert cached == 0
        assert_same(choice, run(uncached, prompt, "other"))
    finally:
        uncached.unload_adapter("other")


def test_eviction_keeps_the_cache_within_its_budget_and_the_results_equal(tiny_model_dir, tiny_adapters, uncached):
    budget = 160_000  # inkling-tiny: a 32-token node with its boundary is 75,776 bytes, so two fit
    engine = cached_engine(tiny_model_dir, tiny_adapters, prefix_cache_bytes=budget)
    stats = engine.prefix_cache.stats
    prompts = [([*range(20 + i, 60 + i), 7], (None, "a0")[i % 2]) for i in range(5)]
    requests = [Request(str(i), prompt, GREEDY, adapter) for i, (prompt, adapter) in enumerate(prompts)]
    expected = uncached.generate(requests)
    for request in requests:
        for hit in (False, True):
            choice, cached = cached_by(engine, request.prompt_ids, request.adapter)
            assert cached == (32 if hit else 0) and stats.bytes <= budget
            assert_same(choice, expected[request.request_id][0])
    assert stats.evictions == 3
    # what is left is what was used last: the newest two prompts still hit, the oldest has gone
    assert cached_by(engine, *prompts[3])[1] == 32
    assert cached_by(engine, *prompts[0])[1] == 0


def test_the_choices_of_a_request_and_identical_prompts_share_one_prefill(tiny_model_dir, tiny_adapters, uncached):
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    rows, rows_uncached = counted_rows(engine), counted_rows(uncached)
    prompt = list(range(100, 140))  # 40 tokens: the choices after the first compute 40 - 32
    one_token = SamplingParams(max_tokens=1, temperature=0.0, n=4, ignore_eos=True, logprobs=0)
    choices = engine.generate([Request("n", prompt, one_token, "a0")])["n"]
    assert rows[0] == 40 + 3 * 8
    for choice, theirs in zip(choices, uncached.generate([Request("n", prompt, one_token, "a0")])["n"], strict=True):
        assert_same(choice, theirs)
    assert rows_uncached[0] == 4 * 40

    # two requests at once: the same prompt, and one that shares only its first 32 tokens
    rows[0] = 0
    single = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    other = [*range(300, 340), 9]
    late = [*other[:32], *range(150, 159)]
    outs = engine.generate([Request("x", other, single), Request("y", other, single), Request("z", late, single)])
    assert rows[0] == 41 + 9 + 9
    for rid, prompt in (("x", other), ("y", other), ("z", late)):
        assert outs[rid][0].token_ids == run(uncached, prompt, params=single).token_ids

    # sampled choices draw from their own generators, cache or not
    sampled = SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3, ignore_eos=True, logprobs=0)
    prompt = list(range(60, 97))
    ours = engine.generate([Request("s", prompt, sampled)])["s"]
    for choice, theirs in zip(ours, uncached.generate([Request("s", prompt, sampled)])["s"], strict=True):
        assert_same(choice, theirs)


def test_a_held_choice_whose_leader_is_aborted_computes_its_prompt(tiny_model_dir, tiny_adapters, uncached):
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    prompt = list(range(40, 90))
    engine.add_request(Request("lead", prompt, GREEDY))
    engine.add_request(Request("held", prompt, GREEDY))
    engine.step()  # the leader's first chunk; the other waits for its state at 48
    engine.abort("lead")
    choices: dict[int, Choice] = {}
    while engine.has_work():
        for out in engine.step():
            choices.setdefault(out.index, Choice()).extend(out)
    assert_same(choices[0], run(uncached, prompt))


def test_prompt_logprobs_and_routing_bypass_the_cache(tiny_model_dir, tiny_adapters, uncached):
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    prompt = list(range(5, 45))
    run(engine, prompt, "a0")
    stats = engine.prefix_cache.stats
    lookups = stats.lookups
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=True, prompt_routing=True, logprobs=0)
    ours, theirs = run(engine, prompt, "a0", scored), run(uncached, prompt, "a0", scored)
    assert stats.lookups == lookups
    assert_same(ours, theirs)
    assert len(ours.prompt_logprobs) == len(prompt) and ours.prompt_logprobs[0] is None
    np.testing.assert_allclose(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], rtol=0, atol=1e-5)
    assert np.array_equal(ours.prompt_routing, theirs.prompt_routing)
    # and the prompt is cached as before for those that do not ask
    assert cached_by(engine, prompt, "a0")[1] == 32


def test_a_group_traced_for_routing_replay_prefills_its_prompt_once(tiny_model_dir, tiny_adapters, uncached):
    """A GRPO group asking for routing traces: the first choice computes its whole prompt (recording its routing)
    and leaves it in the cache, where the other choices start from; every choice samples, scores and routes as
    without the cache."""
    engine = cached_engine(tiny_model_dir, tiny_adapters)
    rows = counted_rows(engine)
    prompt = list(range(150, 190))  # 40 tokens: the choices after the first compute 40 - 32
    group = SamplingParams(
        max_tokens=3,
        temperature=1.0,
        seed=5,
        n=4,
        ignore_eos=True,
        logprobs=0,
        return_routing=True,
        prompt_routing=True,
    )
    ours = engine.generate([Request("g", prompt, group, "a0")])["g"]
    assert rows[0] == 40 + 3 * 8 + 4 * 2  # and two decode steps of the four
    assert engine.prefix_cache.stats.hits == 3
    theirs = uncached.generate([Request("g", prompt, group, "a0")])["g"]
    for mine, other in zip(ours, theirs, strict=True):
        assert_same(mine, other)
        assert np.array_equal(np.sort(mine.routing, axis=-1), np.sort(other.routing, axis=-1))
    assert np.array_equal(np.sort(ours[0].prompt_routing, -1), np.sort(theirs[0].prompt_routing, -1))
    assert len(ours[0].prompt_routing) == 39 and all(c.prompt_routing is None for c in ours[1:])


def test_a_short_tail_past_a_cached_prefix_is_one_forward_and_leaves_no_boundary(tiny_model_dir, tiny_adapters):
    """By default (prefix_cache_min_gain 64) a prompt's last whole block is cached only where it lies more than 64
    tokens past the prefix it shares: a short question after a cached system prompt prefills in one forward (the
    time to first token of a long system prompt's questions), a long one ends a chunk at its last block."""
    engine = cached_engine(
        tiny_model_dir, tiny_adapters, max_batch_tokens=256, prefix_cache_min_gain=EngineConfig.prefix_cache_min_gain
    )
    system = list(range(10, 90))  # 80 tokens: five blocks
    run(engine, [*system, *range(200, 210)])  # its last block (80) is 80 tokens past an empty tree: cached
    forward, sizes = engine.model.forward, []
    engine.model.forward = lambda batch, *args: sizes.append(len(batch.input_ids)) or forward(batch, *args)
    for question, forwards in ((range(300, 332), [32]), (range(100, 200), [96, 4])):
        sizes.clear()
        assert cached_by(engine, [*system, *question])[1] == 80
        assert sizes[: len(forwards)] == forwards  # then one-token decode steps
    engine.model.forward = forward
    # the short question left nothing past the system prompt; the long one its last block
    assert cached_by(engine, [*system, *range(300, 332), 5])[1] == 80
    assert cached_by(engine, [*system, *range(100, 200), 5])[1] == 176
