"""The Triton multi-LoRA kernels against their pure-torch twins, run by Triton's CPU interpreter.

Triton picks interpreter or compiler when a kernel is defined, so the kernels run in a child
process started with TRITON_INTERPRET=1; the checks themselves (`check_*`, shared with the GPU
tests) compare every op with the torch twins computed in float64 on the same inputs.
"""

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from unittest import mock

import torch

from inkwell.kernels import dispatch, torch_ops
from inkwell.kernels.torch_ops import ExpertGroups

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def make_slots(tokens: int, num_slots: int, used: int, gen: torch.Generator) -> torch.Tensor:
    """Slots in {-1} U [0, used) (slots used..S-1 stay empty), every value present when tokens allow."""
    slots = torch.randint(-1, used, (tokens,), generator=gen)
    present = torch.arange(-1, used)[:tokens]
    slots[: present.numel()] = present
    return slots[torch.randperm(tokens, generator=gen)]


def padded_factors(
    num_slots: int, rank: int, k: int, n: int, gen: torch.Generator, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, P*R, K] and B [S, N, R] at the buffer rank R, each slot zero-padded to its own rank."""
    a = torch.randn(num_slots, parts * rank, k, generator=gen, dtype=torch.float64) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=gen, dtype=torch.float64) / rank**0.5
    for s in range(num_slots):
        own = int(torch.randint(1, rank + 1, (1,), generator=gen)) if s % 2 else rank
        for p in range(parts):
            a[s, p * rank + own : (p + 1) * rank] = 0
        b[s, :, own:] = 0
    return a, b


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Error per row against the float64 reference, relative to the row's norm or the median row norm.

    The floor matters: a rank-1 or rank-2 slot's shrink row can nearly cancel (norm 0.04 against a
    median of 3), and the torch twin's own bf16 error on such a row is 5e-2 of it. A wrong or
    unwritten row still errs by about its whole norm. NaN never passes.
    """
    got, ref = got.detach().cpu().double(), ref.double()
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    norms = ref.norm(dim=-1)
    typical = float(norms[norms > 0].median()) if bool((norms > 0).any()) else 1.0
    err = (got - ref).norm(dim=-1) / norms.clamp_min(typical)
    assert float(err.max()) <= TOLERANCE[dtype], f"{what}: worst row relative error {float(err.max()):.2e}"


def check_linear(
    ops: ModuleType, device: str, dtype: torch.dtype, tokens: int, num_slots: int, used: int, rank: int, k: int, n: int
):
    gen = torch.Generator().manual_seed(tokens * 7919 + num_slots * 31 + rank)
    slots = make_slots(tokens, num_slots, used, gen)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    a, b = padded_factors(num_slots, rank, k, n, gen)
    scalings = torch.rand(num_slots, generator=gen) + 0.5
    base = torch.randn(tokens, n, generator=gen, dtype=torch.float64)
    ref_y = torch_ops.lora_shrink(x, a, slots)
    ref_out = torch_ops.lora_expand(ref_y, b, slots, scalings.double(), base.clone())

    dev = dict(device=device, dtype=dtype)
    d_slots, d_scal = slots.to(device), scalings.to(device)
    y = ops.lora_shrink(x.to(**dev), a.to(**dev), d_slots)
    assert_close(y, ref_y, dtype, "lora_shrink")
    base_rows = (slots < 0).to(device)
    assert bool((y[base_rows] == 0).all()), "lora_shrink: base-model rows must be zero"
    out = base.to(**dev)
    before = out.clone()
    assert ops.lora_expand(ref_y.to(**dev), b.to(**dev), d_slots, d_scal, out) is out
    assert_close(out, ref_out, dtype, "lora_expand")
    assert torch.equal(out[base_rows], before[base_rows]), "lora_expand touched base-model rows"
    fused = base.to(**dev)
    ops.lora_shrink_expand(x.to(**dev), a.to(**dev), b.to(**dev), d_slots, d_scal, fused)
    assert_close(fused, ref_out, dtype, "lora_shrink_expand")
    assert torch.equal(fused[base_rows], before[base_rows]), "lora_shrink_expand touched base-model rows"


