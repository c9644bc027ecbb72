"""Prefill throughput of the native engine: one step that prefills a batch of prompts, with 0/1/4/8 adapters.

A batch of `--batch` prompts of `--prompt` random tokens, each asking for one new token, so the step is all
prefill; request i uses adapter i mod n (rank `--rank`, 16, over every target group). Each case is timed `--repeats`
times after a warm-up run and the median is kept. Set two engines side by side by running this script under
each (for example the previous commit's package first on PYTHONPATH).
Each row also gives the step's matrix throughput: 2 FLOPs per active weight per prompt token (every linear weight
a token passes through: attention, dense MLPs, the router, top-k routed plus the shared experts; not the embedding
or the LM head, which prefill applies to one row per prompt; attention's own products not counted), against
`--peak` (the H200's dense bf16 figure). `--profile` then prints the CUDA kernels of one step by total time, with no
adapter and with 8, how much of the step's wall time the GPU was busy, and the host's functions (cProfile).
`--graph-prefill-tokens` sets the engine's limit for prefill steps replayed from CUDA graphs (its default, 8192,
replays a step of 8 x 1,024 tokens; 0 runs every step eagerly).
Run: python benchmarks/bench_prefill.py [--preset inkling-small] [--profile] [--graph-prefill-tokens 0]
CPU smoke run: python benchmarks/bench_prefill.py --preset inkling-tiny --device cpu --prompt 16 --repeats 1
"""

import cProfile
import pstats
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
from inkwell.serving.contract import EngineConfig
from inkwell.serving.native.engine import Engine


def active_weights(engine: Engine) -> int:
    """The linear weights one prompt token passes through in prefill (see the module docstring)."""
    cfg = engine.model_config
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) / (cfg.n_routed_experts + cfg.n_shared_experts)
    total = 0.0
    for name, weight in engine.model.w.items():
        if weight.dim() < 2 or "embed_tokens" in name or name.startswith("lm_head") or "conv1d" in name:
            continue
        total += weight.numel() * (experts if ".all_experts." in name else 1)
    return int(total)


def profile_step(engine: Engine, clock: Clock, prompts, keys) -> None:
    """The CUDA kernels of one prefill step by total time, and the share of the step the GPU was busy (`keys`: each
    prompt's adapter, None for none)."""
    from torch.profiler import ProfilerActivity, profile

    engine_batch(engine, clock, prompts, keys, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = engine_batch(engine, clock, prompts, keys, 1)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    adapters = len({key for key in keys if key is not None})
    print(
        f"\nprofiled step with {adapters} adapters: {run['prefill_s'] * 1e3:.1f} ms wall (under the profiler), "
        f"GPU busy {busy:.1f} ms, {launches} kernel launches"
    )
    print("| kernel | calls | total ms | share of busy |\n|---|---|---|---|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        ms = e.self_device_time_total / 1e3
        print(f"| {e.key[:90]} | {e.count} | {ms:.2f} | {ms / busy:.1%} |")
    host = cProfile.Profile()
    host.runcall(engine_batch, engine, clock, prompts, keys, 1)
    print("\nthe host's side of one more step, by time in each function itself (cProfile):")
    pstats.Stats(host).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the GPU (H200: 989e12)")
    ap.add_argument("--profile", action="store_true", help="then profile one step with no adapter and one with 8")
    ap.add_argument(
        "--graph-prefill-tokens",
        type=int,
        default=EngineConfig.graph_prefill_tokens,
        help="EngineConfig.graph_prefill_tokens: steps padding to at most this many token places replay CUDA graphs",
    )
    args = parse_engine_args(ap)
    clock = Clock(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        prompts = make_prompts(args.batch, args.prompt)
        engine = make_engine(
            model_dir, random_adapters(model_dir, args.rank), args, graph_prefill_tokens=args.graph_prefill_tokens
        )
        flops_per_token = 2 * active_weights(engine)
        print(
            f"{args.batch} x {args.prompt} tokens; {flops_per_token / 2e9:.3f}B active weights per token; "
            f"graph_prefill_tokens {args.graph_prefill_tokens}\n"
        )
        print("| adapters | prefill tok/s | step ms | TFLOP/s | of peak |\n|---|---|---|---|---|")
        for n in COUNTS:
            keys = adapter_keys(n, args.batch)
            engine_batch(engine, clock, prompts, keys, 1)  # warm-up
            runs = [rates(engine_batch(engine, clock, prompts, keys, 1))["prefill_tok_s"] for _ in range(args.repeats)]
            tok_s = statistics.median(runs)
            step_ms = args.batch * args.prompt / tok_s * 1e3
            flops = tok_s * flops_per_token
            print(f"| {n} | {tok_s:.0f} | {step_ms:.1f} | {flops / 1e12:.1f} | {flops / args.peak:.1%} |", flush=True)
        if args.profile:
            for n in (0, COUNTS[-1]):
                profile_step(engine, clock, prompts, adapter_keys(n, args.batch))


if __name__ == "__main__":
    main()
