"""Training-session primitives on one GPU (issue 22): forward_backward + optim_step over datums against the SFT
job's own step on the same batch, and the adapter-only sync to a serving engine against the disk round trip.

Step: one TrainingCore per compile mode (none, default, reduce-overhead = the SFT job's `auto` on one GPU) on a
randomly initialised base (bf16, LoRA rank 16 on attention, MLP and experts). The SFT step is the job's
(`forward_rows` over the packed rows, then `optim_step`); the session step is what `/v1/sessions/.../forward_backward`
runs (`forward_backward` over --batch datums of --seq tokens, logprobs back on the host, then `optim_step`). Each
ratio is against the SFT step under reduce-overhead measured in the same run.
Sync: the trained adapter into a native engine on the same GPU, then one sampled token: in memory (what
save_weights_for_sampler hands a worker) against saving it in SGLang's layout and loading it back from disk.
Times are medians over --steps timed steps after --warmup untimed ones.
Run: python benchmarks/bench_session.py [--preset inkling-small] [--batch 4] [--seq 1024] [--out results.json]
"""

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_train import random_rows, run_header

from inkwell.adapters.io import save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import init_base_model, load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.serving.sources import DirectorySource
from inkwell.trainer.core import AdamParams, TrainingCore
from inkwell.trainer.dataset import Rows
from inkwell.trainer.datums import Datum
from inkwell.trainer.losses import CROSS_ENTROPY
from inkwell.trainer.parallel import model_parallel

MODES = [None, "default", "reduce-overhead"]  # the last is the SFT job's `auto` on one GPU: the baseline


def mode_key(mode: str | None) -> str:
    return f"compile_{mode or 'none'}"


def timed(fn, steps: int, warmup: int, sync) -> float:
    """Median seconds of `fn` over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(base_dir: Path, spec: LoraSpec, mode: str | None, ids: torch.Tensor, args) -> dict:
    """The SFT step and the session step of one core under compile `mode`, on the same rows; the core is freed
    before the next mode builds its own."""
    with model_parallel(1, 1, args.device, 0):
        core = TrainingCore.create(base_dir, spec, device=args.device, dtype=args.dtype, compile_mode=mode)
        out = measure(core, ids, args) | {"adapter": core.adapter()}
    core = None
    gc.collect()
    torch._dynamo.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def measure(core: TrainingCore, ids: torch.Tensor, args) -> dict:
    batch, seq = ids.shape
    targets = ids.roll(-1, dims=1)
    weight = [1.0 / ids.numel()] * seq
    data = [Datum(ids[i].tolist(), {"target_tokens": targets[i].tolist(), "weights": weight}) for i in range(batch)]
    rows = Rows(ids, torch.zeros_like(ids), targets, torch.ones(ids.shape)).to(core.device)
    weights = {"weights": rows.loss_mask / ids.numel()}
    adam = AdamParams(learning_rate=1e-5)

    def sft_step():
        core.forward_rows(rows, CROSS_ENTROPY, {}, weights, backward=True)
        core.optim_step(adam)

    def session_step():
        core.forward_backward(data, "cross_entropy")
        core.optim_step(adam)

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    start = time.perf_counter()
    sft_step()
    sync()
    first = time.perf_counter() - start
    return {
        "first_step_s": first,
        "sft_ms": 1000 * timed(sft_step, args.steps, args.warmup, sync),
        "session_ms": 1000 * timed(session_step, args.steps, args.warmup, sync),
    }


def sync_times(base_dir: Path, adapter, args) -> dict:
    """Adapter into a native engine then one sampled token: from memory, and through SGLang's layout on disk."""
    config = load_base_config(base_dir)
    engine = Engine(base_dir, EngineConfig(device=args.device, dtype=args.dtype))
    prompt = list(range(3, 67))

    def first_token(key: str) -> None:
        engine.generate([Request(f"r-{key}-{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1), key)])

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    scratch = Path(tempfile.mkdtemp())
    counter = iter(range(10**6))

    def in_memory():
        key = f"m{next(counter)}"
        engine.load_adapter(key, adapter)
        first_token(key)
        engine.unload_adapter(key)

    def through_disk():
        key = f"d{next(counter)}"
        out = save_adapter(adapter, scratch / key, "sglang", config)
        engine.load_adapter(key, DirectorySource(str(out)).load(scratch, config))
        first_token(key)
        engine.unload_adapter(key)

    def token_only():
        first_token("resident")

    engine.load_adapter("resident", adapter, pinned=True)
    return {
        "first_token_ms": 1000 * timed(token_only, args.steps, args.warmup, sync),
        "memory_sync_ms": 1000 * timed(in_memory, args.steps, args.warmup, sync),
        "disk_sync_ms": 1000 * timed(through_disk, args.steps, args.warmup, sync),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="inkling-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    parser.add_argument("--modes", nargs="+", default=[m or "none" for m in MODES], help="compile modes to time")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    modes = [None if m == "none" else m for m in args.modes] if args.device == "cuda" else [None]

    base_dir = init_base_model(args.preset, Path(tempfile.mkdtemp()) / args.preset, seed=0)
    spec = LoraSpec(rank=args.rank, alpha=2 * args.rank, targets=["attn", "mlp", "experts"])
    ids = random_rows(load_base_config(base_dir).vocab_size, args)
    results = run_header(args)
    adapter = None
    for mode in modes:
        out = step_times(base_dir, spec, mode, ids, args)
        adapter = out.pop("adapter")
        results[mode_key(mode)] = out
        print(mode or "none", out, flush=True)
    baseline = results[mode_key(modes[-1])]["sft_ms"]
    tokens = args.batch * args.seq
    for mode in modes:
        row = results[mode_key(mode)]
        row["session_tok_s"] = tokens / row["session_ms"] * 1000
        row["session_vs_sft_baseline"] = baseline / row["session_ms"]
        print(
            f"{mode or 'none':>16}: SFT {row['sft_ms']:.1f} ms, session {row['session_ms']:.1f} ms "
            f"({row['session_tok_s']:,.0f} tok/s, {row['session_vs_sft_baseline']:.3f} of the SFT step "
            f"under {modes[-1]}), first step {row['first_step_s']:.1f} s",
            flush=True,
        )
    results["sync"] = sync_times(base_dir, adapter, args)
    s = results["sync"]
    print(
        f"sync + first token: memory {s['memory_sync_ms']:.1f} ms, disk {s['disk_sync_ms']:.1f} ms "
        f"({s['disk_sync_ms'] / s['memory_sync_ms']:.2f}x); a first token alone {s['first_token_ms']:.1f} ms"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
