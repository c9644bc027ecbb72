"""Where model-holding child processes (serving workers, session workers) start from, and how they are stopped.

A spawned child is a fresh interpreter that imports torch, transformers, megatron-core and inkwell before it does
anything: about 8 s on two CPU cores, most of what a new CPU session or serving worker waited for. A CPU child
now forks from a server process that has imported those modules once (multiprocessing's "forkserver" with a
preload), so it starts with them in memory; the server runs no torch op, so each child sets up its own threads.
A CUDA child is still spawned: on a GPU machine those imports initialise CUDA in the server, and torch refuses
CUDA in a process forked from one that has (seen on the H200), while there the imports are a small part of a
worker's start. Children get the environment the server started with, which is why the service starts it early.
INKWELL_FORKSERVER=0 spawns every child instead (what benchmarks/bench_startup.py compares against).
"""

import multiprocessing
import multiprocessing.forkserver
import os
import queue
import threading
import time
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

# The children's entry modules (names, not imports: this module sits below both of them).
PRELOAD = ["inkwell.serving.worker", "inkwell.service.sessions.worker"]


def enabled() -> bool:
    """Whether CPU children fork (INKWELL_FORKSERVER, default 1) rather than spawn."""
    return os.environ.get("INKWELL_FORKSERVER", "1") != "0"


def context(device: str) -> BaseContext:
    """The multiprocessing context to create a child that holds a model on `device` ("cpu", "cuda", "cuda:1")."""
    if device.split(":")[0] != "cpu" or not enabled():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def nested_context(device: str) -> BaseContext:
    """The context for a child of such a child (a serving worker's loader), started before its parent has run a
    torch op: on the CPU a plain fork of the parent, which has imported everything already (what the server is
    to its children); on CUDA spawned, as `context` spawns."""
    return multiprocessing.get_context("fork" if device.split(":")[0] == "cpu" and enabled() else "spawn")


def warm() -> None:
    """Start the server for CPU children now; it imports in the background and the first child no longer waits."""
    if not enabled():
        return
    context("cpu")
    multiprocessing.forkserver.ensure_running()


class NotReady(RuntimeError):
    """A starting child sent nothing in time, or exited first; the message says which ("exited with code -15")."""


def first_message(process: BaseProcess, outbox: Any, timeout: float) -> Any:
    """A starting child's first message (it is ready, or why it is not), waited for up to `timeout` s; NotReady if
    none comes. A child that exits first (killed, signalled) is not waited on for the rest of `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return outbox.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            if not process.is_alive():
                raise NotReady(f"exited with code {process.exitcode}") from None
            if time.monotonic() >= deadline:
                raise NotReady(f"did not start within {timeout:.0f}s") from None


def stop(process: BaseProcess, inbox: Any, stop_message: Any, reader: threading.Thread | None, timeout: float) -> None:
    """Ask a child to stop (`stop_message` on its `inbox` queue), wait up to `timeout` s, kill it if it is still
    alive, then join the thread that reads its outbox (which ends when the child's side closes)."""
    if process.is_alive():
        inbox.put(stop_message)
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)
    if reader is not None:
        reader.join(timeout=5)
