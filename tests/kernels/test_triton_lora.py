"""The Triton multi-LoRA kernels on the GPU against their torch twins (float64 on CPU), at serving shapes.

Ranks 8-64 with mixed ranks per batch (odd slots zero-padded to a smaller rank), 1-16 adapters, slots
left empty, base-model tokens, decode and prefill sizes, bf16 and fp32; CUDA-graph replays that see
new slot contents without recapture.
"""

import os
import subprocess
import sys

import pytest
import torch

from inkwell.kernels import dispatch, torch_ops
from tests.kernels.helpers import assert_close
from tests.kernels.lora_checks import (
    check_expand_walk,
    check_experts,
    check_linear,
    check_plain_linear,
    check_projection,
    check_sliced,
    make_slots,
    padded_factors,
)

pytestmark = pytest.mark.gpu

QKVR = (0, 2048, 2560, 3072, 3328)
GATE_UP = (0, 5632, 11264)


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens,num_slots,used,rank",
    [
        (1, 1, 1, 16),
        (8, 8, 8, 16),
        (8, 16, 3, 8),
        (32, 16, 16, 64),
        (64, 4, 4, 32),
        (65, 4, 2, 16),
        (128, 8, 8, 16),
        (256, 16, 9, 16),
        (300, 8, 5, 64),
        (4096, 8, 8, 16),
    ],
)
def test_linear_ops_match_torch(dtype, tokens, num_slots, used, rank):
    check_linear(dispatch, "cuda", dtype, tokens, num_slots, used, rank, k=2048, n=2048)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,n", [(1, 18), (8, 18), (32, 18), (64, 64), (8, 3328), (64, 4096), (100, 2048)])
def test_decode_gemm_matches_torch(dtype, tokens, n):
    """The decode GEMM chained into the step, at the router's gate and at projection widths."""
    from inkwell.kernels.triton_lora import dense

    check_plain_linear(dense, "cuda", dtype, tokens, k=2048, n=n)


@pytest.mark.parametrize("tokens,n", [(8, 18), (129, 18), (8, 3328)])
def test_linear_matches_torch(tokens, n):
    """`linear` as the engine calls it: the chained GEMM for the gate at decode sizes, cuBLAS elsewhere."""
    check_plain_linear(dispatch, "cuda", torch.bfloat16, tokens, k=2048, n=n)


@pytest.mark.parametrize("offsets", [QKVR, GATE_UP])
@pytest.mark.parametrize("tokens,rank", [(8, 16), (32, 64), (512, 16)])
def test_sliced_ops_match_torch(offsets, tokens, rank):
    check_sliced(dispatch, "cuda", torch.bfloat16, tokens, num_slots=8, rank=rank, k=2048, offsets=offsets)


@pytest.mark.parametrize("tokens,offsets", [(128, QKVR), (128, (0, 32000)), (64, (0, 2048)), (200, GATE_UP)])
def test_expand_walk_matches_torch(tokens, offsets):
    """The expand past the one-launch sizes with each slot's programs and walking each tile's slots, 8 adapters."""
    from inkwell.kernels.triton_lora import expand

    check_expand_walk(expand, "cuda", torch.bfloat16, tokens, num_slots=8, rank=16, offsets=offsets)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens,num_slots,rank,offsets",
    [
        (1, 2, 16, (0, 2048)),
        (8, 9, 16, QKVR),
        (8, 17, 8, GATE_UP),
        (32, 9, 64, QKVR),
        (64, 9, 16, QKVR),
        (64, 4, 16, (0, 2048)),
        (64, 5, 16, GATE_UP),
        (20, 5, 32, (0, 32000)),
        (100, 9, 16, QKVR),
        (128, 5, 16, (0, 2048)),
        (96, 4, 8, QKVR),
    ],
)
def test_projection_matches_torch(dtype, tokens, num_slots, rank, offsets):
    """Base GEMM and LoRA in one launch (past 32 tokens for narrow projections only; past 64 in 64-token tiles, 64
    columns wide where 32-column ones would outnumber the SMs: q/k/v/r, not o): 1-16 adapters (the last slot empty),
    ranks 8-64, an lm_head's N."""
    check_projection(dispatch, "cuda", dtype, tokens, num_slots, rank, k=2048, offsets=offsets)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows,rank,covered", [(48, 16, "both"), (2048, 32, "both"), (128, 64, "routed"), (96, 8, "shared")]
)
def test_expert_ops_match_torch(dtype, rows, rank, covered):
    """Dispatched rows of 16 routed + 2 shared experts (decode: 8 tokens x 6 rows), the LoRA over `covered`."""
    check_experts(dispatch, "cuda", dtype, rows, num_slots=8, experts=16, rank=rank, k=512, n=2048, covered=covered)


