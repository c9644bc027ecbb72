"""The decode step's Triton kernels compiled for sm_90a (H100, H200) on a machine without a GPU, and what their code
holds that a kernel of a few µs on the step's critical path pays in latency: barriers (`bar.sync`), warp shuffles
(`shfl.sync`), registers and the bytes a thread spills (ptxas). Count them before a device call times a change to
such a kernel: the router moved into the ShortConv step compiled to 59 barriers where the step has 5, and made decode
slower (docs/benchmarks.md, "The router inside the ShortConv step").

In this process Triton's active driver is a stand-in that names sm_90 as the target, every launch compiles without
running, and CPU tensors report themselves as CUDA (on a device of 132 multiprocessors), so the launchers choose what
they choose on the GPU; the process can run nothing on a GPU afterwards. tests/kernels/test_compile_sm90.py compiles
the same launches in a child process.

Run: python benchmarks/sm90_census.py [--rows 8] [--out census.json]
"""

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

H, F, R, S, ROUTED, SHARED, TOP_K = 2048, 512, 16, 8, 16, 2, 4  # inkling-small's widths, rank 16, 8 adapter slots
VOCAB = 32000  # inkling-small's vocabulary: the LM head's columns


def compile_only() -> list[tuple[str, dict, object]]:
    """Make every Triton launch in this process compile for sm_90 without running, CPU tensors report themselves as
    CUDA and the device its 132 multiprocessors; returns the list that each launch appends (kernel name, its keyword
    arguments, the compiled kernel) to."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:
        """Triton's driver as far as compiling a launch needs it: sm_90's target, device 0, stream 0."""

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

    class Properties:
        """What the launchers read of the device: an H100 SXM's or an H200's multiprocessors."""

        multi_processor_count = 132

    driver.set_active(CompileOnly())
    JITFunction.run = compile_launch
    torch.Tensor.is_cuda = property(lambda self: True)  # the launchers' branch for CUDA tensors
    torch.cuda.get_device_properties = lambda device=None: Properties()
    return compiled


def ptxas_usage(kernel) -> tuple[int, int]:
    """(registers a thread uses, bytes a thread spills to local memory) of a compiled kernel, as ptxas (sm_90a)
    reports them."""
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
    registers = max((int(n) for n in re.findall(r"Used (\d+) registers", report)), default=0)
    return registers, sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def instructions(ptx: str, opcode: str) -> int:
    """How many instructions of `opcode` (e.g. "bar.sync", "shfl.sync") the PTX text holds."""
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(opcode)}\b", ptx, flags=re.MULTILINE))


def decode_chain(rows: int = 8) -> None:
    """Launch each kernel of a decode step of `rows` sequences with adapters, in the step's order, at inkling-small's
    widths (bf16; zeros, since nothing runs): the ShortConv step, the attention prologue and the decode attention,
    the router's gate GEMM, routing and dispatch in one kernel (and apart), the experts' GEMMs with their LoRA,
    silu * up, the combines, the ShortConv step that combines; then a q/k/v/r projection with its LoRA at `rows` and
    at 128 tokens (cuBLAS, then the chained shrink and expand), and the LM head's LoRA at 128 tokens. The
    size-dependent ops go through `kernels.dispatch` as the engine's do, so a launch that is cuBLAS or torch at
    `rows` runs on the CPU and compiles nothing."""
    from inkwell.kernels import dispatch, triton_moe
    from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink
    from inkwell.kernels.triton_attention_prologue import decode_attention_prologue
    from inkwell.kernels.triton_decode_attention import decode_attention
    from inkwell.kernels.triton_lora import dense
    from inkwell.kernels.triton_router import shared_sink_route
    from inkwell.kernels.triton_short_conv import short_conv_step

    bf, seqs, entries, heads, kv, d, d_rel = dict(dtype=torch.bfloat16), 4, 512, 16, 4, 128, 16
    groups = ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
    x, seq, pos = torch.zeros(rows, H, **bf), torch.arange(rows) % seqs, torch.full((rows,), 7)
    short_conv_step(x, torch.zeros(seqs, H, 3), seq, torch.zeros(H, 1, 4, **bf), x, torch.ones(H, **bf), 1e-6)
    keys, values = torch.zeros(seqs, entries, kv, d, **bf), torch.zeros(seqs, entries, kv, d, **bf)
    qkvr = torch.zeros(rows, (heads + 2 * kv) * d + heads * d_rel, **bf)
    conv_state, conv_weight, norm = torch.zeros(seqs, 2 * kv * d, 3), torch.zeros(2 * kv * d, 1, 4, **bf), torch.ones(d)
    q = decode_attention_prologue(qkvr, heads, conv_state, conv_weight, norm, norm, 1e-6, keys, values, seq, pos, 512)
    r = torch.zeros(rows, heads, d_rel, **bf)
    decode_attention(q, r, keys, values, torch.zeros(d_rel, 1024, **bf), seq, pos, entries, True)
    experts, slots = ROUTED + SHARED, torch.zeros(rows, dtype=torch.long)
    gate, bias, scale = torch.zeros(experts, H, **bf), torch.zeros(ROUTED, **bf), torch.ones(1, **bf)
    dispatch.gate_route_dispatch(x, gate, bias, scale, TOP_K, SHARED, 2.5, slots)
    a_gate_up = torch.zeros(S, 2 * 2 * R, H, **bf)  # with the experts' gate/up LoRA shrink in programs of its own
    *_, y_head = dispatch.gate_route_dispatch(x, gate, bias, scale, TOP_K, SHARED, 2.5, slots, a_gate_up)
    # apart, as an expert-parallel rank runs them: the gate GEMM, the routing, the dispatch
    index, weights = shared_sink_route(dispatch.linear(x, gate), bias, scale, TOP_K, SHARED, 2.5)
    _, row_tokens, row_experts, row_w, row_slots, ends, places = triton_moe.moe_dispatch(index, weights, slots, experts)
    gate_up = triton_moe.expert_matmul(x, torch.zeros(experts, 2 * F, H, **bf), ends, row_tokens, rows, None, ROUTED)
    triton_moe.silu_mul(gate_up)
    gate_up_b = torch.zeros(S, 2, experts, F, R, **bf)
    head_in = RowExpand(y_head, gate_up_b, row_slots, row_experts, torch.ones(S, 4), groups)  # the head's shrink
    gate_up = triton_moe.expert_matmul(x, torch.zeros(experts, 2 * F, H, **bf), ends, row_tokens, rows, head_in, ROUTED)
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
    dispatch.lora_linear(x, torch.zeros(qkvr_offsets[-1], H, **bf), a_qkvr, b_qkvr, slots, s_qkvr, qkvr_offsets)
    wide = torch.zeros(128, H, **bf)  # past the one-launch sizes: the chained shrink, then the chained expand
    lora_out = torch.zeros(128, qkvr_offsets[-1], **bf)
    dense.lora_shrink_expand(wide, a_qkvr, b_qkvr, torch.zeros(128, dtype=torch.long), s_qkvr, lora_out, qkvr_offsets)
    head_out = torch.zeros(128, VOCAB, **bf)  # the LM head's expand walks each tile's slots (`expand.walks`)
    a_head, b_head = torch.zeros(S, R, H, **bf), torch.zeros(S, VOCAB, R, **bf)
    dense.lora_shrink_expand(wide, a_head, b_head, torch.zeros(128, dtype=torch.long), torch.ones(S), head_out)
    gate_up_shrink = TokenShrink(a_gate_up, slots)
    shrink_in = RowExpand(gate_up_shrink, gate_up_b, row_slots, row_experts, torch.ones(S, 4), groups)
    triton_moe.expert_matmul(x, torch.zeros(experts, 2 * F, H, **bf), ends, row_tokens, rows, shrink_in, ROUTED)


def census(compiled: list[tuple[str, dict, object]]) -> list[dict]:
    """One row per compiled launch: the kernel, its block shape (the BLOCK_* constants), warps, and its counts."""
    rows = []
    for name, kwargs, kernel in compiled:
        ptx = kernel.asm["ptx"]
        registers, spill = ptxas_usage(kernel)
        shape = sorted((k.removeprefix("BLOCK_"), v) for k, v in kwargs.items() if k.startswith("BLOCK_"))
        blocks = " ".join(f"{k}={v}" for k, v in shape)
        rows.append(
            {
                "kernel": name,
                "blocks": blocks,
                "warps": kernel.metadata.num_warps,
                "barriers": instructions(ptx, "bar.sync"),
                "shuffles": instructions(ptx, "shfl.sync"),
                "registers": registers,
                "spill_bytes": spill,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="the decode step's sequences")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    compiled = compile_only()
    decode_chain(args.rows)
    rows = census(compiled)
    print(f"the decode chain at {args.rows} sequences, compiled for sm_90a, in launch order:")
    print("| kernel | blocks | warps | barriers | shuffles | registers | spill bytes |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if args.out:
        args.out.write_text(json.dumps({"rows": args.rows, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
