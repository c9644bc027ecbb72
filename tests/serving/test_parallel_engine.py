"""The native engine as a group of two gloo processes (TP=2, EP=2) against the single-process engine, in fp32.

Each group is started once for the module (a process start costs seconds) and driven in lockstep with a fresh
single-process engine under the same orders, so every step's outputs are compared, not only the final text. Both
run the prefix cache with every prompt's last whole block kept, so prompts are cached, attached and split throughout
(its budget counts a rank's own slice, half the single process's keys under TP=2: within it, nothing is evicted).
"""

import asyncio
import dataclasses

import pytest
import torch
from pydantic import ValidationError

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.io import save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.handle import WorkerHandle
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.group_engine import GroupEngine, check_group_config, native_engine
from inkwell.serving.native.plan import Plan, RankMemory, RecordingPrefixStore
from inkwell.serving.native.shards import Shard
from inkwell.serving.native.state import StatePool
from inkwell.serving.router import AdapterRef, ServingRouter
from inkwell.serving.settings import ServingSettings
from inkwell.serving.sources import DirectorySource
from inkwell.serving.worker import WorkerConfig

CONFIG = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, max_batch_tokens=40, prefix_cache_min_gain=0)
LAYOUTS = {"tp2": {"tensor_parallel": 2}, "ep2": {"expert_parallel": 2}}
LOGPROB_TOLERANCE = 1e-5
PROMPT = [1, *range(60, 80)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2, **kwargs)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engines(request, tiny_model_dir, tiny_adapters):
    """(single process, group) with the same five adapters; the group's processes live for the module."""
    torch.set_num_threads(1)
    group = native_engine(tiny_model_dir, dataclasses.replace(CONFIG, **LAYOUTS[request.param]))
    assert isinstance(group, GroupEngine)
    reference = Engine(tiny_model_dir, CONFIG)
    for engine in (reference, group):
        for i, adapter in enumerate(tiny_adapters):
            engine.load_adapter(f"a{i}", adapter)
    yield reference, group
    group.shutdown()


def step_record(engine) -> list[tuple]:
    """One step's outputs: (request, choice, tokens, chosen logprobs, top logprobs, prompt logprobs)."""
    return [
        (
            out.request_id,
            out.index,
            out.token_ids,
            [lp.logprob for lp in out.logprobs],
            [[p for _, p in lp.top] for lp in out.logprobs],
            out.prompt_logprobs,
        )
        for out in engine.step()
    ]


def assert_same_steps(ours: list[list[tuple]], ref: list[list[tuple]]) -> None:
    """The same outputs at every step: ids and tokens equal, every logprob within LOGPROB_TOLERANCE."""
    assert len(ours) == len(ref)
    for step, (got, want) in enumerate(zip(ours, ref, strict=True)):
        assert [o[:3] for o in got] == [o[:3] for o in want], f"step {step}"
        for a, b in zip(got, want, strict=True):
            chosen = torch.tensor([a[3], b[3]])
            torch.testing.assert_close(chosen[0], chosen[1], rtol=0, atol=LOGPROB_TOLERANCE, msg=f"step {step}")
            torch.testing.assert_close(torch.tensor(a[4]), torch.tensor(b[4]), rtol=0, atol=LOGPROB_TOLERANCE)
            if b[5] is not None:
                ours_p, ref_p = (torch.tensor([p if p is not None else 0.0 for p in x[5]]) for x in (a, b))
                torch.testing.assert_close(ours_p, ref_p, rtol=0, atol=LOGPROB_TOLERANCE)


def run_lockstep(engines, script: dict[int, object], steps: int) -> list[list[list[tuple]]]:
    """Each engine's outputs per step, `script[i](engine)` done before step i."""
    runs = []
    for engine in engines:
        record = []
        for i in range(steps):
            if i in script:
                script[i](engine)
            record.append(step_record(engine))
        assert not engine.has_work()
        runs.append(record)
    return runs


def test_mixed_adapter_batch_equals_single_process(engines):
    """Five adapters (three slots) and the base model in one batch, prompts prefilled in chunks: the same tokens
    and logprobs at every step."""
    requests = [
        Request(f"r{i}", list(range(10 + 3 * i, 40 + 5 * i)), greedy(24, prompt_logprobs=i == 1), f"a{i}")
        for i in range(5)
    ] + [Request("base", list(range(7, 50)), greedy(24))]

    def add_all(engine):
        for request in requests:
            engine.add_request(request)

    ref, ours = run_lockstep(engines, {0: add_all}, 90)
    assert_same_steps(ours, ref)
    tokens = {o[0]: o[2] for step in ref for o in step if o[2]}
    assert len(tokens) == 6


