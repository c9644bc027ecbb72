"""The fused shared-sink router (`triton_router`) against its torch twin (`torch_ops.shared_sink_route`, which
`InklingModel.route` runs off CUDA) at the presets' expert counts and one count off a power of two; and the MoE
layer's head in one kernel (`triton_route_dispatch`: the gate GEMM, that routing and the dispatch) against the
router kernel and `torch_ops.moe_dispatch`. Run by Triton's CPU interpreter in a child process, and compiled on the
GPU (marked gpu).

Indices: the routed ones must follow torch.topk(sorted=False)'s CUDA rule (`topk_order`) on every row, ties
included; on the GPU they must equal torch's in order. On the CPU torch breaks ties its own way, so rows tied at
the k-th score are left out of the comparison with the twin there. Weights, paired by expert: within `RTOL` of the
twin's, and in fp16/bf16 at least 99% bitwise equal (the kernel rounds where the twin rounds; a sum taken in
another order can move a value across a rounding boundary, and one such step in the logsumexp (|lse| < 4) moves a
row's weights by up to 2^-6 in bf16, 2^-9 in fp16, so RTOL is 4 of the dtype's eps; fp32 agrees to 1e-5).
"""

import os

import pytest
import torch

from inkwell.kernels import torch_ops
from inkwell.models.presets import PRESETS
from tests.kernels.helpers import ChildRun

INTERPRETED = ChildRun.interpreted("tests.kernels.test_router")

RTOL = {torch.float32: 1e-5, torch.float16: 2**-8, torch.bfloat16: 2**-5}
TOKENS = (1, 8, 128, 1000)
ROUTE_SCALE = 2.5


def expert_counts(preset: str) -> tuple[int, int, int]:
    """(routed experts, top k, shared experts) of a model preset."""
    cfg = PRESETS[preset]
    return cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]


SHAPES = {"tiny": expert_counts("inkling-tiny"), "small": expert_counts("inkling-small"), "odd": (24, 6, 1)}


def topk_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(scores, k, sorted=False)[1] as CUDA computes it: the experts above the k-th largest score in
    index order, then those equal to it, lowest index first."""
    kth = scores.topk(k, dim=-1).values[:, -1:]  # the k-th largest value, whichever ties torch picked
    cols = torch.arange(scores.shape[1]).expand_as(scores)
    width = scores.shape[1]
    key = torch.where(scores > kth, cols, torch.where(scores == kth, width + cols, 2 * width + cols))
    return key.argsort(dim=-1)[:, :k]


def by_expert(index: torch.Tensor, weights: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's routed experts sorted by id (shared ones after them), weights alongside."""
    order = torch.cat([index[:, :k].argsort(dim=-1), torch.arange(k, index.shape[1]).expand(index.shape[0], -1)], 1)
    return index.gather(1, order), weights.gather(1, order)


def check_route(device: str, dtype: torch.dtype, tokens: int, shape: str, bias: str) -> None:
    """Router logits of std 2 (with bias "ties": drawn from 13 values, so most rows tie at the k-th score); a
    correction bias of zeros (a fresh model's: ties in half precision) or std 0.05; global scale 1.25."""
    from inkwell.kernels.triton_router import shared_sink_route

    routed, k, shared = SHAPES[shape]
    gen = torch.Generator().manual_seed(tokens * 100 + routed)
    if bias == "ties":
        logits = torch.randint(-6, 7, (tokens, routed + shared), generator=gen) / 3
    else:
        logits = 2 * torch.randn(tokens, routed + shared, generator=gen)
    correction = 0.05 * torch.randn(routed, generator=gen) if bias == "random" else torch.zeros(routed)
    args = [t.to(device=device, dtype=dtype) for t in (logits, correction, torch.tensor([1.25]))]
    index, weights = shared_sink_route(*args, k, shared, ROUTE_SCALE)
    want_index, want_weights = torch_ops.shared_sink_route(*args, k, shared, ROUTE_SCALE)
    assert index.dtype == torch.long and weights.dtype == dtype and weights.shape == (tokens, k + shared)
    index, weights, want_index, want_weights = (t.cpu() for t in (index, weights, want_index, want_weights))
    scores = (args[0][:, :routed].sigmoid() + args[1]).cpu()  # as the twin computes them
    assert torch.equal(index[:, :k], topk_order(scores, k)), "routed experts not as torch.topk picks them on CUDA"
    assert torch.equal(index[:, k:], torch.arange(routed, routed + shared).expand(tokens, -1))
    if device == "cuda":
        assert torch.equal(index, want_index), "indices differ from torch.topk's"
        rows = torch.ones(tokens, dtype=torch.bool)
    else:
        top = scores.sort(dim=-1, descending=True).values
        rows = top[:, k - 1] != top[:, k]
    got, want = by_expert(index, weights, k), by_expert(want_index, want_weights, k)
    assert torch.equal(got[0][rows], want[0][rows]), "a different set of experts"
    w, ref = got[1][rows].double(), want[1][rows].double()
    err = float(((w - ref).abs() / ref.abs()).max()) if w.numel() else 0.0
    assert err <= RTOL[dtype], f"weights: worst relative error {err:.2e}"
    if dtype != torch.float32:
        assert float((w == ref).double().mean()) >= 0.99, "weights not rounded where the twin rounds"


