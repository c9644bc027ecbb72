"""The experts' decode GEMMs on one GPU: `inkwell.kernels.expert_matmul` (the Triton kernel the decode step runs)
over its tile shapes, against the grouped GEMM (`torch._grouped_mm`) on the same rows, at inkling-small's sizes
(16 routed experts, top 4, 2 shared: gate/up [18, 1024, 2048], down [18, 2048, 512]), bf16.

Every figure is µs per call from CUDA-graph replays (bench_lora_kernels.time_graph, cycling over SETS weight sets so
the weights come from HBM), median of replays; GB/s counts the weights of the experts that have rows (each read
once); ratios are against the first tile row, and the tile the kernel picks for the shape (`triton_moe.expert_tiles`)
is starred. Each tile's largest difference from the output of the kernel's own pick is printed. `--adapters 1 8`
also times both GEMMs at the kernel's own tiles with their LoRA epilogue (rank 16, token i on slot i mod n), the
expand's B cycling over SETS sets.
Run: python benchmarks/bench_expert_matmul.py [--tokens 8 32 128] [--adapters 1 8] [--out expert_matmul.json]
"""

import argparse
import json

import torch
from bench_lora_kernels import SETS, time_graph
from bench_moe_rows import expert_expands, expert_index

from inkwell.kernels import expert_matmul, moe_dispatch, triton_moe
from inkwell.models.presets import preset_config

TILES = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (64, 256, 4, 3),
    (64, 128, 8, 4),
    (64, 64, 4, 6),
    (128, 128, 8, 3),
    (128, 64, 4, 4),
    (32, 64, 2, 6),
]


def rows_of(tokens: int, cfg, gen: torch.Generator, adapters: int = 0) -> tuple[torch.Tensor, torch.Tensor, int, tuple]:
    """The dispatched rows' tokens and expert ends of `tokens` tokens, each on top-k random routed experts and the
    shared ones; how many experts have rows; and the rows' (slots, expert ids), token i on adapter slot i mod
    `adapters` (none with 0)."""
    routed, shared, top_k = cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok
    index = expert_index(tokens, gen, routed, shared, top_k).cuda()
    weights = torch.ones(index.shape, dtype=torch.bfloat16, device="cuda")
    token_slots = torch.arange(tokens) % adapters if adapters else torch.full((tokens,), -1)
    _, row_tokens, experts, _, row_slots, ends, _ = moe_dispatch(index, weights, token_slots.cuda(), routed + shared)
    return row_tokens, ends, int(experts.unique().numel()), (row_slots, experts)


def lora_rows(tokens: int, adapters: int, gen: torch.Generator) -> list[dict]:
    """expert_matmul with each GEMM's LoRA in its epilogue (bench_moe_rows' `expert_expands`: its rank, slots and
    groups), at the kernel's own tiles."""
    cfg = preset_config("inkling-small")
    routed, count = cfg.n_routed_experts, cfg.n_routed_experts + cfg.n_shared_experts
    hidden, ffn, dev = cfg.hidden_size, cfg.moe_intermediate_size, dict(device="cuda", dtype=torch.bfloat16)
    row_tokens, ends, _, (row_slots, experts) = rows_of(tokens, cfg, gen, adapters)
    x = torch.randn(tokens, hidden, generator=gen).to(**dev)
    act = torch.randn(row_tokens.shape[0], ffn, generator=gen).to(**dev)
    gate_up = (torch.randn(count, 2 * ffn, hidden, generator=gen) / hidden**0.5).to(**dev)
    down = (torch.randn(count, hidden, ffn, generator=gen) / ffn**0.5).to(**dev)
    gate_up_lora, down_lora = expert_expands(tokens, row_slots, experts, hidden, ffn)
    cases = {
        "gate_up": lambda i: expert_matmul(x, gate_up, ends, row_tokens, tokens, gate_up_lora[i], routed),
        "down": lambda i: expert_matmul(act, down, ends, None, tokens, down_lora[i], routed),
    }
    return [dict(tokens=tokens, gemm=name, adapters=adapters, us=time_graph(call)) for name, call in cases.items()]


def bench(tokens: int, gen: torch.Generator) -> list[dict]:
    cfg = preset_config("inkling-small")
    count, hidden, ffn = cfg.n_routed_experts + cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dev = dict(device="cuda", dtype=torch.bfloat16)
    row_tokens, ends, reached, _ = rows_of(tokens, cfg, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(**dev)
    act = torch.randn(row_tokens.shape[0], ffn, generator=gen).to(**dev)
    gate_up = [(torch.randn(count, 2 * ffn, hidden, generator=gen) / hidden**0.5).to(**dev) for _ in range(SETS)]
    down = [(torch.randn(count, hidden, ffn, generator=gen) / ffn**0.5).to(**dev) for _ in range(SETS)]
    cases = {
        "gate_up": (lambda i: expert_matmul(x, gate_up[i], ends, row_tokens, tokens), gate_up[0][0].numel()),
        "down": (lambda i: expert_matmul(act, down[i], ends, None, tokens), down[0][0].numel()),
    }
    grouped = {
        "gate_up": lambda i: torch._grouped_mm(x[row_tokens], gate_up[i].transpose(1, 2), offs=ends),
        "down": lambda i: torch._grouped_mm(act, down[i].transpose(1, 2), offs=ends),
    }
    out = []
    for name, (call, per_expert) in cases.items():
        gbytes = reached * per_expert * 2 / 1e9
        base = time_graph(grouped[name])
        want = call(0)
        rule = tuple(triton_moe.expert_tiles(gate_up[0].shape[2] if name == "gate_up" else ffn, tokens).values())
        for tile in TILES:
            triton_moe.tile_override = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), tile, strict=True))
            diff = float((call(0).float() - want.float()).abs().max())
            us = time_graph(call)
            row = dict(tokens=tokens, gemm=name, tile=tile, rule=tile == rule, us=us, gb_s=gbytes / us * 1e6)
            out.append(row | dict(grouped_us=base, max_diff=diff))
        triton_moe.tile_override = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--adapters", type=int, nargs="*", default=[], help="also time the GEMMs with their LoRA")
    ap.add_argument("--out", type=argparse.FileType("w"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [row for tokens in args.tokens for row in bench(tokens, gen)]
    lora = [row for tokens in args.tokens for n in args.adapters for row in lora_rows(tokens, n, gen)]
    print(f"{torch.cuda.get_device_name()}, inkling-small experts, bf16, µs per call (CUDA graphs)\n")
    print("| tokens | GEMM | BLOCK_N, BLOCK_K, warps, stages | µs | GB/s | grouped GEMM µs | vs first | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    defaults = {(r["tokens"], r["gemm"]): r["us"] for r in rows if r["tile"] == TILES[0]}
    for r in rows:
        ratio = defaults[(r["tokens"], r["gemm"])] / r["us"]
        tile = ", ".join(map(str, r["tile"])) + (" *" if r["rule"] else "")
        print(
            f"| {r['tokens']} | {r['gemm']} | {tile} | {r['us']:.1f} | {r['gb_s']:.0f} | "
            f"{r['grouped_us']:.1f} | {ratio:.2f}x | {r['max_diff']:.3g} |"
        )
    if lora:
        print("\n| tokens | GEMM | adapters | µs with the LoRA epilogue |\n|---|---|---|---|")
        for r in lora:
            print(f"| {r['tokens']} | {r['gemm']} | {r['adapters']} | {r['us']:.1f} |")
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "lora": lora}, args.out, indent=1)


if __name__ == "__main__":
    main()
