"""CUDA-graph decode on one GPU (run on the device machine: pytest -m gpu): replayed graphs against the eager
engine, the LoRA side stream, routing traces out of the graphs, and an adapter swap into a slot a captured graph
reads."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from tests.serving.test_gpu_serving import compare

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)


def cuda_engine(model_dir, adapters, dtype: str, max_loras: int = 6, **options) -> Engine:
    config = EngineConfig(max_loras_per_batch=max_loras, max_lora_rank=16, dtype=dtype, device="cuda", **options)
    engine = Engine(model_dir, config)
    for i, adapter in enumerate(adapters):
        engine.load_adapter(f"a{i}", adapter)
    return engine


def mixed_requests() -> list[Request]:
    """Six prompts of 14..29 tokens (decoding to 69 crosses the window, 24, and the relative extent, 48) with
    every adapter of conftest's SPECS and a base-model row; 20..40 new tokens, so the batch shrinks from 6 rows
    (the 8-bucket, with padding) to the base row alone."""
    return [
        Request(
            f"r{i}",
            [1, *range(9 + i, 22 + 4 * i)],
            SamplingParams(max_tokens=20 + 4 * i, temperature=0.0, ignore_eos=True, logprobs=2),
            None if i == 5 else f"a{i}",
        )
        for i in range(6)
    ]


def assert_close(expected: dict, got: dict, tol: float) -> None:
    for rid, choices in expected.items():
        a, b = choices[0], got[rid][0]
        lp_a, lp_b = ([x.logprob for x in c.logprobs] for c in (a, b))
        if b.token_ids != a.token_ids:
            i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y)
            before = max((abs(x - y) for x, y in zip(lp_a[:i], lp_b[:i], strict=True)), default=0.0)
            raise AssertionError(
                f"{rid}: token {i} is {b.token_ids[i]} (logprob {lp_b[i]:.5f}), expected {a.token_ids[i]} (logprob "
                f"{lp_a[i]:.5f}); logprobs before it differ by at most {before:.2e}"
            )
        diff = torch.tensor(lp_a) - torch.tensor(lp_b)
        assert diff.abs().max().item() < tol, rid


# bf16 graph steps against eager ones: the decode attention kernel sums each row's keys in runs with an online
# softmax, where the eager composite rounds the normalised probabilities to bf16, so the attention output, and through
# the cache the later steps, may land one bf16 step away. The logits come out of the LM head in bf16, where one of
# magnitude 4-8 is a multiple of 2^-5 = 0.031: same-token logprobs agree within one such step and the log-sum-exp's
# shift (the H100 showed 0.022 over a 36-token stream on 2026-12-06), and a greedy token may part at a near-tie.
BF16_TOL = 4e-2


def assert_streams_agree(expected: dict, got: dict) -> None:
    """Each bf16 greedy stream as `test_gpu_serving.compare` holds it to the reference's (a split only at a near-tie,
    same-token logprobs within BF16_TOL), and most of all the streams' tokens compared."""
    total = sum(len(choices[0].token_ids) for choices in expected.values())
    compared = sum(compare(choices[0], got[rid][0], BF16_TOL)[0] for rid, choices in expected.items())
    assert compared >= total // 2, f"only {compared} of {total} tokens compared before their streams split"


@pytest.mark.parametrize("side_stream", [False, True], ids=["one_stream", "side_stream"])
def test_graph_decode_bf16_equals_eager(tiny_model_dir, tiny_adapters, side_stream):
    eager = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", cuda_graphs=False, lora_side_stream=False)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", lora_side_stream=side_stream)
    assert eager.graphs is None and graphs.graphs.use_graphs
    assert graphs.graphs.decode_forward.grouped_mm == (torch.cuda.get_device_capability()[0] in (9, 10))
    requests = mixed_requests()
    expected, got = eager.generate(requests), graphs.generate(requests)
    assert {(8, 256, True), (4, 256, True), (2, 256, True), (1, 256, False)} <= set(graphs.graphs.decode_graphs)
    assert_streams_agree(expected, got)


def test_graph_decode_fp32_equals_eager(tiny_model_dir, tiny_adapters):
    """fp32 has no capturable grouped GEMM: the graphs run every expert on every token, and equal eager closely."""
    eager = cuda_engine(tiny_model_dir, tiny_adapters, "float32", cuda_graphs=False)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, "float32")
    assert not graphs.graphs.decode_forward.grouped_mm
    requests = mixed_requests()
    assert_close(eager.generate(requests), graphs.generate(requests), 1e-4)


