"""The MoE row kernels that carry the experts' LoRA, each against the same kernel without it, in one run.

inkling-small's MoE layer: hidden 2048, expert width 512, 16 routed experts (top 4) and 2 shared ones in one id
space, rank 16, 8 adapter slots (token i on slot i // (tokens / 8), as prefill chunks of 8 sequences), bf16; the
rows sorted by expert as `moe_dispatch` sorts them. Two ops, as a step runs them past decode sizes:
  combine   moe_combine: each token's rows weighted and summed, with the down LoRA added (`_combine_down_kernel`)
  silu_mul  silu(gate) * up of each row, with the gate/up LoRA added as the rows are read
Columns are µs per op from CUDA-graph replays (bench_lora_kernels' time_graph, the LoRA factors cycling over 8
sets), and with LoRA / without. `--sweep` also times the combine at other (tokens, columns) program tiles by setting
`triton_moe.combine_down_tiles`, as a ratio to the launcher's own choice.
Run: python benchmarks/bench_moe_rows.py [--tokens 64 1024 8192] [--sweep] [--out moe_rows.json]
"""

import argparse
from pathlib import Path

import torch
from bench_lora_kernels import SETS, time_graph, write_rows

from inkwell.kernels import triton_moe
from inkwell.kernels.torch_ops import ExpertGroups, RowExpand

HIDDEN, WIDTH, ROUTED, SHARED, TOP_K, RANK, SLOTS = 2048, 512, 16, 2, 4, 16, 8
GROUPS = ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
COMBINE_TILES = [(16, 64), (16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128)]


def expert_index(tokens: int, gen: torch.Generator, routed: int, shared: int, top_k: int) -> torch.Tensor:
    """Each token's experts [tokens, top_k + shared] as a router gives them: top_k distinct routed ones drawn at
    random, then the shared ones (ids routed .. routed + shared - 1)."""
    picks = torch.rand(tokens, routed, generator=gen).argsort(dim=1)[:, :top_k]
    return torch.cat([picks, torch.arange(routed, routed + shared).expand(tokens, -1)], dim=1)


def expert_expands(
    tokens: int, row_slots: torch.Tensor, experts: torch.Tensor, hidden: int = HIDDEN, ffn: int = WIDTH
) -> tuple[list[RowExpand], list[RowExpand]]:
    """SETS gate/up and SETS down LoRA expands (`RowExpand`) of the dispatched rows of `tokens` tokens (the rows'
    slots and experts) at RANK over SLOTS slots, the routed and the shared experts in two GROUPS; y as the MoE head
    (gate/up, a row per token) and silu * up (down, a row per dispatched row) leave it. Each set has its own B (and
    the down its own y and scalings), so cycling the sets reads B from HBM."""
    bf16, rows = dict(device="cuda", dtype=torch.bfloat16), row_slots.numel()
    y_in = torch.randn(tokens, 2 * GROUPS.groups * RANK, **bf16)
    in_scalings = torch.rand(SLOTS, 2 * GROUPS.groups, device="cuda") + 0.5
    gate_up = [
        RowExpand(y_in, torch.randn(SLOTS, 2, GROUPS.count, ffn, RANK, **bf16) / 4, row_slots, experts, in_scalings,
                  GROUPS)
        for _ in range(SETS)
    ]  # fmt: skip
    down = [
        RowExpand(
            torch.randn(rows, RANK, **bf16),
            torch.randn(SLOTS, GROUPS.groups, hidden, RANK, **bf16) / 4,
            row_slots,
            experts,
            torch.rand(SLOTS, GROUPS.groups, device="cuda") + 0.5,
            GROUPS,
        )
        for _ in range(SETS)
    ]
    return gate_up, down


def bench(tokens: int, sweep: bool, gen: torch.Generator) -> dict:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    index = expert_index(tokens, gen, ROUTED, SHARED, TOP_K).to("cuda")
    weights = torch.rand(tokens, TOP_K + SHARED, **bf16)
    token_slots = torch.arange(tokens, device="cuda") * SLOTS // tokens
    _, row_tokens, experts, row_weights, row_slots, _, places = triton_moe.moe_dispatch(
        index, weights, token_slots, GROUPS.count
    )
    rows = row_tokens.numel()
    down = torch.randn(rows, HIDDEN, **bf16)
    gate_up = torch.randn(rows, 2 * WIDTH, **bf16)
    gate_up_lora, down_lora = expert_expands(tokens, row_slots, experts)

    def combine(lora: list[RowExpand] | None):
        return lambda i: triton_moe.moe_combine(
            down, row_weights, places, tokens, torch.bfloat16, None if lora is None else lora[i]
        )

    out = {"tokens": tokens, "rows": rows, "combine": time_graph(combine(None))}
    out["combine_lora"] = time_graph(combine(down_lora))
    out["silu_mul"] = time_graph(lambda i: triton_moe.silu_mul(gate_up))
    out["silu_mul_lora"] = time_graph(lambda i: triton_moe.silu_mul(gate_up, gate_up_lora[i], row_tokens))
    if sweep:
        chosen, want = triton_moe.combine_down_tiles, combine(down_lora)(0)
        try:
            for tile in COMBINE_TILES:
                triton_moe.combine_down_tiles = lambda _tokens, tile=tile: tile
                torch.testing.assert_close(combine(down_lora)(0), want, msg=f"the combine at tiles {tile} differs")
                out[f"combine_lora {tile[0]}x{tile[1]}"] = time_graph(combine(down_lora))
        finally:
            triton_moe.combine_down_tiles = chosen
        out["chosen"] = "x".join(map(str, chosen(tokens)))
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| tokens | rows | combine | with down LoRA | ratio | silu_mul | with gate/up LoRA | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['tokens']} | {r['rows']} | {r['combine']:.1f} | {r['combine_lora']:.1f} | "
            f"{r['combine_lora'] / r['combine']:.2f} | {r['silu_mul']:.1f} | {r['silu_mul_lora']:.1f} | "
            f"{r['silu_mul_lora'] / r['silu_mul']:.2f} |"
        )
    for r in (r for r in results if "chosen" in r):
        us = {f"{t[0]}x{t[1]}": r[f"combine_lora {t[0]}x{t[1]}"] for t in COMBINE_TILES}
        tiles = ", ".join(f"{tile} {t:.1f} ({t / r['combine_lora']:.2f})" for tile, t in us.items())
        lines.append(f"\ncombine with the down LoRA at {r['tokens']} tokens (launcher: {r['chosen']}), µs: {tiles}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--sweep", action="store_true", help="also time the combine at other program tiles")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = [bench(t, args.sweep, gen) for t in args.tokens]
    print(table(results))
    if args.out is not None:
        write_rows(args.out, results)


if __name__ == "__main__":
    main()
