"""The native engine across processes against one process: the same greedy tokens, and prefill/decode throughput.

For each layout of `--layouts` (`tp1`, `tp2`, `ep2`, `tp2ep2`, ...) the same mixed batch runs: `--batch` prompts of
`--prompt` random tokens, `--new` greedy tokens each, request i on adapter i mod `--adapters` (rank `--rank`, 16, every
target group). Every layout runs without CUDA graphs (a group refuses them) and the prefix cache (off everywhere, as
random prompts share nothing to cache), so tp1 is the one-process engine on the same eager path; `tp1-graphs` adds the
one-process production decode for reference. Equality: each layout's tokens against tp1's (the count of requests whose
tokens differ, and the largest logprob difference of the tokens both chose, up to the first difference). Throughput:
prefill = the first step, decode = the rest (after a warm-up batch).
Run (two GPUs): python benchmarks/bench_parallel_serving.py --layouts tp1,tp2,ep2,tp1-graphs [--out parallel.json]
CPU smoke run: python benchmarks/bench_parallel_serving.py --preset inkling-tiny --device cpu --prompt 16 --new 4
"""

import json
import re
import tempfile
from pathlib import Path

from bench_serving import (
    Clock,
    adapter_keys,
    engine_batch,
    engine_parser,
    make_prompts,
    parse_engine_args,
    random_adapters,
    rates,
)

from inkwell.models import init_base_model
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.group_engine import native_engine


def layout_config(name: str, args) -> EngineConfig:
    """`tp<N>`, `ep<N>` or both (`tp2ep2`); `-graphs`: the one-process engine with its CUDA graph decode."""
    tp, ep = re.search(r"tp(\d+)", name), re.search(r"ep(\d+)", name)
    return EngineConfig(
        max_loras_per_batch=max(args.adapters, 1),
        max_lora_rank=args.rank,
        max_seqs=args.batch,
        max_batch_tokens=args.batch * args.prompt,
        dtype=args.dtype,
        device=args.device,
        prefix_cache=False,
        cuda_graphs=name.endswith("-graphs"),
        tensor_parallel=int(tp.group(1)) if tp else 1,
        expert_parallel=int(ep.group(1)) if ep else 1,
    )


def run_layout(model_dir: Path, name: str, args, adapters, prompts) -> tuple[dict, dict]:
    """(timings, each request's tokens and logprobs) of one layout."""
    engine = native_engine(model_dir, layout_config(name, args))
    try:
        for i, adapter in enumerate(adapters[: args.adapters]):
            engine.load_adapter(f"a{i}", adapter)
        keys = adapter_keys(args.adapters, len(prompts))
        clock = Clock(engine.device)
        engine_batch(engine, clock, prompts, keys, args.new)  # warm-up
        timing = rates(engine_batch(engine, clock, prompts, keys, args.new))
        params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True, logprobs=0)
        requests = [Request(f"r{i}", p, params, k) for i, (p, k) in enumerate(zip(prompts, keys, strict=True))]
        choices = engine.generate(requests)
        return timing, {rid: (c[0].token_ids, [lp.logprob for lp in c[0].logprobs]) for rid, c in choices.items()}
    finally:
        engine.shutdown()


def compare(ours: dict, ref: dict) -> dict:
    """Requests whose tokens differ from the reference's, and the largest logprob difference before any does."""
    differ, worst = 0, 0.0
    for rid, (tokens, logprobs) in ours.items():
        ref_tokens, ref_logprobs = ref[rid]
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens))
        differ += same < len(tokens)
        worst = max([worst, *(abs(a - b) for a, b in zip(logprobs[: same + 1], ref_logprobs[: same + 1], strict=True))])
    return {"requests_differing": differ, "max_logprob_diff": worst}


def main() -> None:
    ap = engine_parser(__doc__)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4, help="distinct adapters in the batch (0: base model only)")
    ap.add_argument("--layouts", default="tp1,tp2,ep2", help="comma-separated; the first is the reference")
    ap.add_argument("--out", type=Path)
    args = parse_engine_args(ap)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        adapters = random_adapters(model_dir, args.rank)
        prompts = make_prompts(args.batch, args.prompt)
        outputs = {}
        for name in args.layouts.split(","):
            timing, outputs[name] = run_layout(model_dir, name, args, adapters, prompts)
            reference = outputs[args.layouts.split(",")[0]]
            results[name] = {**timing, **compare(outputs[name], reference)}
            row = results[name]
            print(
                f"{name:12s} prefill {row['prefill_tok_s']:10.0f} tok/s  decode {row['decode_tok_s'] or 0:9.0f} tok/s"
                f"  differing {row['requests_differing']}  max |dlogprob| {row['max_logprob_diff']:.2e}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
