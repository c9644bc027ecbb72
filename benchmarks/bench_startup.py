"""How soon things start on a CPU host, through the public paths: a training session, a serving worker, the CLI.

Service: `inkwell serve` (the embedded default: SQLite, SeaweedFS, the CPU serving tier) in a fresh directory,
run twice: with CPU children forked from the preloaded fork server (the default, `inkwell/forkserver.py`) and with
INKWELL_FORKSERVER=0, which spawns each one (a fresh interpreter importing torch, transformers, megatron-core and
inkwell), the baseline. In each run, through the SDK: --sessions sessions created one after another on
inkling-tiny, each timed from `sessions.create` to the end of its first `optim_step` (its worker holds the model
by then), and the first completion request (it starts the serving worker and its loader) then a second one.
CLI: a fresh `python -c "import inkwell.cli"` (what every `inkwell` command loads first) against importing torch
and transformers, which it loaded before they became lazy. Medians where there are several.
Run: python benchmarks/bench_startup.py [--sessions 3] [--out results.json]
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from embedded import EmbeddedService, free_port  # noqa: E402

from inkwell import sdk  # noqa: E402

BASE = "inkling-tiny"


def service_run(fork: bool, sessions: int) -> dict:
    """Session and serving-worker start times against a fresh embedded service."""
    work = Path(tempfile.mkdtemp())
    service = EmbeddedService(work / "service", free_port(), work / "service.log")
    key = service.start(env={"INKWELL_FORKSERVER": "1" if fork else "0"})
    try:
        with sdk.Client(service.url, key) as client:
            starts = []
            for seed in range(sessions):
                began = time.perf_counter()
                with client.sessions.create(BASE, lora={"rank": 4}, seed=seed) as session:
                    session.optim_step(learning_rate=1e-3).result(300)
                    starts.append(time.perf_counter() - began)
        openai = OpenAI(base_url=f"{service.url}/v1", api_key=key)
        requests = []
        for _ in range(2):
            began = time.perf_counter()
            openai.completions.create(model=BASE, prompt="hello", max_tokens=4, temperature=0)
            requests.append(time.perf_counter() - began)
    finally:
        service.stop()
    return {
        "session_start_s": starts,
        "session_start_median_s": statistics.median(starts),
        "first_completion_s": requests[0],
        "second_completion_s": requests[1],
    }


def import_seconds(code: str, runs: int = 3) -> float:
    """Median wall seconds of a fresh interpreter running `code`."""
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=os.environ)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "spawn": service_run(fork=False, sessions=args.sessions),
        "fork_server": service_run(fork=True, sessions=args.sessions),
        "cli_import_s": import_seconds("import inkwell.cli"),
        "torch_transformers_import_s": import_seconds("import torch, transformers; transformers.InklingTextConfig"),
    }
    fork, spawn = results["fork_server"], results["spawn"]
    print(json.dumps(results, indent=2))
    print(
        f"\nsession start (create to first optim_step done), median of {args.sessions}: "
        f"{fork['session_start_median_s']:.2f} s forked, {spawn['session_start_median_s']:.2f} s spawned "
        f"({spawn['session_start_median_s'] / fork['session_start_median_s']:.1f}x)\n"
        f"first completion (serving worker start): {fork['first_completion_s']:.2f} s forked, "
        f"{spawn['first_completion_s']:.2f} s spawned; second: {fork['second_completion_s']:.2f} s / "
        f"{spawn['second_completion_s']:.2f} s\n"
        f"`import inkwell.cli`: {results['cli_import_s']:.2f} s; torch + transformers alone "
        f"{results['torch_transformers_import_s']:.2f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
