"""The capturable decode forward (bucketed batch, fixed key length, device-sorted experts) against the eager
forward on the CPU: same logits and same sequence state, with mixed adapters, base rows and padding rows,
past the sliding window and the relative extent. The capture itself is tested in test_graph_gpu.py."""

import numpy as np
import pytest
import torch

from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.graphs import StepGraphs, batch_buckets, chunk_bucket, context_bucket
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import ForwardBatch, InklingModel, Segment, padded_groups
from inkwell.serving.native.state import StatePool
from inkwell.serving.settings import ServingSettings

MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    model = InklingModel(config, load_base_weights(tiny_model_dir))
    lora = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=5, max_rank=16)
    for i, adapter in enumerate(tiny_adapters):
        assert lora.place(f"a{i}", adapter) == i
    return config, model, lora


def batch_of(ids: list[int], lora_slots: list[int], segments: list[Segment], logit_rows: list[int]) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        lora_slots=torch.tensor(lora_slots),
        segments=segments,
        logit_rows=torch.tensor(logit_rows),
    )


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert context_bucket(0, 4096) == 256 and context_bucket(255, 4096) == 256
    assert context_bucket(256, 4096) == 512 and context_bucket(3000, 4096) == 4096
    assert context_bucket(40, 96) == 96


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "all_experts"])
def test_bucketed_decode_equals_eager_forward(tiny, grouped_mm):
    config, model, lora = tiny
    eager = StatePool(config, 6, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    pool = StatePool(config, 7, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    graphs = StepGraphs(model, pool, lora, max_batch=8, grouped_mm=grouped_mm)
    assert graphs.decode_forward.grouped_mm is grouped_mm
    prompts = [[1, *range(5 + 3 * i, 16 + 4 * i)] for i in range(5)]  # 12..28 tokens
    adapters = [0, 2, -1, 4, 1]  # every adapter shape of conftest's SPECS, and a base-model row
    eager_slots = [eager.acquire() for _ in prompts]
    pool_slots = [pool.acquire() for _ in prompts]
    assert graphs.scratch not in pool_slots

    # The same eager prefill into both pools.
    ids, lslots, rows, first = [], [], [], 0
    for prompt, adapter in zip(prompts, adapters, strict=True):
        ids += prompt
        lslots += [adapter] * len(prompt)
        first += len(prompt)
        rows.append(first - 1)
    for state, slots in ((eager, eager_slots), (pool, pool_slots)):
        starts = [0, *[len(p) for p in prompts]]
        segments = [Segment(s, 0, n) for s, n in zip(slots, starts[1:], strict=True)]
        logits = model.forward(batch_of(ids, lslots, segments, rows), state, lora)

    tokens = [int(t) for t in logits.argmax(-1)]
    positions = [len(p) for p in prompts]
    live = list(range(len(prompts)))
    worst = 0.0
    for step in range(40):  # positions up to 67: past the window (24) and the relative extent (48)
        if step == 25:
            live.remove(3)  # 4 rows: the 4-bucket, no padding
        if step == 32:
            live.remove(0)  # 3 rows in the 4-bucket
        segments = [Segment(eager_slots[i], positions[i], 1) for i in live]
        recorded = []
        expected = model.forward(
            batch_of([tokens[i] for i in live], [adapters[i] for i in live], segments, list(range(len(live)))),
            eager,
            lora,
            recorded,
        )
        got, greedy, routing = graphs.decode(
            [tokens[i] for i in live],
            [pool_slots[i] for i in live],
            [positions[i] for i in live],
            [adapters[i] for i in live],
        )
        assert got.shape == expected.shape
        assert greedy.tolist() == got.argmax(-1).tolist()
        assert torch.equal(routing().sort(-1).values, model.routing_table(recorded, len(live)).sort(-1).values)
        worst = max(worst, (got - expected).abs().max().item())
        for row, i in enumerate(live):
            tokens[i] = int(expected[row].argmax())
            positions[i] += 1
    assert worst < 1e-5

    # Every real sequence's state is the eager one; padding touched only the scratch slot.
    for layer in range(config.num_hidden_layers):
        for mine, theirs in ((pool.keys, eager.keys), (pool.values, eager.values)):
            assert (mine[layer][pool_slots] - theirs[layer][eager_slots]).abs().max().item() < 1e-5
        for site in range(len(pool.conv[layer])):
            diff = pool.conv[layer][site][pool_slots] - eager.conv[layer][site][eager_slots]
            assert diff.abs().max().item() < 1e-5
        untouched = [s for s in range(pool.max_seqs) if s not in pool_slots and s != graphs.scratch]
        assert not pool.keys[layer][untouched].any() and not pool.conv[layer][0][untouched].any()


def test_base_only_batch_skips_lora_and_equals_eager(tiny):
    config, model, lora = tiny
    eager = StatePool(config, 2, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    pool = StatePool(config, 3, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    graphs = StepGraphs(model, pool, lora, max_batch=2)
    e, p = eager.acquire(), pool.acquire()
    prompt = list(range(1, 30))
    for state, slot in ((eager, e), (pool, p)):
        model.forward(batch_of(prompt, [-1] * 29, [Segment(slot, 0, 29)], [28]), state, lora)
    expected = model.forward(batch_of([7], [-1], [Segment(e, 29, 1)], [0]), eager, lora)
    assert (graphs.decode([7], [p], [29], [-1]).logits - expected).abs().max().item() < 1e-5


def test_every_step_of_the_services_budget_pads_within_the_default_prefill_graphs():
    """Whatever its chunks, a step of the service's defaults (`ServingSettings`: 16 sequences, 256 tokens) pads to
    at most EngineConfig's `graph_prefill_tokens` places (the sequences' last bucket x the longest chunk's), so on
    CUDA every such step replays a captured graph instead of issuing its launches from the host."""
    settings = ServingSettings()
    worst = batch_buckets(settings.max_seqs)[-1] * chunk_bucket(settings.max_batch_tokens)
    assert worst <= EngineConfig.graph_prefill_tokens, (worst, EngineConfig.graph_prefill_tokens)


def test_prefill_chunks_equal_eager_forward(tiny):
    """Prefill chunks through the bucketed chunk forward give the eager forward's logits and routing and leave each
    sequence the eager state: chunks with padding places, padding chunks, a one-token chunk beside longer ones,
    chunks continuing a sequence from fewer tokens than its ShortConv keeps and past the window (24) and the
    relative extent (48), mixed adapters and a base row. Padding writes only the scratch slot."""
    config, model, lora = tiny
    eager = StatePool(config, 4, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    pool = StatePool(config, 6, MAX_CONTEXT, torch.float32, torch.device("cpu"))
    graphs = StepGraphs(model, pool, lora, max_batch=4, extend_tokens=4 * 32)
    eager_slots, pool_slots = [eager.acquire() for _ in range(4)], [pool.acquire() for _ in range(4)]
    assert graphs.scratch not in pool_slots
    prompts = [[1, *range(3 + 7 * i, 88 + 7 * i)] for i in range(4)]  # 86 tokens each
    adapters = [0, -1, 3, 2]
    steps = [  # (sequence, tokens) per chunk
        [(0, 2), (1, 17), (2, 1), (3, 30)],
        [(0, 30), (1, 9), (3, 5)],  # 4-bucket with one padding chunk
        [(0, 20), (1, 30), (2, 28), (3, 30)],
        [(2, 30), (0, 1)],
        [(2, 26), (1, 30), (0, 33)],  # 33 tokens: the 64-places bucket, batch 2 would do but 3 chunks need 4
    ]
    computed, worst = [0] * 4, 0.0
    for step in steps:
        if graphs.extend_bucket([n for _, n in step]) is None:
            graphs.extend_tokens = 4 * 64
        ids, lslots, segments, rows = [], [], [], []
        for seq, n in step:
            ids += prompts[seq][computed[seq] : computed[seq] + n]
            lslots += [adapters[seq]] * n
            segments.append(Segment(eager_slots[seq], computed[seq], n))
            rows.append(len(ids) - 1)
        recorded: list[torch.Tensor] = []
        expected = model.forward(batch_of(ids, lslots, segments, rows), eager, lora, recorded)
        got, greedy, routing = graphs.extend(
            ids,
            [pool_slots[seq] for seq, _ in step],
            [computed[seq] for seq, _ in step],
            [n for _, n in step],
            [adapters[seq] for seq, _ in step],
        )
        assert got.shape == expected.shape
        assert greedy.tolist() == got.argmax(-1).tolist()
        table = routing()
        real = torch.cat([table[i, :n] for i, (_, n) in enumerate(step)])
        assert torch.equal(real.sort(-1).values, model.routing_table(recorded, len(ids)).sort(-1).values)
        worst = max(worst, (got - expected).abs().max().item())
        for seq, n in step:
            computed[seq] += n
    assert worst < 1e-5
    for inputs in graphs.extend_inputs.values():  # the LoRA kernels read slots with stride 1
        assert all(t.is_contiguous() for t in (inputs.seq_slots, inputs.starts, inputs.lengths, inputs.lora_slots))
    for layer in range(config.num_hidden_layers):
        for mine, theirs in ((pool.keys, eager.keys), (pool.values, eager.values)):
            if pool.sliding[layer]:
                diff = mine[layer][pool_slots] - theirs[layer][eager_slots]
            else:  # a slot's keys past its computed tokens are never read
                diff = torch.cat(
                    [
                        mine[layer][p, :c] - theirs[layer][e, :c]
                        for p, e, c in zip(pool_slots, eager_slots, computed, strict=True)
                    ]
                )
            assert diff.abs().max().item() < 1e-5
        for site in range(len(pool.conv[layer])):
            diff = pool.conv[layer][site][pool_slots] - eager.conv[layer][site][eager_slots]
            assert diff.abs().max().item() < 1e-5
        untouched = [s for s in range(pool.max_seqs) if s not in pool_slots and s != graphs.scratch]
        assert not pool.keys[layer][untouched].any() and not pool.conv[layer][0][untouched].any()


@pytest.mark.parametrize("extend_tokens", [0, 256])
def test_engine_decode_steps_go_through_the_decode_graphs(tiny_model_dir, tiny_adapters, extend_tokens):
    """The engine's pure decode steps through the bucketed decode forward give the eager engine's tokens, logprobs
    and routing traces (stacked from the step's per-layer buffers), while other requests prefill in between: eagerly,
    or with `extend_tokens` through the bucketed prefill forward, whose routing comes out the same way."""
    config = EngineConfig(max_loras_per_batch=5, max_lora_rank=16, max_seqs=7, max_batch_tokens=24)
    plain, bucketed = Engine(tiny_model_dir, config), Engine(tiny_model_dir, config)
    graphs = StepGraphs(bucketed.model, bucketed.state, bucketed.lora, config.max_seqs, extend_tokens=extend_tokens)
    sizes: list[int] = []
    decode = graphs.decode
    graphs.decode = lambda *rows: sizes.append(len(rows[0])) or decode(*rows)
    bucketed.graphs = graphs
    for engine in (plain, bucketed):
        for i, adapter in enumerate(tiny_adapters):
            engine.load_adapter(f"a{i}", adapter)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2, return_routing=True)
    requests = [
        Request(f"r{i}", [1, *range(9 + i, 20 + 3 * i)], params, None if i == 5 else f"a{i % 5}") for i in range(6)
    ]
    expected, got = plain.generate(requests), bucketed.generate(requests)
    assert max(sizes) == 6 and min(sizes) < 6 and len(sizes) < plain.steps
    for r in requests:
        a, b = expected[r.request_id][0], got[r.request_id][0]
        assert b.token_ids == a.token_ids
        diff = torch.tensor([x.logprob for x in a.logprobs]) - torch.tensor([x.logprob for x in b.logprobs])
        assert diff.abs().max().item() < 1e-5
        assert len(b.routing) == len(b.token_ids) and (np.sort(b.routing, -1) == np.sort(a.routing, -1)).all()


def test_prefill_grouped_expert_gemms_equal_one_gemm_per_expert(tiny):
    """The prefill forward's experts as one grouped GEMM each (the default) and as one GEMM per expert give the
    same logits and the same sequence state, over prompts of several lengths with mixed adapters."""
    config, model, lora = tiny
    prompts = [[1, *range(7 + 2 * i, 19 + 5 * i)] for i in range(4)]  # 13..28 tokens
    ids = [t for p in prompts for t in p]
    lslots = [s for p, s in zip(prompts, [3, -1, 0, 2], strict=True) for _ in p]
    results = []
    try:
        for grouped in (True, False):
            model.grouped_mm = grouped
            state = StatePool(config, 4, MAX_CONTEXT, torch.float32, torch.device("cpu"))
            slots = [state.acquire() for _ in prompts]
            ends = torch.tensor([len(p) for p in prompts]).cumsum(0)
            segments = [Segment(s, 0, len(p)) for s, p in zip(slots, prompts, strict=True)]
            logits = model.forward(batch_of(ids, lslots, segments, (ends - 1).tolist()), state, lora)
            results.append((logits, state))
    finally:
        model.grouped_mm = True
    (grouped, g_state), (looped, l_state) = results
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    for layer in range(config.num_hidden_layers):
        torch.testing.assert_close(g_state.keys[layer], l_state.keys[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_state.conv[layer][-1], l_state.conv[layer][-1], rtol=1e-5, atol=1e-5)


def test_chunks_are_padded_together_only_where_padding_costs_little():
    def groups(*segments: tuple[int, int]) -> list[list[tuple[int, int]]]:
        rows = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
        chunks = [(row, Segment(i, start, n)) for i, (row, (start, n)) in enumerate(zip(rows, segments, strict=True))]
        found = padded_groups(chunks)
        assert sorted(seg.seq_slot for group in found for _, seg in group) == list(range(len(segments)))
        return [sorted((seg.start, seg.length) for _, seg in group) for group in found]

    assert groups(*[(0, 128)] * 8) == [[(0, 128)] * 8]  # equal new prompts: one padded batch
    # one long chunk pads at most one short one (2,000 padded tokens for 1,002), not all seven (8,000 for 1,014)
    assert groups((0, 1000), *[(0, 2)] * 7) == [[(0, 2), (0, 1000)], [(0, 2)] * 6]
    # a chunk deep into its sequence attends to 4,128 keys: the new prompts do not all pad out to its history
    assert groups(*[(0, 128)] * 3, (4000, 128), *[(0, 128)] * 4) == [[(0, 128), (4000, 128)], [(0, 128)] * 6]
    assert groups((0, 30), (0, 24), (10, 20)) == [[(0, 24), (0, 30), (10, 20)]]


def test_a_flat_group_of_chunks_is_a_view_of_the_batch_rows():
    def batch(*segments: Segment) -> ForwardBatch:
        tokens = sum(seg.length for seg in segments)
        return batch_of(list(range(tokens)), [-1] * tokens, list(segments), [tokens - 1])

    x = torch.arange(12.0)[:, None].repeat(1, 3)
    # equal chunks back to back (the second deeper in its sequence, so grouping lists it first): one flat group
    whole = batch(Segment(0, 0, 4), Segment(1, 6, 4), Segment(2, 0, 4)).whole
    assert whole is not None and whole.first == 0
    # the kernels read the chunk columns by flat index: each is a contiguous tensor, not a strided column
    assert all(t.is_contiguous() for t in (whole.slots, whole.starts, whole.lengths))
    table = whole.gather(x)
    assert table.shape == (3, 4, 3) and table.data_ptr() == x.data_ptr()
    assert torch.equal(table, x[whole.rows])
    out = torch.zeros_like(x)
    whole.scatter(table * 2, out)
    assert torch.equal(out, x * 2)
    for window in (None, 4, 2):  # every token kept (a view of the rows), then each chunk's last two
        kept = whole.kept(x, window)
        assert torch.equal(kept, x[whole.stored(window)[0]])
        assert (kept.data_ptr() == x.data_ptr()) == (window != 2)
    # chunks of two lengths pad; a decode row between chunks leaves them apart: no flat group, no whole batch
    ragged = batch(Segment(0, 0, 4), Segment(1, 0, 3))
    assert ragged.whole is None and ragged.split[1][0].first is None
    assert torch.equal(ragged.split[1][0].gather(x[:7]), x[:7][ragged.split[1][0].rows])
    mixed = batch(Segment(0, 0, 4), Segment(1, 9, 1), Segment(2, 0, 4))
    assert mixed.whole is None and mixed.split[1][0].first is None


def test_stored_keys_are_each_chunks_last_window_of_tokens():
    segments = [Segment(4, 10, 6), Segment(7, 0, 2), Segment(9, 30, 5)]
    tokens = sum(seg.length for seg in segments)
    groups = batch_of(list(range(tokens)), [-1] * tokens, segments, [tokens - 1]).split[1]
    rows = [0, 6, 8]  # each chunk's first batch row

    def expected(window: int | None) -> list[tuple[int, int, int]]:
        return [
            (row + j, seg.seq_slot, seg.start + j)
            for row, seg in zip(rows, segments, strict=True)
            for j in range(seg.length)
            if window is None or j >= seg.length - window
        ]

    for window in (None, 3, 8):
        got = sorted(cell for g in groups for cell in zip(*(t.tolist() for t in g.stored(window)), strict=True))
        assert got == sorted(expected(window)), window
