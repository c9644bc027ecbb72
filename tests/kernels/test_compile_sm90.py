"""The MoE, router and LoRA Triton kernels compile for the H200 (sm_90a, ptxas included) on a machine without a GPU.

CI has no GPU, and Triton's interpreter runs a kernel's Python, not its compile: a kernel that does not compile
(a dot below 16 rows, a type or layout error) would pass every CPU test and fail only on a device. Here, in a child
process, Triton's active driver is a stand-in that names sm_90 as the target, every launch compiles without running
(JITFunction.run with warmup), and CPU tensors report themselves as CUDA, so the launchers choose what they choose on
the GPU (libdevice, programmatic dependent launch); each op is called at inkling-small's sizes, bf16, rank 16, 8
slots, at decode and prefill sizes, so each program shape its launcher picks is compiled. Every kernel of the
modules must compile at least once: a new kernel needs a call here.
"""

import torch

from tests.kernels.helpers import run_in_child

H, F, R, S, ROUTED, SHARED, TOP_K = 2048, 512, 16, 8, 16, 2, 4


def run_compile_cases() -> None:
    import triton
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

    compiled: set[str] = set()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled.add(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    driver.set_active(CompileOnly())
    JITFunction.run = compile_only
    torch.Tensor.is_cuda = property(lambda self: True)  # the launchers' branch for CUDA tensors

    import inkwell.kernels.triton_lora as triton_lora
    from inkwell.kernels import triton_moe, triton_router
    from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink
    from inkwell.kernels.triton_lora import dense, expert

    bf = dict(dtype=torch.bfloat16)
    experts, groups = ROUTED + SHARED, ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
    qkvr = (0, 2048, 2560, 3072, 3328)
    for tokens in (8, 64, 2048):  # decode, decode past the LoRA epilogues, prefill
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
        expert.expert_in_lora_expand(y_in, gate_up_b, row_slots, row_experts, s_in, gate_up, row_tokens, groups, ends)
        expert.expert_out_lora_expand(y_down, b_down, row_slots, row_experts, s_down, down, groups)
        expert.expert_down_lora(act, a_down, b_down, row_slots, row_experts, s_down, down, groups, ends)
        a, b = torch.zeros(S, 4 * R, H, **bf), torch.zeros(S, qkvr[-1], R, **bf)
        out = torch.zeros(tokens, qkvr[-1], **bf)
        dense.lora_linear(x, torch.zeros(qkvr[-1], H, **bf), a, b, token_slots, torch.ones(S, 4), qkvr)
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
    missing = sorted(kernels - compiled)
    assert not missing, f"kernels no call here compiled: {missing}"
    print(f"compiled for sm_90: {len(kernels)} kernels")


def test_moe_router_and_lora_kernels_compile_for_sm90():
    run_in_child("tests.kernels.test_compile_sm90", "run_compile_cases", "compiled for sm_90", timeout=600)