def check_sliced(
    ops: ModuleType, device: str, dtype: torch.dtype, tokens: int, num_slots: int, rank: int, k: int, offsets: tuple
):
    """A fused projection of len(offsets)-1 slices equals one reference expand per slice."""
    gen = torch.Generator().manual_seed(tokens + 13 * len(offsets) + rank)
    parts, n = len(offsets) - 1, offsets[-1]
    slots = make_slots(tokens, num_slots, num_slots, gen)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    a, b = padded_factors(num_slots, rank, k, n, gen, parts)
    scalings = torch.rand(num_slots, parts, generator=gen) + 0.5
    scalings[0, -1] = 0.0  # slot 0's adapter leaves the last slice alone
    base = torch.randn(tokens, n, generator=gen, dtype=torch.float64)
    ref = base.clone()
    for p, (lo, hi) in enumerate(zip(offsets, offsets[1:], strict=False)):
        y_p = torch_ops.lora_shrink(x, a[:, p * rank : (p + 1) * rank], slots)
        torch_ops.lora_expand(y_p, b[:, lo:hi], slots, scalings[:, p].double(), ref[:, lo:hi])

    dev = dict(device=device, dtype=dtype)
    d_slots, d_scal = slots.to(device), scalings.to(device)
    y = ops.lora_shrink(x.to(**dev), a.to(**dev), d_slots)
    out = ops.lora_expand_sliced(y, b.to(**dev), d_slots, d_scal, base.to(**dev), offsets)
    assert_close(out, ref, dtype, f"lora_expand_sliced {offsets}")
    fused = ops.lora_shrink_expand(x.to(**dev), a.to(**dev), b.to(**dev), d_slots, d_scal, base.to(**dev), offsets)
    assert_close(fused, ref, dtype, f"lora_shrink_expand {offsets}")


def check_projection(
    ops: ModuleType, device: str, dtype: torch.dtype, tokens: int, num_slots: int, rank: int, k: int, offsets: tuple
):
    """lora_linear (base GEMM and sliced LoRA in one op) equals F.linear plus one reference expand per slice,
    and a second call gives the same output bit for bit."""
    gen = torch.Generator().manual_seed(tokens * 3 + 17 * len(offsets) + rank)
    parts, n = len(offsets) - 1, offsets[-1]
    slots = make_slots(tokens, num_slots, num_slots - 1, gen)  # the last slot stays empty
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    weight = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    a, b = padded_factors(num_slots, rank, k, n, gen, parts)
    scalings = torch.rand(num_slots, parts, generator=gen) + 0.5
    ref = x @ weight.t()
    for p, (lo, hi) in enumerate(zip(offsets, offsets[1:], strict=False)):
        y_p = torch_ops.lora_shrink(x, a[:, p * rank : (p + 1) * rank], slots)
        torch_ops.lora_expand(y_p, b[:, lo:hi], slots, scalings[:, p].double(), ref[:, lo:hi])

    dev = dict(device=device, dtype=dtype)
    args = (x.to(**dev), weight.to(**dev), a.to(**dev), b.to(**dev), slots.to(device), scalings.to(device), offsets)
    out = ops.lora_linear(*args)
    assert_close(out, ref, dtype, f"lora_linear {tokens} tokens {offsets}")
    assert torch.equal(ops.lora_linear(*args), out), "lora_linear: a second call differs"


def expert_groups(routed: int, shared: int, covered: str) -> ExpertGroups:
    """The LoRA's expert groups when routed ids 0..routed-1 and shared ids after them share one id space."""
    return {
        "both": ExpertGroups(0, routed + shared, split=routed),
        "routed": ExpertGroups(0, routed),
        "shared": ExpertGroups(routed, shared),
    }[covered]


# The ways the Triton expert kernels can run the same dispatched rows: name -> (pass the segment ends, the
# per-row kernels' row limit). The torch twins ignore both.
EXPERT_PATHS = {"per row": (False, 2**31), "segments": (True, 0), "token tiles": (False, 0)}


