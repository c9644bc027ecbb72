"""The MoE dispatch on one GPU: the Triton counting sort (`inkwell.kernels.triton_moe.moe_dispatch`) against its torch
twin, at decode batches of inkling-small's routing (16 routed experts, top 4, and the 2 shared ones: 6 rows a token).

Every figure is µs per call from CUDA-graph replays (bench_lora_kernels.time_graph: each graph runs the op REPS times
over SETS routings), median of replays; before timing, the kernel's outputs are checked equal to the twin's. With
`--sweep`, the one-program kernel also runs at other (rows per block, warps) shapes, set through
`triton_moe.dispatch_override`, each as a ratio to the launcher's own choice (`triton_moe.dispatch_program`).
Run: python benchmarks/bench_dispatch.py [--sweep] [--out dispatch.json]
"""

import argparse
import json

import torch
from bench_lora_kernels import SETS, time_graph
from bench_moe_rows import expert_index

from inkwell.kernels import torch_ops, triton_moe
from inkwell.models.presets import preset_config

TOKENS = (1, 8, 32, 64, 128, 170)
SHAPES = ((64, 4), (128, 4), (256, 4), (256, 8), (512, 8), (512, 16), (1024, 16))


def routings(tokens: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """SETS routings of `tokens` tokens: each token's top-k distinct routed experts, then the shared ones."""
    cfg = preset_config("inkling-small")
    routed, shared, top_k = cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok
    out = []
    for _ in range(SETS):
        index = expert_index(tokens, gen, routed, shared, top_k)
        weights = torch.rand(tokens, top_k + shared, generator=gen).to(torch.bfloat16)
        slots = torch.randint(-1, 8, (tokens,), generator=gen)
        out.append((index.cuda(), weights.cuda(), slots.cuda(), routed + shared))
    return out


def bench(tokens: int, sweep: bool, gen: torch.Generator) -> dict:
    sets = routings(tokens, gen)
    got, want = triton_moe.moe_dispatch(*sets[0]), torch_ops.moe_dispatch(*sets[0])
    row = {
        "tokens": tokens,
        "rows": sets[0][0].numel(),
        "program": list(triton_moe.dispatch_program(sets[0][0].numel())),
        "equal": all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
        "torch": time_graph(lambda i: torch_ops.moe_dispatch(*sets[i])),
        "kernel": time_graph(lambda i: triton_moe.moe_dispatch(*sets[i])),
    }
    if sweep and row["rows"] <= triton_moe.ONE_PROGRAM_MAX_ROWS:
        for block_m, warps in SHAPES:
            triton_moe.dispatch_override = (block_m, warps)
            try:
                row[f"{block_m}x{warps}"] = time_graph(lambda i: triton_moe.moe_dispatch(*sets[i]))
            finally:
                triton_moe.dispatch_override = None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time the one program at other block shapes")
    ap.add_argument("--out", type=argparse.FileType("w"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [bench(tokens, args.sweep, gen) for tokens in TOKENS]
    print(f"{torch.cuda.get_device_name()}, inkling-small dispatch, µs per call (CUDA graphs)\n")
    shapes = [f"{m}x{w}" for m, w in SHAPES] if args.sweep else []
    print("| tokens | rows | program | torch | kernel | speedup | same outputs |" + "".join(f" {s} |" for s in shapes))
    print("|---" * (7 + len(shapes)) + "|")
    for r in rows:
        cells = "".join(f" {r[s] / r['kernel']:.2f} |" if s in r else " - |" for s in shapes)
        print(
            f"| {r['tokens']} | {r['rows']} | {r['program'][0]}x{r['program'][1]} | {r['torch']:.1f} "
            f"| {r['kernel']:.1f} | {r['torch'] / r['kernel']:.1f}x | {r['equal']} |{cells}"
        )
    if args.out is not None:
        json.dump(rows, args.out, indent=2)


if __name__ == "__main__":
    main()
