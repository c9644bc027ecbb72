"""The routed/shared experts' LoRA kernels at decode, each way the Triton launchers can run them, in one run.

inkling-small's MoE layer: hidden 2048, expert width 512, 16 routed experts (top 4) and 2 shared ones in one id
space, rank 16, 8 adapter slots, bf16. Each token's 6 dispatched rows are sorted by expert as the engine sorts
them; token i uses adapter i mod n. Two ops, as a decode step runs them:
  gate_up  expert_in_lora_expand: per-expert B over the tokens' shared-A shrink, added to the gate/up output
  down     expert_down_lora: per-expert A then the group's shared B, added to the down output
Paths (`inkwell.kernels.triton_lora.expert_paths.EXPERT_PATHS`, which the kernel tests run too):
  per row      one program per (row, column tile); the decode default (rows <= ROW_MAX_ROWS)
  segments     one program per (expert, slot, column tile) over the rows' segment ends (the default before)
  token tiles  token tiles walking their (slot, expert) groups (no segment ends)
Figures are µs per op from CUDA-graph replays of 20 calls cycling over 8 weight sets (bench_lora_kernels'
time_graph), so the adapters' factors are not served from L2.
Run: python benchmarks/bench_expert_lora.py [--tokens 8 32] [--out expert_lora.json]
"""

import argparse
from pathlib import Path

import torch
from bench_lora_kernels import SETS, time_graph, write_rows

from inkwell.kernels import dispatch
from inkwell.kernels.torch_ops import ExpertGroups
from inkwell.kernels.triton_lora.expert_paths import EXPERT_PATHS, expert_path

HIDDEN, WIDTH, ROUTED, SHARED, TOP_K, RANK, SLOTS = 2048, 512, 16, 2, 4, 16, 8
GROUPS = ExpertGroups(0, ROUTED + SHARED, split=ROUTED)
ADAPTERS = (1, 4, 8)


def dispatched_rows(tokens: int, adapters: int, gen: torch.Generator) -> dict:
    """Each token's top-k routed experts and every shared one, sorted by expert, with slots and segment ends."""
    routed = torch.rand(tokens, ROUTED, generator=gen).topk(TOP_K, dim=1).indices
    shared = torch.arange(ROUTED, ROUTED + SHARED).expand(tokens, -1)
    index = torch.cat([routed, shared], dim=1).reshape(-1)
    experts, order = index.sort(stable=True)
    token_of_row = order // (TOP_K + SHARED)
    slots = (torch.arange(tokens) % adapters)[token_of_row]
    ends = torch.searchsorted(experts, torch.arange(ROUTED + SHARED), right=True).to(torch.int32)
    return {k: v.cuda() for k, v in dict(experts=experts, tokens=token_of_row, slots=slots, ends=ends).items()}


def bench(tokens: int, adapters: int, gen: torch.Generator) -> dict:
    rows = dispatched_rows(tokens, adapters, gen)
    m = rows["experts"].numel()
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    experts = GROUPS.count
    y_in = torch.randn(tokens, 2 * GROUPS.groups * RANK, **bf16)
    b_in = [torch.randn(SLOTS, 2, experts, WIDTH, RANK, **bf16) / 4 for _ in range(SETS)]
    a_down = [torch.randn(SLOTS, experts, RANK, WIDTH, **bf16) / 22 for _ in range(SETS)]
    b_down = [torch.randn(SLOTS, GROUPS.groups, HIDDEN, RANK, **bf16) / 4 for _ in range(SETS)]
    in_scalings = torch.rand(SLOTS, 2 * GROUPS.groups, device="cuda") + 0.5
    down_scalings = in_scalings[:, : GROUPS.groups].contiguous()
    act = torch.randn(m, WIDTH, **bf16)
    gate_up, down = torch.randn(m, 2 * WIDTH, **bf16), torch.randn(m, HIDDEN, **bf16)
    out = {"tokens": tokens, "adapters": adapters, "rows": m}
    for path in EXPERT_PATHS:
        with expert_path(path, rows["ends"]) as ends:
            out[f"gate_up_{path}"] = time_graph(
                lambda i, ends=ends: dispatch.expert_in_lora_expand(
                    y_in, b_in[i], rows["slots"], rows["experts"], in_scalings, gate_up, rows["tokens"], GROUPS, ends
                )
            )
            out[f"down_{path}"] = time_graph(
                lambda i, ends=ends: dispatch.expert_down_lora(
                    act, a_down[i], b_down[i], rows["slots"], rows["experts"], down_scalings, down, GROUPS, ends
                )
            )
    return out


def table(rows: list[dict]) -> str:
    paths = list(EXPERT_PATHS)
    head = ["tokens", "adapters", "rows", *(f"{op} {p}" for op in ("gate_up", "down") for p in paths)]
    head += ["gate_up+down, per row / segments"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["tokens"]), str(r["adapters"]), str(r["rows"])]
        cells += [f"{r[f'{op}_{p}']:.1f}" for op in ("gate_up", "down") for p in paths]
        pair = {p: r[f"gate_up_{p}"] + r[f"down_{p}"] for p in paths}
        cells.append(f"{pair['per row'] / pair['segments']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\n8 adapters / 1 adapter (gate_up + down):")
    for tokens in sorted({r["tokens"] for r in rows}):
        by_n = {r["adapters"]: r for r in rows if r["tokens"] == tokens}
        pair = {p: [by_n[n][f"gate_up_{p}"] + by_n[n][f"down_{p}"] for n in (1, 8)] for p in paths}
        lines.append(f"  {tokens} tokens: " + ", ".join(f"{p} {v[1] / v[0]:.3f}" for p, v in pair.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = [bench(t, n, gen) for t in args.tokens for n in ADAPTERS]
    print(table(results))
    if args.out is not None:
        write_rows(args.out, results)


if __name__ == "__main__":
    main()