def test_graph_decode_records_the_eager_routing(tiny_model_dir, tiny_adapters):
    """Routing traces come out of the captured graphs, through pinned memory while the next step is already queued
    (no logprobs: decode steps overlap), as the eager engine records them: in fp32 the same experts."""
    eager = cuda_engine(tiny_model_dir, tiny_adapters, "float32", cuda_graphs=False)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, "float32")
    traced = [
        replace(r, params=replace(r.params, logprobs=None, return_routing=True, prompt_routing=True))
        for r in mixed_requests()
    ]
    expected, got = eager.generate(traced), graphs.generate(traced)
    for rid, choices in expected.items():
        a, b = choices[0], got[rid][0]
        assert b.token_ids == a.token_ids and len(b.routing) == len(b.token_ids), rid
        for ours, theirs in ((b.routing, a.routing), (b.prompt_routing, a.prompt_routing)):
            assert np.array_equal(np.sort(ours, -1), np.sort(theirs, -1)), rid


def test_side_stream_gives_the_one_stream_results(tiny_model_dir, tiny_adapters):
    """On the side stream a projection's shrink runs beside its base GEMM and the expand adds into the GEMM's output
    as on one stream (the prompts' prefill step, over 64 tokens, takes that path), and each token's expert rows are
    summed in the token's own order: the results should be bitwise the same."""
    one = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", lora_side_stream=False)
    two = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", lora_side_stream=True)
    requests = mixed_requests()
    assert_close(one.generate(requests), two.generate(requests), 1e-6)
    eager_one = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", cuda_graphs=False, lora_side_stream=False)
    eager_two = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", cuda_graphs=False, lora_side_stream=True)
    assert_close(eager_one.generate(requests), eager_two.generate(requests), 1e-6)


def test_base_only_batches_replay_the_graph_without_lora(tiny_model_dir, tiny_adapters):
    eager = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", cuda_graphs=False)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16")
    requests = [Request(f"b{i}", [1, *range(30 + i, 50 + i)], GREEDY) for i in range(3)]
    assert_streams_agree(eager.generate(requests), graphs.generate(requests))
    assert set(graphs.graphs.decode_graphs) == {(4, 256, False)}


def test_swap_into_a_captured_slot_is_used_without_recapture(tiny_model_dir, tiny_adapters):
    """Two slots: a0 (slot 0) and a1 (slot 1) decode under captured graphs; a0 is unloaded and a2 written into
    slot 0; the same graphs replay and give what a fresh eager engine with a2 gives."""
    prompt_x, prompt_y = [1, *range(40, 60)], [1, *range(70, 95)]
    engine = cuda_engine(tiny_model_dir, tiny_adapters[:2], "bfloat16", max_loras=2)
    before = engine.generate([Request("x", prompt_x, GREEDY, "a0"), Request("y", prompt_y, GREEDY, "a1")])
    captured = dict(engine.graphs.decode_graphs)
    assert engine.lora.slot_of("a0") == 0 and captured
    engine.unload_adapter("a0")
    engine.load_adapter("a2", tiny_adapters[2])
    requests = [Request("x", prompt_x, GREEDY, "a2"), Request("y", prompt_y, GREEDY, "a1")]
    after = engine.generate(requests)
    assert engine.lora.slot_of("a2") == 0
    # a2 may end x on another step than a0 did, so a smaller batch bucket can be captured too; the captured ones stay
    assert captured.keys() <= engine.graphs.decode_graphs.keys()
    assert all(engine.graphs.decode_graphs[k][0] is graph for k, (graph, _) in captured.items())
    assert after["x"][0].token_ids != before["x"][0].token_ids  # the new adapter really decodes x
    fresh = cuda_engine(tiny_model_dir, [], "bfloat16", cuda_graphs=False)
    fresh.load_adapter("a2", tiny_adapters[2])
    fresh.load_adapter("a1", tiny_adapters[1])
    assert_streams_agree(fresh.generate(requests), after)


