"""The MoE dispatch and combine kernels (`triton_moe`) against their torch twins (`torch_ops`): the dispatch equal in
every output (a stable sort, so one right answer), the combine to fp32 rounding. Run by Triton's CPU interpreter in a
child process, and compiled on the GPU at inkling-small's decode and prefill sizes (marked gpu)."""

import os

import pytest
import torch

from inkwell.kernels import torch_ops
from tests.kernels.helpers import ChildRun, assert_close

INTERPRETED = ChildRun.interpreted("tests.kernels.test_moe_rows")


def routed(tokens: int, top_k: int, routed_experts: int, shared: int, beyond: int, seed: int):
    """Each token's top-k distinct routed ids, then the shared ids; `beyond` > 0 maps that many routed ids past the
    last expert (as a rank's model does with the experts other ranks hold)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(routed_experts, generator=gen)[:top_k] for _ in range(tokens)])
    if beyond:
        picks = torch.where(picks >= routed_experts - beyond, routed_experts + shared - beyond, picks)
    index = torch.cat([picks, torch.arange(routed_experts, routed_experts + shared).expand(tokens, -1)], dim=1)
    weights = torch.rand(tokens, top_k + shared, generator=gen).to(torch.bfloat16)
    slots = torch.randint(-1, 4, (tokens,), generator=gen)
    return index, weights, slots, routed_experts + shared - beyond


def check_rows(device: str, tokens: int, top_k: int, routed_experts: int, shared: int, beyond: int) -> None:
    from inkwell.kernels import triton_moe

    index, weights, slots, experts = routed(tokens, top_k, routed_experts, shared, beyond, tokens + beyond)
    expected = torch_ops.moe_dispatch(index, weights, slots, experts)
    got = triton_moe.moe_dispatch(index.to(device), weights.to(device), slots.to(device), experts)
    names = ("order", "tokens", "experts", "weights", "slots", "ends", "places")
    for name, e, g in zip(names, expected, got, strict=True):
        assert g.dtype == e.dtype and torch.equal(g.cpu(), e), f"dispatch {name} differs from the stable argsort's"
    gen = torch.Generator().manual_seed(tokens)
    width = 40
    out = torch.randn(index.numel(), width + 8, generator=gen).to(torch.bfloat16)[:, :width]  # strided rows
    rows_w, places = expected[3], expected[6]
    want = torch_ops.moe_combine(out, rows_w, places, tokens, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        combined = triton_moe.moe_combine(out.to(device), rows_w.to(device), places.to(device), tokens, dtype)
        assert combined.dtype == dtype and combined.shape == (tokens, width)
        assert_close(combined.float(), want.double(), dtype, f"combine into {dtype}")


def check_expert_matmul(device: str, dtype: torch.dtype, tokens: int, width: int, depth: int) -> None:
    """The gate/up form (rows gathered from the tokens) and the down form (rows in place), against per-expert
    GEMMs in float64; rows of 16 routed experts (top 4) and 2 shared ones, so the shared experts hold every token."""
    from inkwell.kernels import triton_moe

    index, weights, slots, experts = routed(tokens, 4, 16, 2, 0, seed=tokens + width)
    _, row_tokens, _, _, _, ends, _ = torch_ops.moe_dispatch(index, weights, slots, experts)
    gen = torch.Generator().manual_seed(depth)
    x = torch.randn(tokens, depth + 8, generator=gen).to(dtype)[:, :depth]  # strided rows
    weight = (torch.randn(experts, width, depth, generator=gen) / depth**0.5).to(dtype)
    for gather in (True, False):
        rows = x[row_tokens] if gather else torch.randn(row_tokens.shape[0], depth, generator=gen).to(dtype)
        expected = torch_ops.expert_matmul(rows.double(), weight.double(), ends, None, tokens)
        d_tokens = row_tokens.to(device) if gather else None
        got = triton_moe.expert_matmul(
            (x if gather else rows).to(device), weight.to(device), ends.to(device), d_tokens, tokens
        )
        assert got.dtype == dtype and got.shape == expected.shape
        assert_close(got, expected, dtype, f"expert_matmul ({'gathered' if gather else 'in place'})")


def check_silu_mul(device: str, dtype: torch.dtype, rows: int, width: int) -> None:
    from inkwell.kernels import triton_moe

    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (3 * torch.randn(rows, 2 * width + 8, generator=gen)).to(dtype)[:, : 2 * width]  # strided rows
    expected = torch_ops.silu_mul(gate_up.double())
    got = triton_moe.silu_mul(gate_up.to(device))
    assert got.dtype == dtype and got.shape == (rows, width)
    assert_close(got, expected, dtype, "silu(gate) * up")


def check_expert_lora_epilogues(device: str, dtype: torch.dtype, tokens: int, hidden: int, ffn: int, rank: int):
    """The experts' gate/up GEMM with its LoRA expand in the epilogue (given the tokens' shrink, or launching it
    first), silu * up with the down LoRA's shrink, and the down GEMM with its expand, against the torch twins'
    GEMM-then-LoRA in float64 on the same rows: 4 slots
    (rows of slot -1 and of every slot), rank `rank` (padded tiles where it is under 16), both expert groups
    covered, and then only the routed experts (the shared experts' rows get no LoRA)."""
    from inkwell.kernels import triton_moe

    index, weights, slots, experts = routed(tokens, 4, 16, 2, 0, seed=tokens + rank)
    _, row_tokens, row_experts, _, row_slots, ends, _ = torch_ops.moe_dispatch(index, weights, slots, experts)
    gen = torch.Generator().manual_seed(hidden + ffn)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up_w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / hidden**0.5).to(dtype)
    down_w = (torch.randn(experts, hidden, ffn, generator=gen) / ffn**0.5).to(dtype)

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    for groups in (torch_ops.ExpertGroups(0, 18, split=16), torch_ops.ExpertGroups(0, 16)):
        g = groups.groups
        y_in = torch.randn(tokens, 2 * g * rank, generator=gen).to(dtype)
        b_in = (torch.randn(4, 2, groups.count, ffn, rank, generator=gen) / rank**0.5).to(dtype)
        a_down = (torch.randn(4, groups.count, rank, ffn, generator=gen) / ffn**0.5).to(dtype)
        b_down = (torch.randn(4, g, hidden, rank, generator=gen) / rank**0.5).to(dtype)
        s_in, s_down = torch.rand(4, 2 * g, generator=gen) + 0.5, torch.rand(4, g, generator=gen) + 0.5
        rows = (row_slots, row_experts)
        what = f"{groups}, {dtype}"
        ref_in = torch_ops.RowExpand(y_in.double(), b_in.double(), *rows, s_in, groups)
        want_gate_up = torch_ops.expert_matmul(x.double(), gate_up_w.double(), ends, row_tokens, tokens, ref_in)
        expand_in = torch_ops.RowExpand(*map(on, (y_in, b_in, *rows, s_in)), groups)
        gate_up = triton_moe.expert_matmul(on(x), on(gate_up_w), on(ends), on(row_tokens), tokens, expand_in)
        assert_close(gate_up, want_gate_up, dtype, f"gate/up GEMM with its expand ({what})")
        a_in = (torch.randn(4, 2 * g * rank, hidden, generator=gen) / hidden**0.5).to(dtype)
        shrink = torch_ops.TokenShrink(a_in.double(), slots)
        ref_shrunk = torch_ops.RowExpand(shrink, b_in.double(), *rows, s_in, groups)
        want = torch_ops.expert_matmul(x.double(), gate_up_w.double(), ends, row_tokens, tokens, ref_shrunk)
        shrink = torch_ops.TokenShrink(on(a_in), on(slots))
        expand_shrunk = torch_ops.RowExpand(shrink, *map(on, (b_in, *rows, s_in)), groups)
        got = triton_moe.expert_matmul(on(x), on(gate_up_w), on(ends), on(row_tokens), tokens, expand_shrunk)
        assert_close(got, want, dtype, f"gate/up GEMM after the tokens' shrink ({what})")
        want_act, want_y = torch_ops.silu_mul_shrink(gate_up.cpu().double(), a_down.double(), *rows, groups)
        act, y = triton_moe.silu_mul_shrink(gate_up, on(a_down), *map(on, rows), groups)
        assert_close(act, want_act, dtype, f"silu * up beside the shrink ({what})")
        assert_close(y, want_y, dtype, f"the down LoRA's shrink in silu * up ({what})")
        ref_down = torch_ops.RowExpand(y.cpu().double(), b_down.double(), *rows, s_down, groups)
        want_down = torch_ops.expert_matmul(act.cpu().double(), down_w.double(), ends, None, tokens, ref_down)
        expand_down = torch_ops.RowExpand(y, *map(on, (b_down, *rows, s_down)), groups)
        down = triton_moe.expert_matmul(act, on(down_w), on(ends), None, tokens, expand_down)
        assert_close(down, want_down, dtype, f"down GEMM with its expand ({what})")


