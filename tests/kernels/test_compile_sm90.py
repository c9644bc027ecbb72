"""The MoE, router, LoRA and step-edge (embedding, greedy) Triton kernels compile for the H200 (sm_90a, ptxas
included) on a machine without a GPU.

CI has no GPU, and Triton's interpreter runs a kernel's Python, not its compile: a kernel that does not compile
(a dot below 16 rows, a type or layout error) would pass every CPU test and fail only on a device. Here, in a child
process, Triton's active driver is a stand-in that names sm_90 as the target, every launch compiles without running
(JITFunction.run with warmup), and CPU tensors report themselves as CUDA on a device of 132 multiprocessors, so the
launchers choose what they choose on the GPU (libdevice, programmatic dependent launch, tiles by the wave); each op
is called at inkling-small's sizes, bf16, rank 16, 8 slots, at decode and prefill sizes, so each program shape its
launcher picks is compiled. Every kernel of the modules must compile at least once: a new kernel needs a call here.
The kernels chained into the decode step (programmatic dependent launch) are compiled too, and their PTX read for the
order the chain needs.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.kernels.helpers import ChildRun

# benchmarks/sm90_census.py holds the compile-only launches and the chain's calls, and prints what this test reads
CENSUS = Path(__file__).parents[2] / "benchmarks" / "sm90_census.py"
spec = importlib.util.spec_from_file_location("sm90_census", CENSUS)
sm90 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sm90)
H, F, R, S, ROUTED, SHARED, TOP_K = sm90.H, sm90.F, sm90.R, sm90.S, sm90.ROUTED, sm90.SHARED, sm90.TOP_K
VOCAB = sm90.VOCAB
COMPILE = ChildRun("tests.kernels.test_compile_sm90", "run_compile_cases", "compiled for sm_90", timeout=600)
CHAIN = ChildRun("tests.kernels.test_compile_sm90", "run_chain_cases", "chained for sm_90", timeout=600)


def run_compile_cases() -> None:
    import triton

    compiled = sm90.compile_only()
    import inkwell.kernels.triton_lora as triton_lora
    from inkwell.kernels import triton_embed, triton_greedy, triton_moe, triton_route_dispatch, triton_router
    from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink
    from inkwell.kernels.triton_lora import dense, expert

    bf = dict(dtype=torch.bfloat16)
    experts, groups = ROUTED + SHARED, ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
    qkvr = (0, 2048, 2560, 3072, 3328)
    for tokens in (8, 32, 64, 2048):  # decode (16-, 32- and 64-row tiles), prefill
        rows = tokens * (TOP_K + SHARED)
        index = torch.arange(TOP_K + SHARED).repeat(tokens, 1)
        token_slots = torch.zeros(tokens, dtype=torch.long)
        x = torch.zeros(tokens, H, **bf)
        dispatched = triton_moe.moe_dispatch(index, torch.zeros(tokens, TOP_K + SHARED, **bf), token_slots, experts)
        row_w, places = dispatched[3], dispatched[6]  # the rest, unwritten here, as zeros for the launches below
        ends = torch.zeros(experts, dtype=torch.int32)
        row_tokens = row_experts = row_slots = torch.zeros(rows, dtype=torch.long)
        gate_up_w, down_w = torch.zeros(experts, 2 * F, H, **bf), torch.zeros(experts, H, F, **bf)
        gate_up_b = torch.zeros(S, 2, experts, F, R, **bf)
        y_in, s_in = torch.zeros(tokens, 2 * 2 * R, **bf), torch.ones(S, 4)
        a_in, a_down = torch.zeros(S, 2 * 2 * R, H, **bf), torch.zeros(S, experts, R, F, **bf)
        b_down, s_down = torch.zeros(S, 2, H, R, **bf), torch.ones(S, 2)
        expand_in = RowExpand(y_in, gate_up_b, row_slots, row_experts, s_in, groups)
        shrink_in = RowExpand(TokenShrink(a_in, token_slots), gate_up_b, row_slots, row_experts, s_in, groups)
        gate_up = triton_moe.expert_matmul(x, gate_up_w, ends, row_tokens, tokens, expand_in)
        triton_moe.expert_matmul(x, gate_up_w, ends, row_tokens, tokens, shrink_in)
        act, y_down = triton_moe.silu_mul_shrink(gate_up, a_down, row_slots, row_experts, groups)
        triton_moe.silu_mul(gate_up)
        triton_moe.silu_mul(gate_up, expand_in, row_tokens)
        expand_down = RowExpand(y_down, b_down, row_slots, row_experts, s_down, groups)
        down = triton_moe.expert_matmul(act, down_w, ends, None, tokens, expand_down)
        triton_moe.moe_combine(down, row_w, places, tokens, torch.bfloat16)
        triton_moe.moe_combine(down, row_w, places, tokens, torch.bfloat16, expand_down)
        expert.expert_lora_shrink(act, a_down, row_slots, row_experts, groups)
        expert.expert_out_lora_expand(y_down, b_down, row_slots, row_experts, s_down, down, groups)
        a, b = torch.zeros(S, 4 * R, H, **bf), torch.zeros(S, qkvr[-1], R, **bf)
        out = torch.zeros(tokens, qkvr[-1], **bf)
        dense.lora_linear(x, torch.zeros(qkvr[-1], H, **bf), a, b, token_slots, torch.ones(S, 4), qkvr)
        if tokens <= 64:  # decode: the GEMM chained into the step, the q/k/v/r projection and the router's gate
            dense.linear(x, torch.zeros(qkvr[-1], H, **bf))
            dense.linear(x, torch.zeros(ROUTED + SHARED, H, **bf))
        dense.lora_shrink_expand(x, a, b, token_slots, torch.ones(S, 4), out, qkvr)
        dense.lora_expand_sliced(dense.lora_shrink(x, a, token_slots), b, token_slots, torch.ones(S, 4), out, qkvr)
        logits, bias, scale = torch.zeros(tokens, ROUTED + SHARED, **bf), torch.zeros(ROUTED, **bf), torch.ones(1, **bf)
        triton_router.shared_sink_route(logits, bias, scale, TOP_K, SHARED, 2.5)
        if tokens <= 128:  # decode: the gate GEMM, the routing and the dispatch in one kernel
            gate = torch.zeros(ROUTED + SHARED, H, **bf)
            triton_route_dispatch.gate_route_dispatch(x, gate, bias, scale, TOP_K, SHARED, 2.5, token_slots)
            triton_route_dispatch.gate_route_dispatch(x, gate, bias, scale, TOP_K, SHARED, 2.5, token_slots, a_in)
        ids, norm = torch.zeros(tokens, dtype=torch.long), torch.ones(H, **bf)
        triton_embed.embed_norms(ids, torch.zeros(VOCAB, H, **bf), norm, norm, 1e-6)  # a step's first op, its last
        triton_greedy.logits_greedy(torch.zeros(tokens, VOCAB, **bf))
    # past one token tile q/k/v/r's one GEMM takes 64-column tiles (more 32-column ones than the device's 132 SMs)
    x, token_slots = torch.zeros(128, H, **bf), torch.zeros(128, dtype=torch.long)
    dense.lora_linear(x, torch.zeros(qkvr[-1], H, **bf), a, b, token_slots, torch.ones(S, 4), qkvr)
    kernels = {
        name
        for module in (
            triton_embed,
            triton_greedy,
            triton_moe,
            triton_router,
            triton_route_dispatch,
            *(getattr(triton_lora, m) for m in ("dense", "expand", "expert", "shrink")),
        )
        for name, value in vars(module).items()
        if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel")
    }
    missing = sorted(kernels - {name for name, _, _ in compiled})
    assert not missing, f"kernels no call here compiled: {missing}"
    # every LoRA epilogue in registers: the experts' dots per slot, the decode GEMM's gather of B
    spills = {}
    for name, kw, kernel in compiled:
        if kw.get("EXPAND") or kw.get("HAS_LORA"):
            spills[name, kw.get("BLOCK_M") or kw["BLOCK_T"], kw["BLOCK_N"]] = sm90.ptxas_usage(kernel)[1]
    assert len(spills) >= 6 and not any(spills.values()), f"(kernel, rows, columns): bytes a thread spills {spills}"
    print(f"compiled for sm_90: {len(kernels)} kernels")


@pytest.mark.child(COMPILE)
def test_moe_router_and_lora_kernels_compile_for_sm90():
    COMPILE.check()


# the PTX of a global memory access; the L2 prefetch (cp.async.bulk.prefetch) is a hint a chained kernel may issue
ACCESSES = ("ld.global", "st.global", "atom.global", "red.global", "cp.async.cg", "cp.async.ca")
WRITES = ("st.global", "atom.global", "red.global")


def run_chain_cases() -> None:
    """Each kernel chained into the decode step (`kernels.triton_pdl`), compiled at inkling-small's decode sizes:
    its PTX lets the next kernel launch, then waits, before its first global load or store. A kernel that read its
    input before the wait would read the previous kernel's output while it is being written.

    A LoRA pair's shrink waits before it lets its GEMM launch, so the GEMM may read x before its own wait (every
    kernel before the shrink has finished; the split shrink reads the slots and A before its wait); the GEMM waits
    for y after its K loop and lets the next kernel launch only then. The decode attention reads before its wait
    (cache entries of earlier steps) and so does the MoE layer's head (its slice of the router's gate; with the
    experts' gate/up shrink, the tokens' slots and a block of the adapters' A), but both write after it. An
    experts' GEMM with its expand lets the next kernel launch only after its wait, and silu * up with the down
    shrink, after the gate/up one, reads its row's slot and expert and a block of A before its own wait."""
    compiled = sm90.compile_only()
    sm90.decode_chain()

    def order(kernel) -> tuple[int, int, int]:
        ptx = kernel.asm["ptx"]
        first = min(i for i in (ptx.find(access) for access in ACCESSES) if i > -1)
        return ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait"), first

    shrinks = {"_shrink_kernel"}
    # the split shrink reads the tokens' slots and a block of A before its wait, and lets its GEMM launch after it
    early_shrinks = {"_split_shrink_kernel"}
    # read before their waits what no kernel of the step writes: cache entries of earlier steps, the router's gate,
    # the tokens' slots and the adapters' A
    early_readers = {"_decode_attention_kernel", "_gate_route_dispatch_kernel"}
    chained = [(name, kwargs, kernel) for name, kwargs, kernel in compiled if kwargs.get("CHAINED")]
    want = {"_short_conv_step_kernel", "_decode_prologue_kernel", "_decode_attention_kernel", "_linear_kernel"}
    want |= {
        "_gate_route_dispatch_kernel",
        "_route_kernel",
        "_dispatch_kernel",
        "_expert_matmul_kernel",
        "_silu_mul_kernel",
        "_combine_kernel",
    }
    want |= {"_combine_down_kernel", "_split_shrink_kernel", "_expand_kernel"}
    compiled_chained = {name for name, _, _ in chained}
    assert want <= compiled_chained, f"not compiled chained: {sorted(want - compiled_chained)}"

    def late_trigger(name: str, kwargs: dict) -> bool:  # an experts' GEMM with its expand
        return name == "_expert_matmul_kernel" and kwargs["EXPAND"]

    def early_rows(name: str, kwargs: dict) -> bool:  # silu * up with the down shrink
        return name == "_silu_mul_kernel" and kwargs["SHRINK"]

    for kind in (late_trigger, early_rows):
        assert any(kind(name, kwargs) for name, kwargs, _ in chained), f"nothing chained is {kind.__name__}"
    for name, kwargs, kernel in chained:
        trigger, wait, first = order(kernel)
        if late_trigger(name, kwargs):
            assert -1 < wait < trigger < first, f"{name}: wait at {wait}, trigger at {trigger}, first at {first}"
        elif name in early_readers or early_rows(name, kwargs):
            ptx = kernel.asm["ptx"]
            write = min(i for i in (ptx.find(access) for access in WRITES) if i > -1)
            order_seen = f"{name}: trigger {trigger}, load {first}, wait {wait}, write {write}"
            assert -1 < trigger < first < wait < write, order_seen
        elif name in shrinks:
            assert -1 < wait < min(trigger, first), f"{name}: wait at {wait}, trigger at {trigger}, first at {first}"
        elif name in early_shrinks:
            ptx = kernel.asm["ptx"]
            write = min(i for i in (ptx.find(access) for access in WRITES) if i > -1)
            order_seen = f"{name}: load {first}, wait {wait}, trigger {trigger}, write {write}"
            assert -1 < first < wait < trigger < write, order_seen
        else:
            assert -1 < trigger < wait < first, f"{name}: trigger at {trigger}, wait at {wait}, first at {first}"
    pairs = [(n, k) for n, kwargs, k in compiled if kwargs.get("WAIT_FOR_SHRINK") or kwargs.get("WAIT_FOR_Y")]
    assert {n for n, _ in pairs} == {"_linear_kernel", "_expert_matmul_kernel"}, f"LoRA pair GEMMs: {pairs}"
    for name, kernel in pairs:
        trigger, wait, first = order(kernel)
        assert -1 < first < wait < trigger, f"{name}: first access at {first}, wait at {wait}, trigger at {trigger}"
    rows = sm90.census(compiled)  # what `python benchmarks/sm90_census.py` prints for these launches
    assert len(rows) == len(compiled) and all(row["registers"] > 0 for row in rows), rows
    spilling = {row["kernel"] for row in rows if row["spill_bytes"]}
    assert not spilling, f"decode chain kernels that spill: {spilling}"  # the expand's 12 bytes went with its RMWs
    print(f"chained for sm_90: {len(chained)} kernels, {len(pairs)} LoRA pair GEMMs")


@pytest.mark.child(CHAIN)
def test_decode_chain_kernels_wait_before_their_first_access():
    CHAIN.check()


def test_the_census_counts_instructions_not_their_mentions():
    ptx = "\tbar.sync \t0;\n\t@%p1 bar.sync 1;\n\t@!%p2 shfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;\n"
    ptx += "// bar.sync\n\tmembar.gl;\n"
    assert sm90.instructions(ptx, "bar.sync") == 2
    assert sm90.instructions(ptx, "shfl.sync") == 1
    assert sm90.instructions(ptx, "bar") == 2  # bar.sync twice: not the comment, not membar