def test_overlapped_graph_decode_gives_the_tokens_of_synchronous_graph_decode(tiny_model_dir, tiny_adapters):
    """Rows without logprobs queue each graph step before the last one's tokens are read (their input tokens copied
    on the device): the same tokens as synchronous steps, for greedy rows, a stop token and seeded draws on the
    device alike."""
    sync = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16", overlap_decode=False)
    overlapped = cuda_engine(tiny_model_dir, tiny_adapters, "bfloat16")
    requests = [
        Request(r.request_id, r.prompt_ids, SamplingParams(max_tokens=r.params.max_tokens, temperature=0.0), r.adapter)
        for r in mixed_requests()
    ]
    greedy = sync.generate(requests)
    stop = greedy["r2"][0].token_ids[9]
    requests[2] = Request(
        "r2", requests[2].prompt_ids, SamplingParams(max_tokens=28, temperature=0.0, stop_token_ids=(stop,)), "a2"
    )
    for i in (1, 4):
        drawn = SamplingParams(max_tokens=requests[i].params.max_tokens, temperature=0.8, top_p=0.9, seed=i)
        requests[i] = Request(f"r{i}", requests[i].prompt_ids, drawn, requests[i].adapter)
    expected = sync.generate(requests)
    assert expected["r1"][0].token_ids != greedy["r1"][0].token_ids  # the device drew them
    for request in requests:
        overlapped.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    queued = 0
    while overlapped.has_work():
        for out in overlapped.step():
            tokens[out.request_id] += out.token_ids
        queued += overlapped._queued is not None
    assert tokens == {rid: c[0].token_ids for rid, c in expected.items()}
    assert expected["r2"][0].finish_reason == "stop" and queued >= 30


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_tails_after_cached_prefixes_replay_prefill_graphs(tiny_model_dir, tiny_adapters, dtype):
    """A prompt's tail after its cached prefix (and each prompt's first chunks: short) runs as a captured prefill
    graph: the tokens and logprobs of an eager engine without the cache, past the window and the relative extent.
    In fp32 every token and logprob to 1e-4; in bf16 (where the cached prefix was computed in other chunks than the
    eager engine's whole prompt) as `test_gpu_serving.compare` holds a batch to its requests alone."""
    eager = cuda_engine(tiny_model_dir, tiny_adapters, dtype, cuda_graphs=False, prefix_cache=False)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, dtype, prefix_cache_min_gain=0)  # every last block cached
    common, params, compared = list(range(10, 90)), replace(GREEDY, logprobs=2), 0
    for shared in (16, 33, 64):
        for k, adapter in ((0, "a0"), (50, "a0"), (100, None)):
            request = Request("r", [*common[:shared], *range(200 + k, 209 + k)], params, adapter)
            expected, got = eager.generate([request]), graphs.generate([request])
            if dtype == "float32":
                assert_close(expected, got, 1e-4)
            else:
                compared += compare(expected["r"][0], got["r"][0])[0]
    assert dtype == "float32" or compared >= 9 * 10  # not every stream split at its first tokens
    assert graphs.prefix_cache.stats.cached_tokens >= 16 + 32 + 64
    assert {(1, 16, True), (1, 16, False)} <= {key[:2] + key[3:] for key in graphs.graphs.extend_graphs}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_step_of_thousands_of_places_replays_as_eager(tiny_model_dir, tiny_adapters, dtype):
    """Four 300-token prompts in one step (4 x 512 places, under the default graph limit) replay one captured
    prefill graph, whose MoE rows take the block dispatch (4,800 rows) and the combine the experts' down LoRA: the
    tokens and logprobs of the eager engine, fp32 to 1e-4, bf16 as `test_gpu_serving.compare` holds a batch to its
    requests alone."""
    big = dict(max_batch_tokens=2048, prefix_cache=False)
    eager = cuda_engine(tiny_model_dir, tiny_adapters, dtype, cuda_graphs=False, **big)
    graphs = cuda_engine(tiny_model_dir, tiny_adapters, dtype, **big)
    gen = torch.Generator().manual_seed(7)
    params = replace(GREEDY, max_tokens=8, logprobs=2)
    requests = [
        Request(f"r{i}", [1, *torch.randint(3, 380, (299,), generator=gen).tolist()], params, adapter)
        for i, adapter in enumerate(("a0", "a1", None, "a0"))
    ]
    expected, got = eager.generate(requests), graphs.generate(requests)
    assert (4, 512) in {key[:2] for key in graphs.graphs.extend_graphs}
    if dtype == "float32":
        assert_close(expected, got, 1e-4)
    else:
        assert sum(compare(expected[r.request_id][0], got[r.request_id][0])[0] for r in requests) >= 16