def check_silu_mul_lora(device: str, dtype: torch.dtype, tokens: int, ffn: int, rank: int) -> None:
    """silu * up with the gate/up LoRA added as the rows are read, against the torch twin (the in-place expand of a
    copy, then silu * up) in float64: rows sorted by expert from tokens of 4 slots and slot -1 (tiles of several
    (slot, expert) groups), both groups covered, then the routed experts only; the rows themselves left as they were."""
    from inkwell.kernels import triton_moe

    index, weights, slots, experts = routed(tokens, 4, 16, 2, 0, seed=tokens + ffn)
    _, row_tokens, row_experts, _, row_slots, _, _ = torch_ops.moe_dispatch(index, weights, slots, experts)
    gen = torch.Generator().manual_seed(ffn + rank)
    gate_up = (3 * torch.randn(index.numel(), 2 * ffn, generator=gen)).to(dtype)
    for groups in (torch_ops.ExpertGroups(0, 18, split=16), torch_ops.ExpertGroups(0, 16)):
        g = groups.groups
        y = torch.randn(tokens, 2 * g * rank, generator=gen).to(dtype)
        b = (torch.randn(4, 2, groups.count, ffn, rank, generator=gen) / rank**0.5).to(dtype)
        scalings = torch.rand(4, 2 * g, generator=gen) + 0.5
        rows = (row_slots, row_experts)
        ref = torch_ops.RowExpand(y.double(), b.double(), *rows, scalings.double(), groups)
        want = torch_ops.silu_mul(gate_up.double(), ref, row_tokens)
        on = [t.to(device) for t in (gate_up, y, b, *rows, scalings, row_tokens)]
        got = triton_moe.silu_mul(on[0], torch_ops.RowExpand(*on[1:6], groups), on[6])
        assert got.dtype == dtype and got.shape == (index.numel(), ffn)
        assert_close(got, want, dtype, f"silu * up with the gate/up LoRA ({groups}, {dtype}, {tokens} tokens)")
        assert torch.equal(on[0].cpu(), gate_up), "silu * up with the gate/up LoRA wrote to its input"


