"""Entry point of each torchrun process: `python -m inkwell.trainer.rank JOB EVENTS STOP RESULT`."""

import json
import sys
import traceback
from pathlib import Path

from inkwell.exiting import exit_now
from inkwell.trainer.api import run_in_process
from inkwell.trainer.config import TrainingCancelled, TrainJobConfig
from inkwell.trainer.launch import FileCallbacks


def main(argv: list[str]) -> int:
    job, events, stop, result = (Path(a) for a in argv)
    config = TrainJobConfig.model_validate_json(job.read_text())
    try:
        outcome = run_in_process(config, FileCallbacks(events, stop))
    except TrainingCancelled as exc:
        result.write_text(json.dumps({"cancelled_at": exc.step}))
        return 0
    except Exception as exc:
        result.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
        raise
    if outcome is not None:
        result.write_text(json.dumps({"result": outcome.model_dump(mode="json")}))
    return 0


if __name__ == "__main__":
    # without the interpreter's teardown once the result file is written (inkwell/exiting.py): the launch waits for
    # every rank; an exception still ends the process the usual way, with its traceback
    exit_now(main(sys.argv[1:]))
