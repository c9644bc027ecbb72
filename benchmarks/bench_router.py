"""The shared-sink router on one GPU: the Triton kernel (`inkwell.kernels.triton_router`) against the torch ops it
replaces, at inkling-small's sizes (hidden 2048, 16 routed experts, top 4, 2 shared), bf16, decode (8 tokens) and
prefill (8192 tokens), and 1, 32 and 128 tokens (decode batches); and at decode sizes the MoE layer's head, the gate
GEMM, the routing and the dispatch, as the engine ran them apart and as one kernel (`triton_route_dispatch`).

Every figure is µs per call from CUDA-graph replays (bench_lora_kernels.time_graph: each graph runs the op REPS
times over SETS inputs), median of replays. Columns: gemm (the gate's F.linear alone, cuBLAS, the same in both
paths), torch and kernel (what follows it), and the whole route (gemm + each); head apart (the chained Triton gate
GEMM, the router kernel, the one-program dispatch) and head kernel. Before timing, the kernel's indices are checked
equal to torch's on these inputs and its weights' largest difference is printed.
Run: python benchmarks/bench_router.py [--out router.json]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from bench_lora_kernels import SETS, time_graph

from inkwell.kernels import torch_ops
from inkwell.kernels.dispatch import ROUTE_DISPATCH_MAX_TOKENS, linear
from inkwell.kernels.triton_moe import moe_dispatch
from inkwell.kernels.triton_route_dispatch import gate_route_dispatch
from inkwell.kernels.triton_router import shared_sink_route
from inkwell.models.presets import preset_config

TOKENS = (1, 8, 32, 128, 8192)


def bench(tokens: int, gen: torch.Generator) -> dict:
    cfg = preset_config("inkling-small")
    routed, shared, top_k = cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok
    dev = dict(device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(tokens, cfg.hidden_size, generator=gen).to(**dev) for _ in range(SETS)]
    gate = (0.02 * torch.randn(routed + shared, cfg.hidden_size, generator=gen)).to(**dev)
    bias = (0.01 * torch.randn(routed, generator=gen)).to(**dev)
    scale = torch.ones(1, **dev)
    rest = (bias, scale, top_k, shared, cfg.route_scale)
    logits = [F.linear(x, gate) for x in xs]

    got, want = shared_sink_route(logits[0], *rest), torch_ops.shared_sink_route(logits[0], *rest)
    row = {
        "tokens": tokens,
        "indices_equal": torch.equal(got[0], want[0]),
        "max_weight_diff": float((got[1].float() - want[1].float()).abs().max()),
    }
    row["gemm"] = time_graph(lambda i: F.linear(xs[i], gate))
    row["torch"] = time_graph(lambda i: torch_ops.shared_sink_route(logits[i], *rest))
    row["kernel"] = time_graph(lambda i: shared_sink_route(logits[i], *rest))
    row["route_torch"] = time_graph(lambda i: torch_ops.shared_sink_route(F.linear(xs[i], gate), *rest))
    row["route_kernel"] = time_graph(lambda i: shared_sink_route(F.linear(xs[i], gate), *rest))
    if tokens <= ROUTE_DISPATCH_MAX_TOKENS:
        slots = torch.arange(tokens, device="cuda") % 8
        experts = routed + shared

        def apart(i: int) -> tuple:
            index, weights = shared_sink_route(linear(xs[i], gate), *rest)
            return moe_dispatch(index, weights, slots, experts)

        row["head_apart"] = time_graph(apart)
        row["head_kernel"] = time_graph(lambda i: gate_route_dispatch(xs[i], gate, *rest, slots))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=argparse.FileType("w"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [bench(tokens, gen) for tokens in TOKENS]
    print(f"{torch.cuda.get_device_name()}, inkling-small router, bf16, µs per call (CUDA graphs)\n")
    print("| tokens | gemm | torch | kernel | speedup | route: torch | kernel | speedup | same indices | max dw "
          "| head: apart | kernel | speedup |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        after, whole = r["torch"] / r["kernel"], r["route_torch"] / r["route_kernel"]
        head = "| - | - | - |"
        if "head_kernel" in r:
            head = f"| {r['head_apart']:.1f} | {r['head_kernel']:.1f} | {r['head_apart'] / r['head_kernel']:.2f}x |"
        print(
            f"| {r['tokens']} | {r['gemm']:.1f} | {r['torch']:.1f} | {r['kernel']:.1f} | {after:.1f}x "
            f"| {r['route_torch']:.1f} | {r['route_kernel']:.1f} | {whole:.2f}x "
            f"| {r['indices_equal']} | {r['max_weight_diff']:.1e} {head}"
        )
    if args.out is not None:
        json.dump(rows, args.out, indent=2)


if __name__ == "__main__":
    main()
