"""The Triton multi-LoRA ops against their pure-torch twins: the checks shared by the interpreter tests
(`test_triton_interpret`) and the GPU tests (`test_triton_lora`), and the inputs they build.

Every `check_*` runs one ops module (`dispatch`, or `triton_lora.dense` / `expert` directly) on a device and
compares it with the torch twins computed in float64 on the same inputs.
"""

from types import ModuleType

import torch

from inkwell.kernels import dispatch, torch_ops
from inkwell.kernels.torch_ops import ExpertGroups
from tests.kernels.helpers import assert_close


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


def expert_groups(routed: int, shared: int, covered: str) -> ExpertGroups:
    """The LoRA's expert groups when routed ids 0..routed-1 and shared ids after them share one id space."""
    return {
        "both": ExpertGroups(0, routed + shared, split=routed),
        "routed": ExpertGroups(0, routed),
        "shared": ExpertGroups(routed, shared),
    }[covered]


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


def check_expand_walk(
    expand: ModuleType, device: str, dtype: torch.dtype, tokens: int, num_slots: int, rank: int, offsets: tuple
):
    """`expand.launch_expand` of a sliced projection with every slot's programs of its own and walking each tile's
    slots (its `walk`, forced either way) equals one reference expand per slice; base-model rows stay untouched."""
    gen = torch.Generator().manual_seed(tokens * 11 + num_slots + rank)
    parts, n = len(offsets) - 1, offsets[-1]
    slots = make_slots(tokens, num_slots, num_slots, gen)
    y = torch.randn(tokens, parts * rank, generator=gen, dtype=torch.float64)
    b = torch.randn(num_slots, n, rank, generator=gen, dtype=torch.float64) / rank**0.5
    scalings = torch.rand(num_slots, parts, generator=gen) + 0.5
    base = torch.randn(tokens, n, generator=gen, dtype=torch.float64)
    ref = dispatch.lora_expand_sliced(y, b, slots, scalings.double(), base.clone(), offsets)  # the torch twin on CPU
    dev = dict(device=device, dtype=dtype)
    base_rows = (slots < 0).to(device)
    for walk in (False, True):
        out = base.to(**dev)
        before = out.clone()
        expand.launch_expand(y.to(**dev), b.to(**dev)[:, None], slots.to(device), scalings.to(device), out, offsets,
                             walk=walk)  # fmt: skip
        assert_close(out, ref, dtype, f"launch_expand(walk={walk}) {tokens} tokens {offsets}")
        assert torch.equal(out[base_rows], before[base_rows]), f"launch_expand(walk={walk}) touched base-model rows"


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


def check_plain_linear(ops: ModuleType, device: str, dtype: torch.dtype, tokens: int, k: int, n: int):
    """`linear` (the decode GEMM with no LoRA) equals x @ W^T, and a second call gives the same output bit for bit."""
    gen = torch.Generator().manual_seed(tokens * 5 + n)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    weight = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    args = (x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype))
    out = ops.linear(*args)
    assert out.shape == (tokens, n) and out.dtype == dtype
    assert_close(out, x @ weight.t(), dtype, f"linear {tokens} tokens, {n} columns")
    assert torch.equal(ops.linear(*args), out), "linear: a second call differs"


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
    """The expert ops on dispatched rows of `experts` routed + 2 shared experts, of which `covered` have LoRA: the
    shrink over per-expert A and the down projection's expand over each group's shared B.

    Rows are sorted by expert, as the engine dispatches them. Rows of uncovered experts and of slot -1 must stay
    untouched (zero after the shrink)."""
    gen = torch.Generator().manual_seed(rows * 3 + experts + len(covered))
    groups = expert_groups(experts, 2, covered)
    tokens = max(rows // 3, 1)
    token_slots = make_slots(tokens, num_slots, num_slots - 1, gen)
    expert_ids, order = torch.randint(0, experts + 2, (rows,), generator=gen).sort(stable=True)
    token_of_row = torch.randint(0, tokens, (rows,), generator=gen)[order]
    slots = token_slots[token_of_row]
    scalings = torch.rand(num_slots, groups.groups, generator=gen) + 0.5
    dev = dict(device=device, dtype=dtype)
    d_slots, d_experts = slots.to(device), expert_ids.to(device)
    local = expert_ids - groups.first
    untouched = ((slots < 0) | (local < 0) | (local >= groups.count)).to(device)

    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    a = torch.randn(num_slots, groups.count, rank, k, generator=gen, dtype=torch.float64) / k**0.5
    a[1, :, rank // 2 :] = 0  # slot 1 holds a smaller rank
    b = torch.randn(num_slots, groups.groups, n, rank, generator=gen, dtype=torch.float64) / rank**0.5
    b[1, :, :, rank // 2 :] = 0
    base = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    ref_y = torch_ops.expert_lora_shrink(x, a, slots, expert_ids, groups)
    ref_out = torch_ops.expert_out_lora_expand(ref_y, b, slots, expert_ids, scalings.double(), base.clone(), groups)
    y = ops.expert_lora_shrink(x.to(**dev), a.to(**dev), d_slots, d_experts, groups)
    assert_close(y, ref_y, dtype, "expert_lora_shrink")
    assert bool((y[untouched] == 0).all()), "expert_lora_shrink: uncovered rows must be zero"
    out = base.to(**dev)
    before = out.clone()
    ops.expert_out_lora_expand(ref_y.to(**dev), b.to(**dev), d_slots, d_experts, scalings.to(device), out, groups)
    assert_close(out, ref_out, dtype, "expert_out_lora_expand")
    assert torch.equal(out[untouched], before[untouched]), "expert_out_lora_expand touched uncovered rows"
