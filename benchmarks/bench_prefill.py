"""Prefill throughput of the native engine: one step that prefills a batch of prompts, with 0/1/4/8 adapters.

A batch of `--batch` prompts of `--prompt` random tokens, each asking for one new token, so the step is all
prefill; request i uses adapter i mod n (rank 16 over every target group). Each case is timed `--repeats`
times after a warm-up run and the median is kept. Set two engines side by side by running this script under
each (for example the previous commit's package first on PYTHONPATH).
Run: python benchmarks/bench_prefill.py [--preset inkling-small]
CPU smoke run: python benchmarks/bench_prefill.py --preset inkling-tiny --device cpu --prompt 16 --repeats 1
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_serving import COUNTS, RANK, Clock, adapter_keys, engine_batch, make_engine, make_prompts, rates

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, init_base_model, load_base_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="inkling-small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.new = 1
    clock = Clock(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        config, identity = load_base_config(model_dir), base_model_identity(model_dir)
        spec = LoraSpec(rank=RANK, alpha=2 * RANK)
        adapters = [init_adapter(config, spec, identity, seed=i + 1, b_std=0.01) for i in range(max(COUNTS))]
        prompts = make_prompts(args.batch, args.prompt)
        engine = make_engine(model_dir, adapters, args)
        print("| adapters | prefill tok/s |\n|---|---|")
        for n in COUNTS:
            keys = adapter_keys(n, args.batch)
            engine_batch(engine, clock, prompts, keys, 1)  # warm-up
            runs = [rates(engine_batch(engine, clock, prompts, keys, 1))["prefill_tok_s"] for _ in range(args.repeats)]
            print(f"| {n} | {statistics.median(runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