def test_swap_on_a_running_group_reaches_every_rank_at_the_same_step(engines, tiny_model_dir):
    """While a base request decodes, version 1 of an adapter serves a request and is swapped for version 2 (the
    new version's slot written between two steps of the running group): every step equals the single process's,
    and the second request really ran on version 2."""
    config, identity = load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir)
    spec = LoraSpec(rank=8, alpha=16, targets=("attn", "mlp", "experts", "shared_experts", "lm_head"))
    v1, v2 = (init_adapter(config, spec, identity, seed=seed, b_std=0.05) for seed in (11, 12))
    prompt = list(range(60, 85))

    def start(engine):
        engine.load_adapter("v1", v1)
        engine.add_request(Request("running", list(range(3, 30)), greedy(20)))
        engine.add_request(Request("on-v1", prompt, greedy(4), "v1"))

    def swap(engine):
        engine.unload_adapter("v1")
        engine.load_adapter("v2", v2)
        engine.add_request(Request("on-v2", prompt, greedy(4), "v2"))

    ref, ours = run_lockstep(engines, {0: start, 6: swap}, 24)
    assert_same_steps(ours, ref)
    outputs = {o[0]: o[2] for step in ref for o in step if o[2]}
    assert outputs["on-v1"] != outputs["on-v2"], "the two versions must decode differently for the test to see a swap"
    for engine in engines:
        engine.unload_adapter("v2")


def test_prefixes_cached_on_rank_0_are_restored_on_every_rank(engines, tiny_model_dir, tiny_adapters):
    """A prompt's three choices (two wait for the first's prefix), a request that branches off inside a cached
    prefix (the tree's edge is split), one that starts from the branch point, the same prompt on the base and on
    another adapter, and an adapter unloaded with its prefixes: every step equals the single process's, and the
    group's cache found what the single process's found."""
    prompt = list(range(100, 150))
    spec = LoraSpec(rank=8, alpha=16, targets=("attn", "experts", "lm_head"))
    config, identity = load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir)
    dropped = init_adapter(config, spec, identity, seed=21, b_std=0.05)

    def start(engine):
        engine.load_adapter("dropped", dropped)
        engine.add_request(Request("group", prompt, greedy(6, n=3), "a0"))
        engine.add_request(Request("base", prompt, greedy(6)))
        engine.add_request(Request("on-dropped", prompt, greedy(3), "dropped"))

    def branch(engine):
        engine.add_request(Request("branch", prompt[:40] + list(range(200, 215)), greedy(4), "a0"))

    def from_branch(engine):
        engine.unload_adapter("dropped")
        engine.add_request(Request("from-branch", prompt[:40] + list(range(220, 230)), greedy(4), "a0"))
        engine.add_request(Request("other-adapter", prompt, greedy(4), "a1"))

    before = [dataclasses.replace(engine.prefix_cache.stats) for engine in engines]
    ref, ours = run_lockstep(engines, {0: start, 10: branch, 16: from_branch}, 30)
    assert_same_steps(ours, ref)
    reference, group = (dataclasses.replace(engine.prefix_cache.stats, bytes=0) for engine in engines)
    assert group == reference  # the same lookups, hits and tokens (bytes: the group's are rank 0's slices)
    assert reference.hits - before[0].hits >= 3, "the held choices and from-branch must start from cached prefixes"
    assert reference.cached_tokens - before[0].cached_tokens >= 2 * 48 + 32


