"""The engine and a worker on one CUDA device (run on the device machine: pytest -m gpu)."""

import asyncio

import pytest
import torch

from inkwell.adapters.io import save_adapter
from inkwell.models import load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.handle import WorkerHandle
from inkwell.serving.native.engine import Engine
from inkwell.serving.router import AdapterRef, ServingRouter
from inkwell.serving.sources import DirectorySource
from inkwell.serving.worker import WorkerConfig
from tests.serving.test_engine import PROMPT, merged_model, reference_greedy, reference_prompt_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def cuda_engine(model_dir, adapters, dtype: str) -> Engine:
    engine = Engine(model_dir, EngineConfig(max_loras_per_batch=6, max_lora_rank=16, dtype=dtype, device="cuda"))
    for i, adapter in enumerate(adapters):
        engine.load_adapter(f"a{i}", adapter)
    return engine


def test_fp32_on_cuda_matches_transformers_on_cpu(tiny_model_dir, tiny_adapters):
    engine = cuda_engine(tiny_model_dir, tiny_adapters, "float32")
    model = merged_model(tiny_model_dir, tiny_adapters[0])
    got = engine.generate([Request("x", PROMPT, GREEDY, "a0")])["x"][0].token_ids
    assert got == reference_greedy(model, PROMPT, 32)
    ids = PROMPT + got
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    lp = engine.generate([Request("p", ids, params, "a0")])["p"][0].prompt_logprobs
    assert (torch.tensor(lp[1:]) - reference_prompt_logprobs(model, ids)).abs().max().item() < 1e-4


def test_bf16_mixed_batch_stays_close_to_fp32(tiny_model_dir, tiny_adapters):
    fp32 = cuda_engine(tiny_model_dir, tiny_adapters, "float32")
    bf16 = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    reqs = [Request(f"r{i}", PROMPT[: 20 + 2 * i], params, f"a{i}") for i in range(5)]
    reqs.append(Request("base", PROMPT, params))
    exact, low = fp32.generate(reqs), bf16.generate(reqs)
    for r in reqs:
        a = torch.tensor(exact[r.request_id][0].prompt_logprobs[1:])
        b = torch.tensor(low[r.request_id][0].prompt_logprobs[1:])
        assert (a - b).abs().max().item() < 0.15, r.request_id


def test_cuda_worker_takes_adapters_through_cuda_ipc(tiny_model_dir, tiny_adapters, tmp_path):
    config = load_base_config(tiny_model_dir)
    source = DirectorySource(str(save_adapter(tiny_adapters[1], tmp_path / "a1", "sglang", config)))
    engine_config = EngineConfig(max_lora_rank=16, device="cuda")
    worker = WorkerHandle(WorkerConfig(str(tiny_model_dir), engine_config, name="gpu0"))
    worker.start()
    try:
        router = ServingRouter(lambda base: [worker])

        async def go():
            stream = await router.submit("tiny", PROMPT, GREEDY, AdapterRef("a1@1", source))
            return [t async for out in stream for t in out.token_ids]

        got = asyncio.run(go())
    finally:
        worker.close()
    engine = cuda_engine(tiny_model_dir, tiny_adapters, "float32")
    assert got == engine.generate([Request("x", PROMPT, GREEDY, "a1")])["x"][0].token_ids