def check_combine_down(device: str, dtype: torch.dtype, tokens: int, width: int, rank: int) -> None:
    """The combine with the experts' down LoRA (each token's rows' shrunk y weighted and summed, then expanded once
    per group) against the torch twin's per-row expand then combine, in float64: 4 slots and slot -1 (tokens of
    several slots share a tile), both groups covered, then the routed experts only (shared rows' y ignored)."""
    from inkwell.kernels import triton_moe

    index, weights, slots, experts = routed(tokens, 4, 16, 2, 0, seed=tokens + width)
    _, _, row_experts, row_w, row_slots, _, places = torch_ops.moe_dispatch(index, weights, slots, experts)
    gen = torch.Generator().manual_seed(rank)
    rows = index.numel()
    out = torch.randn(rows, width, generator=gen).to(dtype)
    y = torch.randn(rows, rank, generator=gen).to(dtype)  # uncovered rows too: the kernel must skip them
    for groups in (torch_ops.ExpertGroups(0, 18, split=16), torch_ops.ExpertGroups(0, 16)):
        g = groups.groups
        b = (torch.randn(4, g, width, rank, generator=gen) / rank**0.5).to(dtype)
        scalings = torch.rand(4, g, generator=gen) + 0.5
        ref = torch_ops.RowExpand(y.double(), b.double(), row_slots, row_experts, scalings.double(), groups)
        want = torch_ops.moe_combine(out.double(), row_w.double(), places, tokens, torch.float64, ref)
        on = [t.to(device) for t in (y, b, row_slots, row_experts, scalings)]
        got = triton_moe.moe_combine(
            out.to(device), row_w.to(device), places.to(device), tokens, dtype, torch_ops.RowExpand(*on, groups)
        )
        assert got.dtype == dtype and got.shape == (tokens, width)
        assert_close(got, want, dtype, f"combine with the down LoRA ({groups}, {dtype}, {tokens} tokens)")


