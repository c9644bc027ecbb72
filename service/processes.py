"""Child processes of `inkwell serve`: they die with it, and job workers that die are restarted.

A `kill -9` of the service runs no cleanup, so its children are tied to it by the kernel instead: each is
started with a parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`). The kernel sends it when the *thread*
that started the child ends, so a child must be started from a thread that lives as long as it should (the
main thread, or the supervisor's own thread, which stops its children before it ends).
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("inkwell.serve")
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

# A restarted job worker waits RESTART_MIN_SECONDS, doubled for each crash in a row, at most RESTART_MAX_SECONDS;
# a worker that ran STABLE_SECONDS before it died starts the count again.
RESTART_MIN_SECONDS = 0.5
RESTART_MAX_SECONDS = 60.0
STABLE_SECONDS = 60.0


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child get `sig` when the thread that starts it ends (None off Linux).

    The check after prctl closes the race where the parent died between fork and prctl."""
    if _LIBC is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def restart_delay(crashes: int) -> float:
    """Seconds before the restart of a worker that died `crashes` times in a row (1 for the first)."""
    return min(RESTART_MIN_SECONDS * 2 ** min(crashes - 1, 32), RESTART_MAX_SECONDS)


class _Child:
    """One supervised slot: its process, when it started, its crashes in a row and when it may restart."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.crashes = 0
        self.restart_at: float | None = None


class Supervisor:
    """Runs `count` copies of `args` and restarts each one that exits, with a doubling backoff.

    Its own thread starts, watches and stops the children, so their parent-death signal fires only when the
    supervisor stops or the whole service dies.
    """

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], count: int, poll: float = 0.2) -> None:
        self.name, self.args, self.env, self.poll = name, list(args), env, poll
        self.children = [_Child(i) for i in range(count)]
        self._stopping = threading.Event()
        self._launched = threading.Event()
        self._launch_error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name=f"supervise-{name}", daemon=True)

    def start(self) -> None:
        """Start the children and keep them running; returns once they are launched."""
        self._thread.start()
        self._launched.wait()
        if self._launch_error is not None:
            self._thread.join()
            raise self._launch_error

    def _launch(self, child: _Child) -> None:
        child.proc = subprocess.Popen(self.args, env=self.env, preexec_fn=die_with_parent())
        child.started = time.monotonic()
        child.restart_at = None

    def _watch(self, child: _Child) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now < child.restart_at:
                return
            try:
                self._launch(child)
            except OSError as exc:  # no process to be had now (fork or exec failed): a crash like any other
                child.crashes += 1
                child.restart_at = now + restart_delay(child.crashes)
                log.error("%s %d could not be restarted (%s); trying again later", self.name, child.index, exc)
                return
            log.warning("%s %d restarted (pid %d)", self.name, child.index, child.proc.pid)
            return
        code = child.proc.poll()
        if code is None:
            return
        child.crashes = 1 if now - child.started >= STABLE_SECONDS else child.crashes + 1
        delay = restart_delay(child.crashes)
        child.restart_at = now + delay
        log.warning(
            "%s %d (pid %d) exited with %s; restarting in %.1fs (%d in a row)",
            self.name,
            child.index,
            child.proc.pid,
            code,
            delay,
            child.crashes,
        )

    def _run(self) -> None:
        try:
            for child in self.children:
                self._launch(child)
        except OSError as exc:
            self._launch_error = exc
            self._terminate()
            return
        finally:
            self._launched.set()
        while not self._stopping.wait(self.poll):
            for child in self.children:
                self._watch(child)
        self._terminate()

    def _terminate(self, grace: float = 60.0) -> None:
        running = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        """SIGTERM every child (SIGKILL after a minute) and wait for them."""
        self._stopping.set()
        self._thread.join()
