"""How a finished child process ends: at once, without the interpreter's teardown.

Finalizing the modules a training rank or a job worker has imported (torch, transformers, megatron-core) takes
about 2 s of CPU on two cores, and whoever started the process waits for it: a torchrun launch for every rank, a
stopping service for its job workers. By the time `exit_now` is called the process has closed its files, destroyed
its process group or disposed of its database engine; what is left to do is flush the logs and the output.
"""

import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush logging, stdout and stderr, then end the process with `code` (os._exit: no atexit, no finalizers)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
