"""LoRA GRPO on one GPU (issue 23): the train <-> sampler KL with and without routing replay, the step time split
into sampling / training / sync, and the adapter-only sync against the disk round trip.

GRPO: the recipe's own loop (`inkwell.recipes.rl.grpo`) on the primitives an RL job runs it on
(`inkwell.recipes.local.LocalSession`: a TrainingCore and a native Engine side by side on one device, the adapter
synced into the engine from memory after each step; the core's compile mode is the job's,
`recipes.job.COMPILE_MODE`, unless --compile says otherwise), on a randomly initialised --preset base
and a bundled task (`inkwell.recipes.tasks`, letter-case: one-token answers scored by the regex verifier; a random
base learns little, the KL and the timings are what this measures). It runs --steps steps twice on the same seeds:
with routing replay (the engine's routing traces in every datum, replayed by the trainer's forward) and without;
the run without is the baseline of every ratio. Per step: KL(sampler || trainer) by the k1 and k3 estimators,
|dlogprob| mean and max, the share of sampled tokens whose ratio p/q leaves [0.8, 1.2], the mean reward, and the
step's seconds in sampling (sample + result), training (forward_backward + optim_step) and sync
(save_weights_for_sampler); here each primitive ends with a device synchronise, so a phase's queued kernels are
counted in it. Summaries are medians over the steps after the first (compilation, CUDA-graph capture), the largest
KL over every step; the issue's target is KL <= 1e-3 with replay.

Sync: the trained adapter into a fresh native engine, then one sampled token (`bench_session.sync_times`): from
memory (what save_weights_for_sampler does) against saving it in SGLang's layout, loading that directory and the
token (publishing through S3 adds an upload and a download to the disk round trip; no S3 server here).

Run (GPU): python benchmarks/bench_grpo.py [--preset inkling-small] [--steps 20] [--prompts 16] [--out results.json]
Check (CPU, well under a minute): python benchmarks/bench_grpo.py --preset inkling-tiny --device cpu --dtype float32
    --steps 3
"""

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_session import sync_times

from inkwell.models import init_base_model
from inkwell.recipes.job import COMPILE_MODE
from inkwell.recipes.local import LocalSession
from inkwell.recipes.rl import RLConfig, StepReport, grpo
from inkwell.recipes.tasks import TASKS
from inkwell.serving.contract import EngineConfig
from inkwell.serving.native.engine import Engine
from inkwell.trainer.core import TrainingCore
from inkwell.trainer.parallel import model_parallel
from inkwell.trainer.verifiers import verifier

COLUMNS = (
    ("reward", "reward", "{:.3f}"),
    ("kl_k1", "kl k1", "{:+.1e}"),
    ("kl_k3", "kl k3", "{:.1e}"),
    ("logprob_diff_mean", "|dlogp| mean", "{:.1e}"),
    ("logprob_diff_max", "|dlogp| max", "{:.1e}"),
    ("clip_fraction", "clip", "{:.4f}"),
    ("sample_seconds", "sample s", "{:.3f}"),
    ("train_seconds", "train s", "{:.3f}"),
    ("sync_seconds", "sync s", "{:.3f}"),
)
PHASES = ("sample_seconds", "train_seconds", "sync_seconds")


