"""Worker processes, their colocated loaders and the router, on real processes and queues."""

import asyncio
import threading
import time

import pytest

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.io import save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.handle import AdapterLoadError, WorkerHandle
from inkwell.serving.native.engine import Engine
from inkwell.serving.router import AdapterRef, QueueFullError, ServingRouter
from inkwell.serving.sources import DirectorySource
from inkwell.serving.worker import WorkerConfig
from tests.serving.slow_source import SlowSource

ENGINE = EngineConfig(max_loras_per_batch=4, max_lora_rank=16, max_batch_tokens=64)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT = [1, *range(60, 80)]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_model_dir, tiny_adapters):
    root = tmp_path_factory.mktemp("adapters")
    config = load_base_config(tiny_model_dir)
    return [save_adapter(a, root / f"a{i}", "sglang", config) for i, a in enumerate(tiny_adapters)]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    handles = [WorkerHandle(WorkerConfig(str(tiny_model_dir), ENGINE, name=f"w{i}")) for i in range(2)]
    threads = [threading.Thread(target=h.start) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(h.info is not None for h in handles), "a worker did not start"
    yield handles
    for h in handles:
        h.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapters):
    engine = Engine(tiny_model_dir, ENGINE)
    for i, adapter in enumerate(tiny_adapters):
        engine.load_adapter(f"a{i}", adapter)

    def tokens(adapter: str | None, params: SamplingParams = GREEDY, prompt=PROMPT) -> list[int]:
        return engine.generate([Request("r", prompt, params, adapter)])["r"][0].token_ids

    return tokens


def ref(i: int, adapter_dirs) -> AdapterRef:
    return AdapterRef(f"a{i}@1", DirectorySource(str(adapter_dirs[i])))


async def tokens_of(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


def test_worker_serves_adapters_like_the_engine(workers, adapter_dirs, reference):
    router = ServingRouter(lambda base: workers[:1])

    async def go():
        a0 = await router.submit("tiny", PROMPT, GREEDY, ref(0, adapter_dirs))
        base = await router.submit("tiny", PROMPT, GREEDY, None)
        return await asyncio.gather(tokens_of(a0), tokens_of(base))

    with_adapter, without = asyncio.run(go())
    assert with_adapter == reference("a0")
    assert without == reference(None) != with_adapter


def test_swap_while_others_stream_does_not_stall_them(workers, adapter_dirs, reference):
    """A 1 s adapter fetch happens in the loader; the worker keeps stepping the other requests."""
    worker = workers[0]
    router = ServingRouter(lambda base: [worker])
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=0)
    stamps: list[float] = []
    window: dict[str, float] = {}

    async def stream_times(stream):
        async for _ in stream:
            stamps.append(time.monotonic())

    async def swap():
        await asyncio.sleep(0.5)
        window["start"] = time.monotonic()
        slow = AdapterRef("a3@slow", SlowSource(DirectorySource(str(adapter_dirs[3])), 1.0))
        stream = await router.submit("tiny", PROMPT, GREEDY, slow)
        window["loaded"] = time.monotonic()
        return await tokens_of(stream)

    async def go():
        streams = [
            await router.submit("tiny", PROMPT, long, ref(1, adapter_dirs)),
            await router.submit("tiny", PROMPT, long, ref(2, adapter_dirs)),
            await router.submit("tiny", PROMPT, long, None),
        ]
        results = await asyncio.gather(swap(), *(stream_times(s) for s in streams))
        return results[0]

    swapped = asyncio.run(go())
    assert swapped == reference("a3")
    assert window["loaded"] - window["start"] >= 1.0
    during = [t for t in stamps if window["start"] <= t <= window["loaded"]]
    assert len(during) >= 10, f"only {len(during)} outputs while the adapter loaded"
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    assert max(gaps) < 0.5, f"other streams stalled {max(gaps):.2f}s during the swap"


def test_router_prefers_the_holder_then_the_least_loaded_and_bounds_in_flight(workers, adapter_dirs):
    router = ServingRouter(lambda base: workers)
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # still running at the end

    async def go():
        first = await router.submit("tiny", PROMPT, long, None)  # both idle: the first worker
        fresh = ref(4, adapter_dirs)
        second = await router.submit("tiny", PROMPT, long, fresh)  # least loaded: the other worker loads it
        assert first.handle is not second.handle
        holder = second.handle
        assert fresh.key in holder.adapters and all(fresh.key not in w.adapters for w in workers if w is not holder)
        third = await router.submit("tiny", PROMPT, GREEDY, fresh)  # equal load: the holder wins
        assert third.handle is holder
        bounded = ServingRouter(lambda base: workers, max_inflight_per_worker=1)
        with pytest.raises(QueueFullError) as err:
            await bounded.submit("tiny", PROMPT, GREEDY, None)
        assert err.value.retry_after >= 1
        for stream in (first, second, third):
            stream.cancel()
        await asyncio.sleep(0.2)
        assert all(w.inflight == 0 for w in workers)
        await holder.unload_adapter(fresh.key)  # idle now, so it can go
        assert fresh.key not in holder.adapters

    asyncio.run(go())


def test_bad_adapters_fail_their_load_and_the_worker_keeps_serving(
    workers, adapter_dirs, tiny_model_dir, tmp_path, reference
):
    config = load_base_config(tiny_model_dir)
    big = init_adapter(config, LoraSpec(rank=32), base_model_identity(tiny_model_dir), seed=5, b_std=0.05)
    big_dir = save_adapter(big, tmp_path / "big", "sglang", config)
    corrupt_dir = save_adapter(big, tmp_path / "corrupt", "peft", config)
    weights = corrupt_dir / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    router = ServingRouter(lambda base: workers[:1])

    async def go():
        with pytest.raises(AdapterLoadError) as err:
            await router.submit("tiny", PROMPT, GREEDY, AdapterRef("big@1", DirectorySource(str(big_dir))))
        assert err.value.code == "adapter_incompatible" and "max_lora_rank" in str(err.value)
        with pytest.raises(AdapterLoadError) as err:
            await router.submit("tiny", PROMPT, GREEDY, AdapterRef("bad@1", DirectorySource(str(corrupt_dir))))
        assert err.value.code == "adapter_load_failed" and "sha256" in str(err.value)
        with pytest.raises(AdapterLoadError, match="does not exist"):
            await router.submit("tiny", PROMPT, GREEDY, AdapterRef("gone@1", DirectorySource(str(tmp_path / "no"))))
        return await tokens_of(await router.submit("tiny", PROMPT, GREEDY, ref(0, adapter_dirs)))

    assert asyncio.run(go()) == reference("a0")
