"""`python -m inkwell.service.workers`: one job worker process, configured from INKWELL_* variables.

SIGTERM/SIGINT stop it gracefully: the running job is handed back (re-queued, the attempt not counted) at the
next step and resumes elsewhere from its last checkpoint.
"""

import logging
import signal
import threading

import torch

from inkwell.exiting import exit_now
from inkwell.service.settings import Settings
from inkwell.service.workers.job_worker import JobWorker


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings()
    torch.set_num_threads(settings.train_threads)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    JobWorker(settings, stopping=stopping).run_forever()


if __name__ == "__main__":
    main()
    exit_now(0)  # its job handed back, its row removed, its engine disposed: no interpreter teardown to wait for
