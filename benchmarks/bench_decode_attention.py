"""The decode attention kernel alone (`inkwell.kernels.triton_decode_attention.decode_attention`) at inkling-small's
attention shapes (16 query heads over 4 kv heads of 128, the relative bias of 16 over 1,024 distances): rows of 1,
8, 32 and 128 sequences, each `--context` positions in (every row at the last), in a sliding layer (a ring of 512
entries) and a full layer (entries: the context rounded up to 256), bf16.

Timing: µs per call from CUDA-graph replays (`bench_lora_kernels.time_graph`: the engine's decode steps are replays),
the calls cycling over its SETS caches, so that the keys come from memory, not L2, as they do in a step.
GB/s counts the keys and values the rows see (each kv head's, once) over the call's time: an H100's HBM3 peaks at
3.35 TB/s, an H200's HBM3e at 4.8. `--runs 1` runs each (row, kv head) as one program; `--block-p`, `--warps`
and `--late` (no cache read before the chain's wait) try the launch's other shapes.
Run: python benchmarks/bench_decode_attention.py [--rows 1 8 32 128] [--context 160 640 2048] [--out f.json]
"""

import argparse
import json

import torch
import triton
from bench_lora_kernels import SETS, time_graph

from inkwell.kernels.triton_decode_attention import decode_attention
from inkwell.models.presets import preset_config


def time_case(rows: int, context: int, sliding: bool, launch: dict) -> dict:
    config = preset_config("inkling-small")
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    window = config.sliding_window_size
    entries = window if sliding else triton.cdiv(context, 256) * 256
    bf = {"dtype": torch.bfloat16, "device": "cuda"}
    shape = (rows, entries, kv_heads, head_dim)
    caches = [(torch.randn(shape, **bf), torch.randn(shape, **bf)) for _ in range(SETS)]
    q = torch.randn(rows, heads, head_dim, **bf)
    r = torch.randn(rows, heads, config.d_rel, **bf)
    proj = torch.randn(config.d_rel, config.rel_extent, **bf) / 4
    seq = torch.arange(rows, device="cuda")
    pos = torch.full((rows,), context - 1, device="cuda")
    floor = config.log_scaling_n_floor
    log = None if sliding or floor is None else (float(floor), float(config.log_scaling_alpha))

    def call(i: int) -> None:
        keys, values = caches[i]
        decode_attention(q, r, keys, values, proj, seq, pos, entries, sliding, log, **launch)

    us = time_graph(call)  # its warm-up compiles and makes the split counts before the capture
    seen = min(context, entries)
    kv_bytes = 2 * rows * kv_heads * seen * head_dim * 2
    return {"us": us, "gb_s": kv_bytes / us / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, nargs="+", default=[160, 640, 2048])
    ap.add_argument("--runs", type=int, help="the most runs a row's keys are cut into; default: the kernel's")
    ap.add_argument("--block-p", type=int, help="keys a program scores at a time; default: the kernel's")
    ap.add_argument("--warps", type=int, help="warps a program; default: the kernel's")
    ap.add_argument("--late", action="store_true", help="no cache read before the chain's wait")
    ap.add_argument("--out")
    args = ap.parse_args()
    launch = {"runs": args.runs, "block_p": args.block_p, "num_warps": args.warps}
    launch = {key: value for key, value in launch.items() if value is not None}
    launch |= {"early": False} if args.late else {}
    results = {"gpu": torch.cuda.get_device_name(), "launch": launch, "cases": {}}
    print("| rows | context | layer | µs | GB/s |\n|---|---|---|---|---|")
    for rows in args.rows:
        for context in args.context:
            for sliding in (True, False):
                layer = "sliding" if sliding else "full"
                case = time_case(rows, context, sliding, launch)
                results["cases"][f"{rows}x{context}.{layer}"] = case
                print(f"| {rows} | {context} | {layer} | {case['us']:.1f} | {case['gb_s']:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
