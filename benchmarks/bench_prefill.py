"""Prefill throughput of the native engine: one step that prefills a batch of prompts, with 0/1/4/8 adapters.

A batch of `--batch` prompts of `--prompt` random tokens, each asking for one new token, so the step is all
prefill; request i uses adapter i mod n (rank 16 over every target group). Each case is timed `--repeats`
times after a warm-up run and the median is kept. Set two engines side by side by running this script under
each (for example the previous commit's package first on PYTHONPATH).
Run: python benchmarks/bench_prefill.py [--preset inkling-small]
CPU smoke run: python benchmarks/bench_prefill.py --preset inkling-tiny --device cpu --prompt 16 --repeats 1
"""

import statistics
import tempfile
from pathlib import Path

import torch
from bench_serving import (
    COUNTS,
    Clock,
    adapter_keys,
    engine_batch,
    engine_parser,
    make_engine,
    make_prompts,
    parse_engine_args,
    random_adapters,
    rates,
)

from inkwell.models import init_base_model


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = parse_engine_args(ap)
    clock = Clock(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        prompts = make_prompts(args.batch, args.prompt)
        engine = make_engine(model_dir, random_adapters(model_dir), args)
        print("| adapters | prefill tok/s |\n|---|---|")
        for n in COUNTS:
            keys = adapter_keys(n, args.batch)
            engine_batch(engine, clock, prompts, keys, 1)  # warm-up
            runs = [rates(engine_batch(engine, clock, prompts, keys, 1))["prefill_tok_s"] for _ in range(args.repeats)]
            print(f"| {n} | {statistics.median(runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
