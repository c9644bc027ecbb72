"""Prefix cache of the native engine (issue 26): time to first token over a cached prefix, GRPO-shaped prefill.

Three engines on one model, each measured in this run: the prefix cache off, on with every prefill step eager
(`graph_prefill_tokens=0`, the engine before short prefill steps were captured), and on with the defaults (a tail
after a cached prefix replays a captured prefill graph). The ratios are against the engine without the cache.
- TTFT: prompts of one `--prefix`-token prefix (2,048) and a different `--question`-token tail each, one request
  at a time, timed from submission to its first token on the host; median of `--repeats`. The cached engine is
  warmed with two such prompts first: the first caches its own prompt, the second leaves the state where the
  two part, at the prefix's last whole block (a prefix is cached where some prompt's prefill passed it).
  Target: cached at most 15% of uncached.
- GRPO: `--batch` prompts (16) of `--prompt` tokens (512), each one request of n=`--samples` (8) choices
  sampling one token, all submitted at once; prefill throughput = prompt tokens of every choice / time to the
  last first token; new prompts in every repeat, so only a group's own prompt is shared. Target: >= 3x.
Then the cached engine's bytes and token hit rate (over every lookup of the run). With `--tensor-parallel` or
`--expert-parallel`, each engine is a group of processes (`GroupEngine`, no CUDA graphs, so no eager-prefill row).
Run: python benchmarks/bench_prefix_cache.py            (inkling-small, bf16, CUDA)
CPU smoke run: python benchmarks/bench_prefix_cache.py --tiny [--tensor-parallel 2]
"""

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_serving import Clock, engine_parser, make_prompts, parse_engine_args

from inkwell.models import init_base_model
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.group_engine import native_engine

TINY = dict(preset="inkling-tiny", device="cpu", dtype="float32", prefix=64, question=8, batch=4, samples=4, prompt=40)


ENGINES = {  # name: EngineConfig options
    "without cache": dict(prefix_cache=False),
    "cache, eager prefill": dict(prefix_cache=True, graph_prefill_tokens=0),
    "with cache": dict(prefix_cache=True),
}


def make_engine(model_dir: Path, args, options: dict) -> Engine:
    """An engine that holds a whole GRPO load at once (every choice its own sequence), over the ranks asked."""
    config = EngineConfig(
        max_seqs=args.batch * args.samples,
        max_batch_tokens=args.batch_tokens,
        max_context=max(args.prefix + args.question, args.prompt) + 8,
        dtype=args.dtype,
        device=args.device,
        prefix_cache_bytes=args.cache_bytes,
        tensor_parallel=args.tensor_parallel,
        expert_parallel=args.expert_parallel,
        **options,
    )
    if config.ranks > 1:
        config = replace(config, cuda_graphs=False)
    return native_engine(model_dir, config)


def first_token_s(engine: Engine, clock: Clock, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` (one greedy token) to that token on the host."""
    engine.add_request(Request("ttft", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    t0 = clock()
    while not any(out.token_ids for out in engine.step()):
        pass
    return time.perf_counter() - t0


def grpo_tok_s(engine: Engine, clock: Clock, args, seed: int) -> float:
    """Prefill tokens per second of `--batch` prompts x `--samples` choices of one sampled token each."""
    prompts = make_prompts(args.batch, args.prompt, seed=seed)
    params = SamplingParams(max_tokens=1, temperature=1.0, n=args.samples, seed=seed, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"g{i}", prompt, params))
    t0 = clock()
    while engine.has_work():
        engine.step()
    return args.batch * args.samples * args.prompt / (clock() - t0)


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.set_defaults(batch=16, prompt=512)
    ap.add_argument("--samples", type=int, default=8, help="choices per GRPO prompt (n)")
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix of the TTFT prompts")
    ap.add_argument("--question", type=int, default=32, help="each TTFT prompt's own tail")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="EngineConfig.max_batch_tokens")
    ap.add_argument("--cache-bytes", type=int, default=EngineConfig.prefix_cache_bytes)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="inkling-tiny on the CPU, short prompts: a smoke run")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="each engine a group of processes: TP")
    ap.add_argument("--expert-parallel", type=int, default=1, help="each engine a group of processes: EP")
    args = parse_engine_args(ap)
    if args.tiny:
        vars(args).update(TINY, batch_tokens=256, repeats=2)
    clock = Clock(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        grouped = args.tensor_parallel * args.expert_parallel > 1  # no prefill graphs: no eager-prefill row
        names = [name for name in ENGINES if not (grouped and name == "cache, eager prefill")]
        engines = {name: make_engine(model_dir, args, ENGINES[name]) for name in names}
        prefix = make_prompts(1, args.prefix, seed=1)[0]
        tails = make_prompts(args.repeats + 3, args.question, seed=2)
        ttft, grpo = {}, {}
        try:
            for name, engine in engines.items():
                for tail in tails[:3]:  # warm-up (and, with the cache, the prefix's boundary)
                    first_token_s(engine, clock, prefix + tail)
                ttft[name] = statistics.median(first_token_s(engine, clock, prefix + tail) for tail in tails[3:])
                grpo_tok_s(engine, clock, args, seed=100)  # warm-up
                grpo[name] = statistics.median(
                    grpo_tok_s(engine, clock, args, seed=101 + i) for i in range(args.repeats)
                )
        finally:
            for engine in engines.values():
                engine.shutdown()
        stats = engines["with cache"].prefix_cache.stats
        print(
            f"{args.preset} {args.dtype} on {args.device}; prefix {args.prefix} + {args.question} tokens; GRPO "
            f"{args.batch} prompts x {args.samples} samples of {args.prompt} tokens; max_batch_tokens "
            f"{args.batch_tokens}; TP {args.tensor_parallel}, EP {args.expert_parallel}\n"
        )
        print(f"| measure | {' | '.join(names)} | ratio | target |\n{'|---' * (len(names) + 3)}|")
        base, best = names[0], names[-1]
        cells = " | ".join(f"{ttft[n] * 1e3:.1f}" for n in names)
        print(f"| TTFT, {args.prefix}-token prefix (ms) | {cells} | {ttft[best] / ttft[base]:.1%} | <= 15% |")
        cells = " | ".join(f"{grpo[n]:.0f}" for n in names)
        print(f"| GRPO prefill (tok/s) | {cells} | {grpo[best] / grpo[base]:.2f}x | >= 3x |")
        print(
            f"\ncache: {stats.bytes / 2**20:.1f} MiB held (per device), token hit rate {stats.hit_rate:.1%} "
            f"({stats.cached_tokens} of {stats.prompt_tokens} prompt tokens; {stats.hits} of {stats.lookups} "
            f"prompts hit; {stats.evictions} evictions)"
        )


if __name__ == "__main__":
    main()
