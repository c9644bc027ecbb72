"""Where model-holding child processes (serving workers, session workers) start from.

Such a child used to be spawned: a fresh interpreter that imports torch, transformers, megatron-core and inkwell
before it does anything, about 8 s on two CPU cores, which was most of what a new session or serving worker
waited for. They now fork from a server process that has imported those modules once (multiprocessing's
"forkserver" with a preload), so a child starts with them in memory. The server never runs a torch op or touches
a GPU, so a child initialises its threads and CUDA itself, as a spawned one does; children get the environment
the server started with, which is why the service starts it early (`warm`).
"""

import multiprocessing
import multiprocessing.forkserver
from multiprocessing.context import BaseContext

# The children's entry modules (names, not imports: this module sits below both of them).
PRELOAD = ["inkwell.serving.worker", "inkwell.service.sessions.worker"]


def context() -> BaseContext:
    """The multiprocessing context to create a model-holding child's process and queues from."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm() -> None:
    """Start the server now; it imports in the background and the first child no longer waits for that."""
    context()
    multiprocessing.forkserver.ensure_running()
