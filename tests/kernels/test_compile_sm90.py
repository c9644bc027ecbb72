"""The MoE, router and LoRA Triton kernels compile for the H200 (sm_90a, ptxas included) on a machine without a GPU.

CI has no GPU, and Triton's interpreter runs a kernel's Python, not its compile: a kernel that does not compile
(a dot below 16 rows, a type or layout error) would pass every CPU test and fail only on a device. Here, in a child
process, Triton's active driver is a stand-in that names sm_90 as the target, every launch compiles without running
(JITFunction.run with warmup), and CPU tensors report themselves as CUDA, so the launchers choose what they choose on
the GPU (libdevice, programmatic dependent launch); each op is called at inkling-small's sizes, bf16, rank 16, 8
slots, at decode and prefill sizes, so each program shape its launcher picks is compiled. Every kernel of the
modules must compile at least once: a new kernel needs a call here. The kernels chained into the decode step
(programmatic dependent launch) are compiled too, and their PTX read for the order the chain needs.
"""

import re
import subprocess
import tempfile

import torch

from tests.kernels.helpers import run_in_child

H, F, R, S, ROUTED, SHARED, TOP_K = 2048, 512, 16, 8, 16, 2, 4


def compile_only() -> list[tuple[str, dict, object]]:
    """Make every Triton launch in this process compile for the H200 without running, and CPU tensors report
    themselves as CUDA; returns the list that each launch appends (kernel name, its keyword arguments, the compiled
    kernel) to."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:
        """Triton's driver as far as compiling a launch needs it: the H200's target, device 0, stream 0."""

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    compiled: list[tuple[str, dict, object]] = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kwargs, kernel))
        return kernel

    driver.set_active(CompileOnly())
    JITFunction.run = compile_launch
    torch.Tensor.is_cuda = property(lambda self: True)  # the launchers' branch for CUDA tensors
    return compiled


def spill_bytes(kernel) -> int:
    """The bytes a thread of the compiled kernel spills to local memory, as ptxas (sm_90a) reports them."""
    from triton import knobs

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run(
            [knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def run_compile_cases() -> None:
    import triton

    compiled = compile_only()
    import inkwell.kernels.triton_lora as triton_lora
    from inkwell.kernels import triton_moe, triton_router
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
    kernels = {
        name
        for module in (
            triton_moe,
            triton_router,
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
            spills[name, kw.get("BLOCK_M") or kw["BLOCK_T"], kw["BLOCK_N"]] = spill_bytes(kernel)
    assert len(spills) >= 6 and not any(spills.values()), f"(kernel, rows, columns): bytes a thread spills {spills}"
    print(f"compiled for sm_90: {len(kernels)} kernels")


def test_moe_router_and_lora_kernels_compile_for_sm90():
    run_in_child("tests.kernels.test_compile_sm90", "run_compile_cases", "compiled for sm_90", timeout=600)


# the PTX of a global memory access; the L2 prefetch (cp.async.bulk.prefetch) is a hint a chained kernel may issue
ACCESSES = ("ld.global", "st.global", "atom.global", "red.global", "cp.async.cg", "cp.async.ca")
WRITES = ("st.global", "atom.global", "red.global")


def run_chain_cases() -> None:
    """Each kernel chained into the decode step (`kernels.triton_pdl`), compiled at inkling-small's decode sizes:
    its PTX lets the next kernel launch, then waits, before its first global load or store. A kernel that read its
    input before the wait would read the previous kernel's output while it is being written.

    A LoRA pair's shrink waits before it lets its GEMM launch, so the GEMM may read x before its own wait (every
    kernel before the shrink has finished); the GEMM waits for y after its K loop and lets the next kernel launch
    only then. The decode attention reads before its wait (cache entries of earlier steps) but writes after it."""
    compiled = compile_only()
    from inkwell.kernels import triton_moe
    from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink
    from inkwell.kernels.triton_attention_prologue import decode_attention_prologue
    from inkwell.kernels.triton_decode_attention import decode_attention
    from inkwell.kernels.triton_lora import dense
    from inkwell.kernels.triton_router import shared_sink_route
    from inkwell.kernels.triton_short_conv import short_conv_step

    bf, rows, seqs, entries, heads, kv, d, d_rel = dict(dtype=torch.bfloat16), 8, 4, 512, 16, 4, 128, 16
    groups = ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
    x, seq, pos = torch.zeros(rows, H, **bf), torch.arange(rows) % seqs, torch.full((rows,), 7)
    short_conv_step(x, torch.zeros(seqs, H, 3), seq, torch.zeros(H, 1, 4, **bf), x, torch.ones(H, **bf), 1e-6)
    keys, values = torch.zeros(seqs, entries, kv, d, **bf), torch.zeros(seqs, entries, kv, d, **bf)
    qkvr = torch.zeros(rows, (heads + 2 * kv) * d + heads * d_rel, **bf)
    conv_state, conv_weight, norm = torch.zeros(seqs, 2 * kv * d, 3), torch.zeros(2 * kv * d, 1, 4, **bf), torch.ones(d)
    q = decode_attention_prologue(qkvr, heads, conv_state, conv_weight, norm, norm, 1e-6, keys, values, seq, pos, 512)
    r = torch.zeros(rows, heads, d_rel, **bf)
    decode_attention(q, r, keys, values, torch.zeros(d_rel, 1024, **bf), seq, pos, entries, True)
    logits = dense.linear(x, torch.zeros(ROUTED + SHARED, H, **bf))
    index, weights = shared_sink_route(logits, torch.zeros(ROUTED, **bf), torch.ones(1, **bf), TOP_K, SHARED, 2.5)
    experts, slots = ROUTED + SHARED, torch.zeros(rows, dtype=torch.long)
    _, row_tokens, row_experts, row_w, row_slots, ends, places = triton_moe.moe_dispatch(index, weights, slots, experts)
    gate_up = triton_moe.expert_matmul(x, torch.zeros(experts, 2 * F, H, **bf), ends, row_tokens, rows, None, ROUTED)
    triton_moe.silu_mul(gate_up)
    act, y = triton_moe.silu_mul_shrink(gate_up, torch.zeros(S, experts, R, F, **bf), row_slots, row_experts, groups)
    down_b = torch.zeros(S, 2, H, R, **bf)
    down = RowExpand(y, down_b, row_slots, row_experts, torch.ones(S, 2), groups)
    out = triton_moe.expert_matmul(act, torch.zeros(experts, H, F, **bf), ends, None, rows, down, ROUTED)
    triton_moe.moe_combine(out, row_w, places, rows, torch.bfloat16)
    triton_moe.moe_combine(out, row_w, places, rows, torch.bfloat16, down)
    conv_weight_h, norm_h = torch.zeros(H, 1, 4, **bf), torch.ones(H, **bf)
    short_conv_step(out, torch.zeros(seqs, H, 3), seq, conv_weight_h, x, norm_h, 1e-6, combine=(row_w, places))
    qkvr_offsets, s_qkvr = (0, 2048, 2560, 3072, 3328), torch.ones(S, 4)
    a_qkvr, b_qkvr = torch.zeros(S, 4 * R, H, **bf), torch.zeros(S, qkvr_offsets[-1], R, **bf)
    dense.lora_linear(x, torch.zeros(qkvr_offsets[-1], H, **bf), a_qkvr, b_qkvr, slots, s_qkvr, qkvr_offsets)
    wide = torch.zeros(128, H, **bf)  # past the one-launch sizes: the chained shrink, then the chained expand
    lora_out = torch.zeros(128, qkvr_offsets[-1], **bf)
    dense.lora_shrink_expand(wide, a_qkvr, b_qkvr, torch.zeros(128, dtype=torch.long), s_qkvr, lora_out, qkvr_offsets)
    gate_up_shrink = TokenShrink(torch.zeros(S, 2 * 2 * R, H, **bf), slots)
    gate_up_b = torch.zeros(S, 2, experts, F, R, **bf)
    shrink_in = RowExpand(gate_up_shrink, gate_up_b, row_slots, row_experts, torch.ones(S, 4), groups)
    triton_moe.expert_matmul(x, torch.zeros(experts, 2 * F, H, **bf), ends, row_tokens, rows, shrink_in, ROUTED)

    def order(kernel) -> tuple[int, int, int]:
        ptx = kernel.asm["ptx"]
        first = min(i for i in (ptx.find(access) for access in ACCESSES) if i > -1)
        return ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait"), first

    shrinks = {"_split_shrink_kernel", "_shrink_kernel"}
    early_readers = {"_decode_attention_kernel"}  # reads cache entries of earlier steps before its wait
    chained = [(name, kernel) for name, kwargs, kernel in compiled if kwargs.get("CHAINED")]
    want = {"_short_conv_step_kernel", "_decode_prologue_kernel", "_decode_attention_kernel", "_linear_kernel"}
    want |= {"_route_kernel", "_dispatch_kernel", "_expert_matmul_kernel", "_silu_mul_kernel", "_combine_kernel"}
    want |= {"_combine_down_kernel", "_split_shrink_kernel", "_expand_kernel"}
    assert want <= {name for name, _ in chained}, f"not compiled chained: {sorted(want - {n for n, _ in chained})}"
    for name, kernel in chained:
        trigger, wait, first = order(kernel)
        if name in shrinks:
            assert -1 < wait < min(trigger, first), f"{name}: wait at {wait}, trigger at {trigger}, first at {first}"
        elif name in early_readers:
            ptx = kernel.asm["ptx"]
            write = min(i for i in (ptx.find(access) for access in WRITES) if i > -1)
            order_seen = f"{name}: trigger {trigger}, load {first}, wait {wait}, write {write}"
            assert -1 < trigger < first < wait < write, order_seen
        else:
            assert -1 < trigger < wait < first, f"{name}: trigger at {trigger}, wait at {wait}, first at {first}"
    pairs = [(n, k) for n, kwargs, k in compiled if kwargs.get("WAIT_FOR_SHRINK") or kwargs.get("WAIT_FOR_Y")]
    assert {n for n, _ in pairs} == {"_linear_kernel", "_expert_matmul_kernel"}, f"LoRA pair GEMMs: {pairs}"
    for name, kernel in pairs:
        trigger, wait, first = order(kernel)
        assert -1 < first < wait < trigger, f"{name}: first access at {first}, wait at {wait}, trigger at {trigger}"
    print(f"chained for sm_90: {len(chained)} kernels, {len(pairs)} LoRA pair GEMMs")


def test_decode_chain_kernels_wait_before_their_first_access():
    run_in_child("tests.kernels.test_compile_sm90", "run_chain_cases", "chained for sm_90", timeout=600)
