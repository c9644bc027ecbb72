"""Batch sweep of the native engine's decode (issue 25): aggregate against per-sequence throughput, with and without
adapters, through the engine's public API (add_request / step).

For each number of concurrent sequences (`--batches`, 1 8 32 64 128) and adapters (none, 1, and 8 distinct
ones; request i on adapter i mod n): prompts of `--prompt` random tokens (512), `--new` greedy tokens each (128),
all submitted at once. The first step prefills every prompt (one forward); a decode step is the time between two
step() returns after it (the engine overlaps steps, so this is the steady state's cost per token of each
sequence), median over the run. Every configuration first runs once short to warm up (Triton compiles, graph
buckets); then each is timed `--repeats` times (3), interleaved (the first run of every configuration, then the
second, ...) so a drift of the machine hits them all alike, and reports its median run by step (of an even count the
lower middle one, a real run): one disturbed run no longer becomes the figure. The JSON keeps every run's step
(step_ms_runs), the table their spread (min-max). Aggregate tok/s = sequences / step, per-sequence tok/s = 1 / step;
ratios are of the medians' decode throughput at the same batch: n adapters / no adapter, and 8 adapters / 1 adapter.
Prints a markdown table; --out writes the figures as JSON, --plot a PNG of aggregate throughput against per-user
speed (one line per adapter count, points labelled by batch).
Run: python benchmarks/bench_serving_sweep.py --out sweep.json --plot sweep.png      (inkling-small, bf16, CUDA)
CPU smoke run: python benchmarks/bench_serving_sweep.py --tiny
"""

import datetime
import json
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from bench_serving import (
    adapter_keys,
    engine_parser,
    make_engine,
    make_prompts,
    parse_engine_args,
    random_adapters,
    submit,
)

from inkwell.models import init_base_model
from inkwell.serving.native.engine import Engine

ADAPTERS = (0, 1, 8)
WARMUP_NEW = 4
TINY = dict(preset="inkling-tiny", device="cpu", dtype="float32", batches=[1, 4, 8], prompt=16, new=8)


def run_batch(engine: Engine, prompts: list[list[int]], n: int, new: int) -> dict:
    """One batch of `prompts` on n adapters (0: the base model): prefill seconds and the median decode step."""
    submit(engine, prompts, adapter_keys(n, len(prompts)), new)
    t0 = time.perf_counter()
    engine.step()
    marks = [time.perf_counter()]
    while engine.has_work():
        engine.step()
        marks.append(time.perf_counter())
    step = statistics.median(b - a for a, b in zip(marks[:-1], marks[1:], strict=True))
    return {
        "batch": len(prompts),
        "adapters": n,
        "prefill_s": marks[0] - t0,
        "decode_steps": len(marks) - 1,
        "step_ms": step * 1e3,
        "aggregate_tok_s": len(prompts) / step,
        "per_seq_tok_s": 1 / step,
    }


def median_run(runs: list[dict]) -> dict:
    """A configuration's figures from its timed runs: the median run by step (the lower middle of an even count, so
    every figure comes from one real run), with every run's step in run order to show the spread."""
    mid = sorted(runs, key=lambda r: r["step_ms"])[(len(runs) - 1) // 2]
    return {**mid, "step_ms_runs": [r["step_ms"] for r in runs]}


def add_ratios(rows: list[dict]) -> None:
    """Each row's decode throughput against no adapter and (8 adapters) against 1 adapter at the same batch."""
    by_key = {(r["batch"], r["adapters"]): r for r in rows}
    for r in rows:
        base, one = by_key.get((r["batch"], 0)), by_key.get((r["batch"], 1))
        if r["adapters"] and base:
            r["vs_none"] = r["aggregate_tok_s"] / base["aggregate_tok_s"]
        if r["adapters"] == 8 and one:
            r["vs_one"] = r["aggregate_tok_s"] / one["aggregate_tok_s"]


def table(rows: list[dict]) -> str:
    def cell(r: dict, key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    lines = [
        "| sequences | adapters | decode ms/step | runs ms (min-max) | aggregate tok/s | per-sequence tok/s "
        "| / no adapter | 8 / 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f"{min(r['step_ms_runs']):.2f}-{max(r['step_ms_runs']):.2f}"
        lines.append(
            f"| {r['batch']} | {r['adapters']} | {r['step_ms']:.2f} | {spread} | {r['aggregate_tok_s']:,.0f} | "
            f"{r['per_seq_tok_s']:.1f} | {cell(r, 'vs_none')} | {cell(r, 'vs_one')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Aggregate decode tok/s against per-sequence tok/s: one line per adapter count, points labelled by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for n in sorted({r["adapters"] for r in rows}):
        points = sorted((r for r in rows if r["adapters"] == n), key=lambda r: r["batch"])
        label = "no adapter" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}"
        ax.plot([r["per_seq_tok_s"] for r in points], [r["aggregate_tok_s"] for r in points], marker="o", label=label)
        for r in points:
            xy = (r["per_seq_tok_s"], r["aggregate_tok_s"])
            ax.annotate(str(r["batch"]), xy, xytext=(4, 4), textcoords="offset points", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("per-sequence decode tok/s (speed each user sees)")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(textwrap.fill(title, 72), fontsize=10)  # a GPU's long name would run off the figure
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="points: concurrent sequences")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.set_defaults(prompt=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each configuration, interleaved")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--tiny", action="store_true", help="inkling-tiny on the CPU, short prompts: a smoke run")
    args = parse_engine_args(ap)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.tiny:
        vars(args).update(TINY)
    args.batch = max(args.batches)  # make_engine sizes the engine (sequences, prefill tokens) from it
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    title = f"{args.preset} {args.dtype} on {gpu}: prompt {args.prompt}, {args.new} greedy tokens"
    title += f", rank-{args.rank} adapters"
    results = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gpu": gpu,
        "rows": [],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-serving-sweep-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        adapters = random_adapters(model_dir, args.rank)[: max(ADAPTERS)]
        engine = make_engine(model_dir, adapters, args)  # the prefix cache off: every run prefills its prompts
        print(f"[setup] {time.perf_counter() - t0:.1f}s", flush=True)
        prompts = {batch: make_prompts(batch, args.prompt, seed=batch) for batch in args.batches}
        runs: dict[tuple[int, int], list[dict]] = {(batch, n): [] for batch in args.batches for n in ADAPTERS}
        for batch, n in runs:
            run_batch(engine, prompts[batch], n, WARMUP_NEW)
        for i in range(args.repeats):  # round-robin: a drift of the machine falls on every configuration alike
            for (batch, n), done in runs.items():
                done.append(run_batch(engine, prompts[batch], n, args.new))
                step_ms = done[-1]["step_ms"]
                print(f"run {i + 1}/{args.repeats}, batch {batch}, {n} adapters: {step_ms:.2f} ms/step", flush=True)
                results["rows"] = [median_run(cell) for cell in runs.values() if cell]
                add_ratios(results["rows"])
                if args.out is not None:  # after every run, so a sweep cut short keeps what it measured
                    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{title}\n\n{table(results['rows'])}")
    if args.plot is not None:
        plot(results["rows"], title, args.plot)
    print(f"[total] {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