def exact_gate_inputs(tokens: int, hidden: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] in {-1, 0, 1} and a gate [E + n, H] of multiples of 2^-6 below 2 (logits of std about 2): every
    product and partial sum is exact in fp32, so the logits are the same in any summation order and round to the
    same fp16/bf16 value as the float64 product."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (tokens, hidden), generator=gen).float()
    gate = (torch.randn(experts, hidden, generator=gen) * 2.5 / hidden**0.5 * 64).round().clamp(-127, 127) / 64
    return x, gate


def exact_lora_a(slots: int, rank: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """A [slots, rank, hidden] of multiples of 1/64 below 2: with exact_gate_inputs' x, x @ A^T is exact in fp32."""
    return (torch.randn(slots, rank, hidden, generator=gen) * 16).round().clamp(-127, 127) / 64


def exact_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each token's x @ A[slot]^T in float64 on the CPU, zeros for slot -1."""
    x, lora_a, slots = x.cpu().double(), lora_a.cpu().double(), slots.cpu()
    return torch.where((slots >= 0)[:, None], torch.einsum("th,trh->tr", x, lora_a[slots.clamp(min=0)]), 0.0)


def check_gate_route_dispatch(device: str, dtype: torch.dtype, tokens: int, shape: str, hidden: int) -> None:
    """Twice (the second launch finds its split count reset): the kernel's routing equals the router kernel's on the
    exact logits (indices bitwise, weights to rounding); its dispatch equals the stable argsort's of its own
    routing. The second launch also runs the experts' gate/up shrink over 4 slots of rank 24 (a rank block part
    masked) in its own programs: y equals each token's exact x @ A[slot]^T (zeros for slot -1)."""
    from inkwell.kernels.triton_route_dispatch import gate_route_dispatch
    from inkwell.kernels.triton_router import shared_sink_route

    routed, k, shared = SHAPES[shape]
    for seed in (tokens, tokens + 1):
        x, gate = exact_gate_inputs(tokens, hidden, routed + shared, seed)
        gen = torch.Generator().manual_seed(seed)
        correction = 0.05 * torch.randn(routed, generator=gen)
        slots = torch.randint(-1, 4, (tokens,), generator=gen)
        x, gate, correction, scale = (t.to(device=device, dtype=dtype) for t in (x, gate, correction, torch.ones(1)))
        slots = slots.to(device)
        lora_a = None if seed == tokens else exact_lora_a(4, 24, hidden, gen).to(device, dtype)
        index, weights, rows, y = gate_route_dispatch(x, gate, correction, scale, k, shared, ROUTE_SCALE, slots, lora_a)
        if lora_a is None:
            assert y is None
        else:  # every product and sum exact in fp32
            want_y = exact_shrink(x, lora_a, slots).to(dtype)
            assert torch.equal(y.cpu(), want_y), "the head's gate/up shrink differs from x @ A[slot]^T"
        logits = (x.double() @ gate.double().T).to(dtype)
        want_index, want_weights = shared_sink_route(logits, correction, scale, k, shared, ROUTE_SCALE)
        assert torch.equal(index, want_index), "routed experts differ from the router kernel's on the same logits"
        # the two kernels' layouts sum a row's scores in their own orders: 16-bit weights within an ulp (bitwise on an
        # H100 and an H200), fp32's last bits apart (an H100 and an H200 at 32 and 128 tokens), within the router's
        # own tolerance against torch
        rtol = RTOL[dtype] if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(weights, want_weights, rtol=rtol, atol=0)
        want_rows = torch_ops.moe_dispatch(index.cpu(), weights.cpu(), slots.cpu(), routed + shared)
        names = ("order", "tokens", "experts", "weights", "slots", "ends", "places")
        for name, got, want in zip(names, rows, want_rows, strict=True):
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want), f"dispatch {name} differs"


