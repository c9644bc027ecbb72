"""Multi-process runs: `train()` starts `torchrun` and relays rank 0's progress to the callbacks.

Rank 0 appends events and checkpoint notices to a JSONL file that the parent tails; the parent
turns `should_stop()` into a stop file that rank 0 checks at every step boundary (and
broadcasts, so all ranks stop together); the result comes back as a JSON file.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from inkwell.trainer.config import TrainCallbacks, TrainEvent, TrainingCancelled, TrainJobConfig, TrainResult

POLL_S = 0.2


class FileCallbacks(TrainCallbacks):
    """A rank's side: events to a JSONL file, stop when the stop file appears."""

    def __init__(self, events: Path, stop: Path):
        self.events, self.stop = events, stop

    def _write(self, record: dict) -> None:
        with self.events.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def on_event(self, event: TrainEvent) -> None:
        self._write({"type": "event", "event": event.model_dump(mode="json")})

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._write({"type": "checkpoint", "step": step, "path": str(path)})

    def should_stop(self) -> bool:
        return self.stop.exists()


class _Tail:
    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def lines(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8") as fh:
            fh.seek(self.offset)
            data = fh.read()
        complete = data[: data.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line]


def _relay(record: dict, callbacks: TrainCallbacks) -> None:
    if record["type"] == "event":
        callbacks.on_event(TrainEvent.model_validate(record["event"]))
    elif record["type"] == "checkpoint":
        callbacks.on_checkpoint(record["step"], Path(record["path"]))


def launch(config: TrainJobConfig, callbacks: TrainCallbacks) -> TrainResult:
    """Run the job under `torchrun --nproc_per_node config.nproc` and wait for it."""
    run_dir = config.output_dir / ".launch"
    run_dir.mkdir(parents=True, exist_ok=True)
    job, events, stop, result = (run_dir / n for n in ("job.json", "events.jsonl", "stop", "result.json"))
    for stale in (events, stop, result):
        stale.unlink(missing_ok=True)
    job.write_text(config.model_dump_json(indent=2))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.nproc}",
        "-m", "inkwell.trainer.rank", str(job), str(events), str(stop), str(result),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = _Tail(events)
    output: list[str] = []
    reader = _drain(proc, output)
    try:
        while proc.poll() is None:
            for record in tail.lines():
                _relay(record, callbacks)
            if not stop.exists() and callbacks.should_stop():
                stop.touch()
            time.sleep(POLL_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(timeout=5)
    for record in tail.lines():
        _relay(record, callbacks)
    outcome = json.loads(result.read_text()) if result.exists() else None
    if outcome and "cancelled_at" in outcome:
        raise TrainingCancelled(outcome["cancelled_at"])
    if proc.returncode != 0 or outcome is None or "result" not in outcome:
        detail = (outcome or {}).get("error") or "".join(output[-40:])
        raise RuntimeError(f"torchrun training failed (exit {proc.returncode}): {detail}")
    return TrainResult.model_validate(outcome["result"])


def _drain(proc: subprocess.Popen, sink: list[str]):
    """Keep the child's output flowing (and its tail for error messages) without blocking the poll loop."""
    import threading

    def read():
        for line in proc.stdout:
            sink.append(line)
            del sink[:-200]

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread
