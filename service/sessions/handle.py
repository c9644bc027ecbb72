"""The service's end of one session worker process: start it, send it operations in order, settle their futures
from a reader thread, and fail every pending future (retryably) if the process dies."""

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from inkwell import forkserver
from inkwell.service.sessions import messages
from inkwell.service.sessions.futures import Future, FutureError, FutureStore
from inkwell.service.sessions.worker import session_main

# What turns a worker's result into the future's result (e.g. publish an exported adapter); runs on the loop.
type Finish = Callable[[dict[str, Any]], Awaitable[Any]]


class SessionStartError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SessionHandle:
    def __init__(self, config: messages.SessionConfig, futures: FutureStore, on_exit: Callable[[str], None]) -> None:
        self.config, self.futures, self.on_exit = config, futures, on_exit
        ctx = forkserver.context(config.device)
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=session_main, args=(config, self.inbox, self.outbox), name=f"session-{config.session_id}"
        )
        self.info: messages.SessionInfo | None = None
        self._pending: dict[str, tuple[Future, Finish | None]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closing = False

    def start(self, timeout: float) -> messages.SessionInfo:
        """Start the process and wait (blocking) until its model is resident. A close that comes first, or while
        the worker starts, wins: the worker is stopped (a closed session holds no device) and this raises."""
        with self._lock:
            if self._closing:
                raise SessionStartError("session_closed", "the session was closed before its worker started")
            self.process.start()
        try:
            msg = forkserver.first_message(self.process, self.outbox, timeout)
        except forkserver.NotReady as exc:
            self.close()
            raise SessionStartError("session_start_failed", f"the session worker {exc}") from exc
        if self._closing:  # close() stopped the worker while it started
            raise SessionStartError("session_closed", "the session was closed while its worker started")
        if not isinstance(msg, messages.Ready):
            self.close()
            if isinstance(msg, messages.StartFailed):
                raise SessionStartError(msg.code, msg.message)
            raise SessionStartError("session_start_failed", f"unexpected first message {msg!r}")
        self.info = msg.info
        self._reader = threading.Thread(target=self._read, name=f"{self.process.name}-reader", daemon=True)
        self._reader.start()
        return self.info

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self._closing

    def send(self, op: messages.Operation, future: Future, finish: Finish | None = None) -> None:
        """Queue `op` behind every earlier one; `future` settles with its result (through `finish` if given)."""
        with self._lock:
            self._pending[future.id] = (future, finish)
        self.inbox.put(op)

    def _read(self) -> None:
        while True:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    self._died(f"the session worker exited with code {self.process.exitcode}")
                    return
                continue
            except (EOFError, OSError):
                self._died("the session worker's queue closed")
                return
            match msg:
                case messages.Done(future_id=fid, result=result):
                    self._settle(fid, result, None)
                case messages.Failed(future_id=fid, code=code, message=message, details=details):
                    self._settle(fid, None, FutureError(code, message, False, details))
                case messages.Stopped():
                    self._died("the session was closed")
                    return

    def _settle(self, future_id: str, result: dict | None, error: FutureError | None) -> None:
        with self._lock:
            future, finish = self._pending.pop(future_id, (None, None))
        if future is None:
            return
        if error is not None or finish is None:
            self.futures.settle_threadsafe(future, result, error)
        else:
            asyncio.run_coroutine_threadsafe(self._finish(future, finish, result), self.futures.loop)

    async def _finish(self, future: Future, finish: Finish, result: dict) -> None:
        try:
            value = await finish(result)
        except Exception as exc:  # noqa: BLE001 - the future says what failed; the session goes on
            self.futures.fail(future, _as_error(exc))
            return
        self.futures.succeed(future, value)

    def _died(self, reason: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        error = FutureError(
            "session_worker_died", f"{reason}; the request did not complete: retry it on a new session", True
        )
        for future, _ in pending:
            self.futures.settle_threadsafe(future, error=error)
        if not self._closing:
            self.on_exit(reason)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker (pending requests fail) and wait for it; kill it if it does not stop in time."""
        with self._lock:  # against start(): a worker it has not started yet is never started
            if self._closing:
                return
            self._closing = True
        forkserver.stop(self.process, self.inbox, messages.Stop(), self._reader, timeout)
        self._died("the session was closed")


class FinishError(Exception):
    """Raised by a `Finish` step with the code the future fails with."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code, self.retryable = code, retryable


def _as_error(exc: Exception) -> FutureError:
    if isinstance(exc, FinishError):
        return FutureError(exc.code, str(exc), exc.retryable)
    return FutureError("session_error", f"{type(exc).__name__}: {exc}")