def check_head_shrink_past_the_split_counts(device: str, dtype: torch.dtype) -> None:
    """A shrink the split counts cannot serve (`split_shrinkable`: here more tokens than its per-slot programs take):
    the head leaves it to a shrink launch of its own after it, and y is still each token's exact x @ A[slot]^T."""
    from inkwell.kernels.triton_lora.common import SLOT_LOOP_MIN_TOKENS
    from inkwell.kernels.triton_route_dispatch import gate_route_dispatch

    routed, k, shared = SHAPES["small"]
    tokens, hidden, rank = SLOT_LOOP_MIN_TOKENS + 1, 64, 16
    x, gate = exact_gate_inputs(tokens, hidden, routed + shared, 0)
    gen = torch.Generator().manual_seed(0)
    lora_a, slots = exact_lora_a(4, rank, hidden, gen), torch.randint(-1, 4, (tokens,), generator=gen)
    want_y = exact_shrink(x, lora_a, slots).to(dtype)
    x, gate, lora_a, correction, scale = (
        t.to(device, dtype) for t in (x, gate, lora_a, torch.zeros(routed), torch.ones(1))
    )
    *_, y = gate_route_dispatch(x, gate, correction, scale, k, shared, ROUTE_SCALE, slots.to(device), lora_a)
    assert torch.equal(y.cpu(), want_y), "the shrink past the split counts differs from x @ A[slot]^T"


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for tokens in (1, 5, 37):  # K = 300: ten programs of 32 columns, the last one short
        check_gate_route_dispatch("cpu", torch.float32, tokens, "small", 300)
    check_gate_route_dispatch("cpu", torch.float16, 9, "odd", 300)
    check_head_shrink_past_the_split_counts("cpu", torch.float32)
    for tokens in TOKENS:
        check_route("cpu", torch.float32, tokens, "small", "random")
    for shape in SHAPES:  # the interpreter rounds bf16 by truncation; fp16 as the GPU does
        for dtype, bias in ((torch.float32, "random"), (torch.float32, "ties"), (torch.float16, "zero")):
            check_route("cpu", dtype, 128, shape, bias)
    check_route("cpu", torch.float16, 1000, "small", "zero")
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_router_matches_torch_twin_in_interpreter():
    INTERPRETED.check()


def test_router_rejects_bad_shapes():
    from inkwell.kernels.triton_router import shared_sink_route

    logits, scale = torch.zeros(4, 10), torch.ones(1)
    with pytest.raises(ValueError, match="bias"):
        shared_sink_route(logits, torch.zeros(9), scale, 2, 2, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        shared_sink_route(logits, torch.zeros(8), scale, 9, 2, 1.0)
    with pytest.raises(ValueError, match="unit column stride"):
        shared_sink_route(torch.zeros(10, 4).t(), torch.zeros(8), scale, 2, 2, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("bias", ["zero", "random", "ties"])
def test_router_on_gpu(dtype, shape, tokens, bias):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_route("cuda", dtype, tokens, shape, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 32, 128])
def test_gate_route_dispatch_on_gpu(dtype, shape, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_gate_route_dispatch("cuda", dtype, tokens, shape, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_shrink_past_the_split_counts_on_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_head_shrink_past_the_split_counts("cuda", dtype)