class SyncedSession(LocalSession):
    """The job's in-process session, each call ending when its device work has (so each phase is timed whole)."""

    def __init__(self, *args, device: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward_backward(self, *args, **kwargs):
        out = super().forward_backward(*args, **kwargs)
        self._sync()
        return out

    def optim_step(self, *args, **kwargs):
        out = super().optim_step(*args, **kwargs)
        self._sync()
        return out

    def save_weights_for_sampler(self, *args, **kwargs):
        out = super().save_weights_for_sampler(*args, **kwargs)
        self._sync()
        return out


def free(device: str) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def grpo_run(base_dir: Path, config: RLConfig, args) -> tuple[list[StepReport], object, float]:
    """The recipe's GRPO loop on a fresh core and engine: the step reports, the trained adapter and the seconds the
    core and the engine took to build."""
    task = TASKS[args.task]
    began = time.perf_counter()
    with model_parallel(1, 1, args.device, config.seed):
        core = TrainingCore.create(
            base_dir, task.lora, seed=config.seed, device=args.device, dtype=args.dtype, compile_mode=args.compile_mode
        )
        engine = Engine(
            base_dir,
            EngineConfig(
                device=args.device,
                dtype=args.dtype,
                max_lora_rank=task.lora.max_rank,
                max_seqs=args.max_seqs,
                max_batch_tokens=args.max_batch_tokens,
            ),
        )
        built = time.perf_counter() - began
        replay = "with" if config.routing_replay else "without"
        print(f"\nGRPO {replay} routing replay (core + engine built in {built:.1f} s)", flush=True)
        print(f"{'step':>4}  " + "  ".join(f"{label:>12}" for _, label, _ in COLUMNS), flush=True)
        session = SyncedSession(core, engine, Path(tempfile.mkdtemp()), device=args.device)
        problems, reward_fn = task.problems(), verifier(task.verifier)
        reports = grpo(session, engine.tokenizer, problems, reward_fn, config, progress=False, on_step=row)
        adapter = core.adapter()
    core = engine = session = None
    free(args.device)
    return reports, adapter, built


def row(r: StepReport) -> None:
    print(f"{r.step:>4}  " + "  ".join(f"{fmt.format(getattr(r, key)):>12}" for key, _, fmt in COLUMNS), flush=True)


def summary(reports: list[StepReport]) -> dict:
    """Medians over the steps after the first (all of them when there is one), largest KL over every step."""
    steady = reports[1:] or reports
    out = {f"median_{key}": statistics.median(getattr(r, key) for r in steady) for key, _, _ in COLUMNS}
    out["median_step_seconds"] = statistics.median(sum(getattr(r, p) for p in PHASES) for r in steady)
    out["max_kl_k3"] = max(r.kl_k3 for r in reports)
    out["max_abs_kl_k1"] = max(abs(r.kl_k1) for r in reports)
    out["max_logprob_diff"] = max(r.logprob_diff_max for r in reports)
    out["max_clip_fraction"] = max(r.clip_fraction for r in reports)
    out["first_step_seconds"] = sum(getattr(reports[0], p) for p in PHASES)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="inkling-small")
    parser.add_argument("--task", default="letter-case", choices=sorted(TASKS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, help="prompts per step (default: the task's)")
    parser.add_argument("--group", type=int, help="samples per prompt (default: the task's)")
    parser.add_argument("--max-tokens", type=int, help="tokens per sample (default: the task's)")
    parser.add_argument("--max-seqs", type=int, default=EngineConfig.max_seqs, help="the engine's (default: the job's)")
    parser.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    parser.add_argument("--compile", default="auto", choices=["auto", "none", "default", "reduce-overhead"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sync-steps", type=int, help="timed adapter syncs each way (default: 8, on CPU 2)")
    parser.add_argument("--runs", default="replay,no_replay", help="which runs, in order (the last is the baseline)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.compile_mode = {
        "auto": COMPILE_MODE,
        "none": None,
        "default": "default",
        "reduce-overhead": "reduce-overhead",
    }[args.compile]
    if args.compile_mode is not None and args.device != "cuda":
        parser.error("--compile: the layers compile on CUDA only")
    if args.device == "cpu":  # a check of this script: inkling-tiny's ops are too small to split over threads
        torch.set_num_threads(1)

    task = TASKS[args.task]
    overrides = {"prompts_per_step": args.prompts, "group_size": args.group, "max_tokens": args.max_tokens}
    config = dataclasses.replace(
        task.config, steps=args.steps, save_every=0, **{k: v for k, v in overrides.items() if v is not None}
    )
    base_dir = init_base_model(args.preset, Path(tempfile.mkdtemp()) / args.preset, seed=0)
    results = {
        "preset": args.preset,
        "task": args.task,
        "device": args.device,
        "dtype": args.dtype,
        "compile_mode": args.compile_mode,
        "steps": config.steps,
        "prompts_per_step": config.prompts_per_step,
        "group_size": config.group_size,
        "max_tokens": config.max_tokens,
        "loss_fn": config.loss_fn,
        "lora": task.lora.model_dump(mode="json"),
        "engine": {"max_seqs": args.max_seqs, "max_batch_tokens": args.max_batch_tokens},
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    adapter = None
    runs = args.runs.split(",")
    if not set(runs) <= {"replay", "no_replay"}:
        parser.error(f"--runs: replay and/or no_replay, not {args.runs!r}")
    for name in runs:
        replay = name == "replay"
        reports, trained, built = grpo_run(base_dir, dataclasses.replace(config, routing_replay=replay), args)
        adapter = adapter or trained
        steps = [{k: v for k, v in dataclasses.asdict(r).items() if k != "state"} for r in reports]
        results[name] = {"build_seconds": built, "steps": steps, "summary": summary(reports)}
    if len(runs) < 2:
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
        return

    with_replay, without = results["replay"]["summary"], results["no_replay"]["summary"]
    with_replay["step_vs_no_replay"] = with_replay["median_step_seconds"] / without["median_step_seconds"]
    cpu = args.device == "cpu"
    sync_steps = args.sync_steps or (2 if cpu else 8)
    sync_args = SimpleNamespace(device=args.device, dtype=args.dtype, steps=sync_steps, warmup=1 if cpu else 3)
    results["sync"] = sync = sync_times(base_dir, adapter, sync_args)
    sync["disk_vs_memory"] = sync["disk_sync_ms"] / sync["memory_sync_ms"]
    free(args.device)

    target = "meets" if with_replay["max_kl_k3"] <= 1e-3 else "misses"
    print(f"\nsummary ({config.steps} steps of {config.prompts_per_step} x {config.group_size} samples; medians over")
    print("steps 1.., maxima over every step)")
    for label, s in (("with replay", with_replay), ("without replay", without)):
        ratio = f"{s['step_vs_no_replay']:.2f}x the step without replay" if s is with_replay else "the baseline"
        print(
            f"  {label:>14}: kl k3 median {s['median_kl_k3']:.2e} max {s['max_kl_k3']:.2e}, |k1| max "
            f"{s['max_abs_kl_k1']:.2e}, |dlogp| max {s['max_logprob_diff']:.2e}, clip median "
            f"{s['median_clip_fraction']:.4f}; step {s['median_step_seconds']:.3f} s = sample "
            f"{s['median_sample_seconds']:.3f} + train {s['median_train_seconds']:.3f} + sync "
            f"{s['median_sync_seconds']:.3f} ({ratio}), first step {s['first_step_seconds']:.1f} s"
        )
    print(f"  KL k3 with replay: largest {with_replay['max_kl_k3']:.2e}, {target} the target of 1e-3")
    print(
        f"  adapter sync + first token: memory {sync['memory_sync_ms']:.1f} ms, SGLang layout through disk "
        f"{sync['disk_sync_ms']:.1f} ms ({sync['disk_vs_memory']:.2f}x); a first token alone "
        f"{sync['first_token_ms']:.1f} ms"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