CASES = [  # (tokens, top_k, routed, shared, beyond): decode, rows across sort blocks (> 256), a rank's share, prefill
    (8, 4, 16, 2, 0),
    (61, 4, 16, 2, 0),
    (9, 2, 8, 2, 3),
    (1, 1, 4, 1, 0),
    (300, 4, 16, 2, 0),  # past ONE_PROGRAM_MAX_ROWS: counted and placed by blocks
    (700, 2, 8, 2, 3),
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in CASES:
        check_rows("cpu", *case)
    for dtype in (torch.float32, torch.float16):
        for tokens, width, depth in ((8, 72, 136), (40, 64, 40)):  # partial column and K blocks; 40 rows > 16
            check_expert_matmul("cpu", dtype, tokens, width, depth)
        check_silu_mul("cpu", dtype, 5, 40)
        check_expert_lora_epilogues("cpu", dtype, 6, 40, 48, 8)  # 48 columns a part: 16-column tiles; rank < 16
        check_expert_lora_epilogues("cpu", dtype, 40, 40, 48, 16)  # 64-row tiles holding rows of every slot
        check_combine_down("cpu", dtype, 21, 72, 8)  # two token tiles, a partial one; partial column tiles, rank < 16
        check_silu_mul_lora("cpu", dtype, 21, 40, 8)  # 4 row tiles, a partial one; a partial column tile, rank < 16
    # rank 64: silu * up's shrink walks 128-column blocks of A, the last one partial
    check_expert_lora_epilogues("cpu", torch.float32, 6, 40, 320, 64)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_moe_rows_match_torch_in_interpreter():
    INTERPRETED.check()


def test_torch_dispatch_sorts_stably_and_combines_in_token_order():
    """The torch twin itself: rows grouped by expert with each group in token order, ends as counts, places the
    inverse of order, and the combine each token's weighted rows."""
    index, weights, slots, experts = routed(5, 2, 6, 1, 0, seed=3)
    order, tokens, expert_of, row_w, row_slots, ends, places = torch_ops.moe_dispatch(index, weights, slots, experts)
    assert torch.equal(expert_of, index.reshape(-1)[order]) and bool((expert_of.diff() >= 0).all())
    for e in range(experts):
        assert torch.equal(tokens[expert_of == e], torch.sort(tokens[expert_of == e]).values)
        assert int(ends[e]) == int((index <= e).sum())
    assert torch.equal(order[places], torch.arange(index.numel())) and torch.equal(row_slots, slots[tokens])
    out, k = torch.randn(index.numel(), 3), index.shape[1]
    combined = torch_ops.moe_combine(out, row_w, places, 5, torch.float32)
    expected = torch.stack([sum(out[places[t * k + j]] * float(weights[t, j]) for j in range(k)) for t in range(5)])
    assert torch.allclose(combined, expected, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8, 128, 8192])
def test_moe_rows_on_gpu(tokens):
    check_rows("cuda", tokens, 4, 16, 2, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 128, 256])
def test_expert_matmul_on_gpu_at_inkling_small_widths(dtype, tokens):
    check_expert_matmul("cuda", dtype, tokens, 1024, 2048)  # gate/up
    check_expert_matmul("cuda", dtype, tokens, 2048, 512)  # down
    check_silu_mul("cuda", dtype, tokens * 6, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 300, 2048])
def test_combine_with_the_down_lora_on_gpu(dtype, tokens):
    check_combine_down("cuda", dtype, tokens, 2048, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300, 2048])
def test_silu_mul_with_the_gate_up_lora_on_gpu(dtype, tokens):
    check_silu_mul_lora("cuda", dtype, tokens, 512, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 32, 128])  # 16-, 32- and 64-row tiles
def test_expert_lora_epilogues_on_gpu_at_inkling_small_widths(dtype, tokens):
    check_expert_lora_epilogues("cuda", dtype, tokens, 2048, 512, 16)