def test_all_base_and_empty_batches():
    x = torch.randn(6, 256, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(4, 16, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 512, 16, device="cuda", dtype=torch.bfloat16)
    slots = torch.full((6,), -1, device="cuda")
    assert torch.equal(dispatch.lora_shrink(x, a, slots), torch.zeros(6, 16, device="cuda", dtype=torch.bfloat16))
    out = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16)
    before = out.clone()
    dispatch.lora_shrink_expand(x, a, b, slots, torch.ones(4, device="cuda"), out)
    dispatch.lora_expand(torch.randn_like(x[:, :16]), b, slots, torch.ones(4, device="cuda"), out)
    assert torch.equal(out, before)
    empty = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    assert dispatch.lora_shrink(empty, a, slots[:0]).shape == (0, 16)


def test_shrink_writes_every_row_over_poisoned_memory():
    """torch.empty reuses the freed NaN block: any row the kernel skipped would stay NaN."""
    gen = torch.Generator().manual_seed(3)
    tokens, rank = 333, 32
    slots = make_slots(tokens, 6, 4, gen)
    x = torch.randn(tokens, 1024, generator=gen, dtype=torch.float64)
    a, _ = padded_factors(6, rank, 1024, 16, gen)
    args = (x.to("cuda", torch.bfloat16), a.to("cuda", torch.bfloat16), slots.cuda())
    torch.full((tokens, rank), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = dispatch.lora_shrink(*args)
    assert_close(y, torch_ops.lora_shrink(x, a, slots), torch.bfloat16, "poisoned lora_shrink")


@pytest.mark.parametrize("tokens", [8, 256])
def test_cuda_graph_replay_sees_new_slot_contents_and_slots(tokens):
    """A captured step keeps its launches; swapping an adapter into a slot only rewrites buffers."""
    gen = torch.Generator().manual_seed(tokens)
    num_slots, rank, k, n = 8, 16, 2048, 3328
    dev = dict(device="cuda", dtype=torch.bfloat16)
    a64, b64 = padded_factors(num_slots, rank, k, n, gen, parts=4)
    scal = torch.rand(num_slots, 4, generator=gen) + 0.5
    x64 = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    a, b, scalings = a64.to(**dev), b64.to(**dev), scal.cuda()
    x, slots = x64.to(**dev), make_slots(tokens, num_slots, num_slots, gen).cuda()
    base = torch.randn(tokens, n, generator=gen, dtype=torch.float64).to(**dev)
    weight = (torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5).to(**dev)
    out, projected = base.clone(), base.clone()

    def step():
        out.copy_(base)
        dispatch.lora_shrink_expand(x, a, b, slots, scalings, out, QKVR)
        projected.copy_(dispatch.lora_linear(x, weight, a, b, slots, scalings, QKVR))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    new_a, new_b = padded_factors(1, rank, k, n, gen, parts=4)
    a64[2], b64[2] = new_a[0], new_b[0]
    a[2].copy_(a64[2].to(**dev))
    b[2].copy_(b64[2].to(**dev))
    new_slots = make_slots(tokens, num_slots, num_slots, gen)
    slots.copy_(new_slots)
    for _ in range(3):  # replays run the same launches again: the same result
        graph.replay()
    torch.cuda.synchronize()

    ref = base.cpu().double()
    for p, (lo, hi) in enumerate(zip(QKVR, QKVR[1:], strict=False)):
        a_p = a.cpu().double()[:, p * rank : (p + 1) * rank]
        y_p = torch_ops.lora_shrink(x.cpu().double(), a_p, new_slots)
        torch_ops.lora_expand(y_p, b.cpu().double()[:, lo:hi], new_slots, scal[:, p].double(), ref[:, lo:hi])
    assert_close(out, ref, torch.bfloat16, "graph replay after swap")
    ref_projected = ref - base.cpu().double() + x.cpu().double() @ weight.cpu().double().t()
    assert_close(projected, ref_projected, torch.bfloat16, "lora_linear in graph replays after swap")


LINEAR_AT_DECODE = """
import torch
from inkwell.kernels import lora_linear
x = torch.randn(8, 2048, dtype=torch.bfloat16, device="cuda")
w = torch.randn(3072, 2048, dtype=torch.bfloat16, device="cuda")
a = torch.randn(2, 16, 2048, dtype=torch.bfloat16, device="cuda")
b = torch.randn(2, 3072, 16, dtype=torch.bfloat16, device="cuda")
lora_linear(x, w, a, b, torch.tensor([0, 1] * 4, device="cuda"), torch.ones(2, device="cuda"))
torch.cuda.synchronize()
"""


def test_decode_shrink_lets_the_gemm_beside_it_start(tmp_path):
    """`lora_linear` at decode sizes runs its GEMM beside the split shrink only if the shrink triggers its
    dependent launch (without the trigger the GEMM starts once every shrink program has exited: the two in
    series, ~265 µs a step on inkling-small), after its own wait (the GEMM reads x unwaited), and the GEMM waits for
    it, then lets the next kernel launch: read from the PTX Triton compiled."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", LINEAR_AT_DECODE], env=env, check=True, timeout=300)

    def ptx(kernel: str) -> list[str]:
        return [p.read_text() for p in tmp_path.rglob(f"{kernel}.ptx")]

    shrinks, gemms = ptx("_split_shrink_kernel"), ptx("_linear_kernel")
    assert shrinks and gemms, f"no PTX cached for the decode shrink or GEMM under {tmp_path}"
    for text in shrinks + gemms:
        wait, trigger = text.find("griddepcontrol.wait"), text.find("griddepcontrol.launch_dependents")
        assert -1 < wait < trigger, (wait, trigger)


GEMM_IN_CHAIN = """
import torch
from inkwell.kernels import linear
x = torch.randn(8, 2048, dtype=torch.bfloat16, device="cuda")
linear(x, torch.randn(18, 2048, dtype=torch.bfloat16, device="cuda"))  # a router's gate
torch.cuda.synchronize()
"""


def test_decode_gemm_streams_its_weight_before_it_waits(tmp_path):
    """`linear` at a router gate's width runs the decode GEMM chained into the step, which lets the next kernel
    launch, asks L2 for its weight rows, and only then waits for the kernel before it (whose output x it reads): read
    from the PTX Triton compiled. Without the early trigger or with the prefetch after the wait, it overlaps nothing."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", GEMM_IN_CHAIN], env=env, check=True, timeout=300)
    texts = [p.read_text() for p in tmp_path.rglob("_linear_kernel.ptx")]
    assert texts, f"no PTX cached for the decode GEMM under {tmp_path}"
    for text in texts:
        trigger, prefetch = text.find("griddepcontrol.launch_dependents"), text.find("cp.async.bulk.prefetch.L2")
        wait = text.find("griddepcontrol.wait")
        load = min(i for i in (text.find("ld.global"), text.find("cp.async.cg"), text.find("cp.async.ca")) if i > -1)
        assert -1 < trigger < prefetch < wait < load, (trigger, prefetch, wait, load)