@contextlib.contextmanager
def expert_path(name: str, ends: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Within the block the expert kernels take path `name`; yields the segment ends to pass (or None)."""
    from inkwell.kernels.triton_lora import common

    with_ends, row_max = EXPERT_PATHS[name]
    with mock.patch.object(common, "ROW_MAX_ROWS", row_max):
        yield ends if with_ends else None


def check_experts(
    ops: ModuleType,
    device: str,
    dtype: torch.dtype,
    rows: int,
    num_slots: int,
    experts: int,
    rank: int,
    k: int,
    n: int,
    covered: str = "both",
):
    """The expert ops on dispatched rows of `experts` routed + 2 shared experts, of which `covered` have LoRA.

    Rows are sorted by expert, as the engine dispatches them; the gate/up expand and the fused down run every
    way in EXPERT_PATHS: one program per row, one per expert and slot (with the segment ends), and token tiles
    walking their groups. Rows of uncovered experts and of slot -1 must stay untouched (zero after the shrink)."""
    gen = torch.Generator().manual_seed(rows * 3 + experts + len(covered))
    groups = expert_groups(experts, 2, covered)
    tokens = max(rows // 3, 1)
    token_slots = make_slots(tokens, num_slots, num_slots - 1, gen)
    expert_ids, order = torch.randint(0, experts + 2, (rows,), generator=gen).sort(stable=True)
    token_of_row = torch.randint(0, tokens, (rows,), generator=gen)[order]
    slots = token_slots[token_of_row]
    ends = torch.searchsorted(expert_ids, torch.arange(experts + 2), right=True).to(device)
    scalings = torch.rand(num_slots, 2 * groups.groups, generator=gen) + 0.5
    dev = dict(device=device, dtype=dtype)
    d_slots, d_experts = slots.to(device), expert_ids.to(device)
    local = expert_ids - groups.first
    untouched = ((slots < 0) | (local < 0) | (local >= groups.count)).to(device)

    # down: per-expert A, each group's shared B
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    a = torch.randn(num_slots, groups.count, rank, k, generator=gen, dtype=torch.float64) / k**0.5
    a[1, :, rank // 2 :] = 0  # slot 1 holds a smaller rank
    b = torch.randn(num_slots, groups.groups, n, rank, generator=gen, dtype=torch.float64) / rank**0.5
    b[1, :, :, rank // 2 :] = 0
    base = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    ref_y = torch_ops.expert_lora_shrink(x, a, slots, expert_ids, groups)
    down_scalings = scalings[:, : groups.groups].double()
    ref_out = torch_ops.expert_out_lora_expand(ref_y, b, slots, expert_ids, down_scalings, base.clone(), groups)
    y = ops.expert_lora_shrink(x.to(**dev), a.to(**dev), d_slots, d_experts, groups)
    assert_close(y, ref_y, dtype, "expert_lora_shrink")
    assert bool((y[untouched] == 0).all()), "expert_lora_shrink: uncovered rows must be zero"
    out = base.to(**dev)
    before = out.clone()
    d_scal = scalings[:, : groups.groups].to(device)
    ops.expert_out_lora_expand(ref_y.to(**dev), b.to(**dev), d_slots, d_experts, d_scal, out, groups)
    assert_close(out, ref_out, dtype, "expert_out_lora_expand")
    assert torch.equal(out[untouched], before[untouched]), "expert_out_lora_expand touched uncovered rows"
    for path in EXPERT_PATHS:
        with expert_path(path, ends) as segment_ends:
            fused = ops.expert_down_lora(
                x.to(**dev), a.to(**dev), b.to(**dev), d_slots, d_experts, d_scal, base.to(**dev), groups, segment_ends
            )
        assert_close(fused, ref_out, dtype, f"expert_down_lora ({path})")
        assert torch.equal(fused[untouched], before[untouched]), f"expert_down_lora ({path}) touched uncovered rows"

    # gate/up: each group's shared A (the tokens' shrink y_in), per-expert B per projection
    y_in = torch.randn(tokens, 2 * groups.groups * rank, generator=gen, dtype=torch.float64)
    b_in = torch.randn(num_slots, 2, groups.count, n, rank, generator=gen, dtype=torch.float64) / rank**0.5
    base = torch.randn(rows, 2 * n, generator=gen, dtype=torch.float64)
    ref_out = torch_ops.expert_in_lora_expand(
        y_in, b_in, slots, expert_ids, scalings.double(), base.clone(), token_of_row, groups
    )
    before = base.to(**dev)
    d_tokens, d_y, d_b, d_scal = token_of_row.to(device), y_in.to(**dev), b_in.to(**dev), scalings.to(device)
    for path in EXPERT_PATHS:
        out = before.clone()
        with expert_path(path, ends) as segment_ends:
            ops.expert_in_lora_expand(d_y, d_b, d_slots, d_experts, d_scal, out, d_tokens, groups, segment_ends)
        assert_close(out, ref_out, dtype, f"expert_in_lora_expand ({covered}, {path})")
        assert torch.equal(out[untouched], before[untouched]), f"expert_in_lora_expand ({path}) touched uncovered rows"


def run_interpreted_cases() -> None:
    """Small shapes that still cross every tile edge: several token tiles, rank tiles, K and N tails."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from inkwell.kernels.triton_lora import dense, expert

    dev, expert_dev = dict(ops=dense, device="cpu"), dict(ops=expert, device="cpu")
    for dtype in (torch.float32, torch.float16):
        check_linear(**dev, dtype=dtype, tokens=5, num_slots=3, used=2, rank=8, k=40, n=24)
        check_linear(**dev, dtype=dtype, tokens=70, num_slots=4, used=3, rank=16, k=72, n=130)
        # decode sizes: the shrink's K loop split over 2-3 programs, the last of which sums their partials
        check_linear(**dev, dtype=dtype, tokens=9, num_slots=4, used=3, rank=8, k=300, n=24)
        check_sliced(**dev, dtype=dtype, tokens=9, num_slots=3, rank=8, k=32, offsets=(0, 20, 36, 52, 60))
        check_sliced(**dev, dtype=dtype, tokens=66, num_slots=2, rank=16, k=48, offsets=(0, 80, 160))
        check_projection(**dev, dtype=dtype, tokens=5, num_slots=3, rank=8, k=40, offsets=(0, 20, 36, 52, 60))
        check_projection(**dev, dtype=dtype, tokens=20, num_slots=4, rank=24, k=300, offsets=(0, 70))  # 2 K tiles
        # slices on tile edges (one rank block of y per tile), then a rank past the early-loaded block of B
        check_projection(**dev, dtype=dtype, tokens=7, num_slots=3, rank=16, k=40, offsets=(0, 32, 64, 96, 150))
        check_projection(**dev, dtype=dtype, tokens=6, num_slots=2, rank=40, k=40, offsets=(0, 64, 96))
        for covered in ("both", "routed", "shared"):
            check_experts(
                **expert_dev, dtype=dtype, rows=37, num_slots=3, experts=5, rank=8, k=24, n=40, covered=covered
            )
        check_experts(**expert_dev, dtype=dtype, rows=100, num_slots=3, experts=3, rank=8, k=24, n=40)  # slot loop
    check_linear(**dev, dtype=torch.float32, tokens=20, num_slots=2, used=2, rank=80, k=16, n=16)  # 2 rank tiles
    print("interpreted cases passed")


def run_in_interpreter(module: str) -> None:
    """Run `module`'s `run_interpreted_cases()` in a child process with TRITON_INTERPRET=1; fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = f"from {module} import run_interpreted_cases; run_interpreted_cases()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "interpreted cases passed" in proc.stdout


def test_triton_kernels_match_torch_twins_in_interpreter():
    run_in_interpreter("inkwell.tests.kernels.test_triton_interpret")


def test_dispatch_torch_path_of_sliced_and_fused_ops():
    """On CPU tensors dispatch runs the torch twins; the sliced and fused ops compose them per slice."""
    check_linear(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, used=2, rank=8, k=16, n=12)
    check_sliced(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, rank=4, k=16, offsets=(0, 8, 12, 16, 20))
    check_projection(dispatch, "cpu", torch.float32, tokens=9, num_slots=3, rank=4, k=16, offsets=(0, 8, 12, 16, 20))
    for covered in ("both", "routed", "shared"):
        check_experts(dispatch, "cpu", torch.float32, 11, num_slots=3, experts=4, rank=4, k=8, n=12, covered=covered)


def test_triton_launchers_reject_bad_shapes():
    from inkwell.kernels.triton_lora import dense

    x, slots = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    bad = [
        (lambda: dense.lora_shrink(x, torch.zeros(2, 4, 9), slots), "K=9"),
        (lambda: dense.lora_shrink(x, torch.zeros(2, 4, 8), slots[:3]), "token_slots"),
        (
            lambda: dense.lora_expand_sliced(
                torch.zeros(4, 6), torch.zeros(2, 6, 4), slots, torch.ones(2), torch.zeros(4, 6), (0, 4, 6)
            ),
            "columns",
        ),
        (
            lambda: dense.lora_expand(torch.zeros(4, 4), torch.zeros(2, 6, 4), slots, torch.ones(3), x),
            "out must be",
        ),
        (
            lambda: dense.lora_expand(torch.zeros(4, 4), torch.zeros(2, 6, 4), slots, torch.ones(3), x[:, :6]),
            "scalings",
        ),
        (
            lambda: dense.lora_expand_sliced(
                torch.zeros(4, 8), torch.zeros(2, 6, 4), slots, torch.ones(2), x[:, :6], (0, 5, 4, 6)
            ),
            "increase",
        ),
        (
            lambda: dense.lora_linear(x, torch.zeros(6, 9), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), slots, x),
            "K=8",
        ),
        (
            lambda: dense.lora_linear(
                x, torch.zeros(6, 8), torch.zeros(2, 4, 8), torch.zeros(2, 5, 4), slots, torch.ones(2)
            ),
            "N=5",
        ),
        (
            lambda: dense.lora_linear(
                x, torch.zeros(6, 8), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), slots, torch.ones(2), (0, 3, 6)
            ),
            "[S, 2*R, K]",
        ),
    ]
    for call, words in bad:
        try:
            call()
        except ValueError as err:
            assert words in str(err), str(err)
        else:
            raise AssertionError("bad shapes were accepted")