def test_every_change_of_rank_0s_prefix_copies_is_repeated_on_the_other_ranks(tiny_model_dir, tiny_adapters):
    """The ops rank 0's prefix store records, applied to another rank's memory, keep the same copies: caching,
    splits, restores, evictions and an adapter's prefixes dropped (a forget left out would grow the other ranks'
    memory past the budget)."""

    class Recording(Engine):
        def _prefix_store(self):
            self.plan = Plan()
            return RecordingPrefixStore(self.plan, self.state)

    budget = 160_000  # inkling-tiny: a 32-token node with its boundary is 75,776 bytes, so two fit
    engine = Recording(tiny_model_dir, dataclasses.replace(CONFIG, prefix_cache_bytes=budget))
    engine.load_adapter("a0", tiny_adapters[0])
    prompts = [list(range(100, 150)), list(range(100, 140)) + [7] * 9, list(range(30, 90)), list(range(100, 150))]
    for i, prompt in enumerate(prompts):
        engine.generate([Request(str(i), prompt, greedy(2, n=2), "a0"), Request(f"b{i}", prompt, greedy(2))])
    engine.unload_adapter("a0")
    state = StatePool(engine.model_config, CONFIG.max_seqs, engine.max_context, torch.float32, torch.device("cpu"))
    other = RankMemory(state, None, None)  # prefix ops only: no adapter slots or shard
    for op in engine.plan.ops:
        other.apply(op)
    store, stats = engine.prefix_cache.store, engine.prefix_cache.stats
    assert stats.evictions > 0 and stats.hits > 0 and 0 < store.nbytes <= budget
    assert other.prefixes.nbytes == store.nbytes


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=list(LAYOUTS))
def test_ranks_read_only_their_slices_and_together_hold_the_model(tiny_model_dir, tiny_adapters, tp, ep):
    """Each rank's slices of the checkpoint and of an adapter are its part of every split tensor; the two ranks'
    parts, put back together, are the whole tensor."""
    weights = load_base_weights(tiny_model_dir)
    ranks = [Shard.of(rank, tp, ep) for rank in range(2)]
    for name in weights:
        full, parts = weights[name], [s.weights(weights)[name] for s in ranks]
        assert rebuilt(full, parts, name), name
    adapter = tiny_adapters[0]
    shards = [s.adapter(adapter).tensors for s in ranks]
    for name, full in adapter.tensors.items():
        assert rebuilt(full, [shard[name] for shard in shards], name), name


def rebuilt(full: torch.Tensor, parts: list[torch.Tensor], name: str) -> bool:
    """Whether `parts` are `full` whole on each rank, or split in two along one dim (the fused expert gate/up in
    its two halves)."""
    if all(p.shape == full.shape for p in parts):
        return all(torch.equal(p, full) for p in parts)
    if name.endswith("experts.gate_up_proj") and parts[0].shape[0] == full.shape[0]:
        halves = [p.chunk(2, dim=1) for p in parts]
        return torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1), full)
    dims = [d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d]]
    return len(dims) == 1 and torch.equal(torch.cat(parts, dim=dims[0]), full)


def test_uneven_splits_and_per_process_features_are_refused(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    with pytest.raises(ValueError, match="num_key_value_heads 2 by tensor_parallel=4"):
        Shard(tp=4).check(config)
    with pytest.raises(ValueError, match="n_shared_experts 2 by expert_parallel=4"):
        Shard(ep=4).check(config)
    check_group_config(EngineConfig(tensor_parallel=2))  # the prefix cache runs across processes
    with pytest.raises(ValueError, match="cuda_graphs cannot run on an engine spanning 2 processes"):
        check_group_config(EngineConfig(expert_parallel=2, device="cuda"))


def test_settings_give_a_worker_several_devices():
    settings = ServingSettings(tensor_parallel=2, expert_parallel=1)
    assert settings.devices_per_worker == 2 and settings.worker_devices() == ["cpu"]
    config = settings.engine_config("cpu")
    assert (config.ranks, config.prefix_cache, config.cuda_graphs) == (2, True, False)
    assert not ServingSettings(tensor_parallel=2, prefix_cache=False).engine_config("cpu").prefix_cache
    with pytest.raises(ValidationError, match="use engine=native"):
        ServingSettings(expert_parallel=2, engine="sglang")


def test_a_worker_spanning_two_processes_is_one_worker(tiny_model_dir, tmp_path, tiny_adapters):
    """A serving worker whose engine is a TP=2 group: started, fed an adapter by its loader and routed to like any
    worker; it answers as the single-process engine does, and stops its second rank when it stops."""
    adapter_dir = save_adapter(tiny_adapters[0], tmp_path / "a0", "sglang", load_base_config(tiny_model_dir))
    engine = dataclasses.replace(CONFIG, tensor_parallel=2)
    handle = WorkerHandle(WorkerConfig(str(tiny_model_dir), engine, name="tp2"))
    handle.start()
    try:
        router = ServingRouter(lambda base: [handle])

        async def tokens(adapter: AdapterRef | None) -> list[int]:
            stream = await router.submit("tiny", PROMPT, greedy(12), adapter)
            return [t async for out in stream for t in out.token_ids]

        async def both():
            return await asyncio.gather(tokens(AdapterRef("a0@1", DirectorySource(str(adapter_dir)))), tokens(None))

        served = asyncio.run(both())
    finally:
        handle.close()
    reference = Engine(tiny_model_dir, CONFIG)
    reference.load_adapter("a0", tiny_adapters[0])
    want = reference.generate([Request("a", PROMPT, greedy(12), "a0"), Request("b", PROMPT, greedy(12))])
    assert served == [want["a"][0].token_ids, want["b"][0].token_ids]
