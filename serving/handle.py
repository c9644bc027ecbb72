"""A serving worker seen from the service: start its process, send requests, stream their outputs.

A reader thread turns the worker's reports (`messages.ToHandle`) into per-request asyncio queues and settles the
futures of adapter loads and unloads on the event loops that wait for them.
"""

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from inkwell import forkserver
from inkwell.serving import messages
from inkwell.serving.contract import EngineError, PrefixCacheStats, SamplingParams, StepOutput
from inkwell.serving.stats import WorkerStats
from inkwell.serving.worker import WorkerConfig, worker_main

if TYPE_CHECKING:  # sources import boto3, which a GPU worker that never reads S3 need not have
    from inkwell.serving.sources import AdapterSource


class AdapterLoadError(RuntimeError):
    """The loader could not fetch or verify an adapter (`code` adapter_load_failed), or the engine
    cannot serve it (`code` adapter_incompatible: rank, targets or base)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class WorkerDiedError(RuntimeError):
    """The worker process exited while requests were in flight."""


class RequestStream:
    """The outputs of one request on one worker; closing it early aborts the request."""

    def __init__(self, handle: "WorkerHandle", rid: str, n: int, q: asyncio.Queue):
        self.handle, self.rid, self.remaining, self.q = handle, rid, n, q
        self._closed = False

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    def cancel(self) -> None:
        """Release the request, aborting it if unfinished (safe to call more than once)."""
        if not self._closed:
            self._closed = True
            self.handle._done(self.rid, aborted=self.remaining > 0)

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        try:
            while self.remaining:
                item = await self.q.get()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    self.remaining -= 1
                yield item
        finally:
            self.cancel()


class WorkerHandle:
    """A worker process seen from the service: submit requests, load adapters, stream outputs."""

    _ids = itertools.count()

    def __init__(self, config: WorkerConfig):
        self.config = config
        ctx = forkserver.context(config.engine.device)
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.process = ctx.Process(target=worker_main, args=(config, self.inbox, self.outbox), name=config.name)
        self.info: messages.WorkerInfo | None = None
        self.adapters: set[str] = set()
        self.inflight = 0
        self.cache_stats: PrefixCacheStats | None = None  # its engine's prefix cache counters, as last reported
        self.stats = WorkerStats()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._loads: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closed = False

    def start(self, timeout: float = 300.0) -> messages.WorkerInfo:
        """Start the process and wait until its engine is up (blocking)."""
        self.process.start()
        try:
            msg = forkserver.first_message(self.process, self.outbox, timeout)
        except forkserver.NotReady as exc:
            self.close()
            raise WorkerDiedError(f"worker {self.config.name} {exc}") from exc
        if not isinstance(msg, messages.Ready):
            self.close()
            reason = msg.reason if isinstance(msg, messages.StartFailed) else msg
            raise WorkerDiedError(f"worker {self.config.name} failed to start: {reason}")
        self.info = msg.info
        self._reader = threading.Thread(target=self._read, name=f"{self.config.name}-reader", daemon=True)
        self._reader.start()
        return self.info

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self._closed

    # -- requests --

    def submit(self, prompt_ids: list[int], params: SamplingParams, adapter_key: str | None) -> RequestStream:
        """Send a request now; iterate the returned stream for its outputs (choice `index`, deltas)."""
        if not self.alive:
            raise WorkerDiedError(f"worker {self.config.name} is not running")
        rid = f"{self.config.name}-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), q)
        self.inflight += 1
        self.stats.request()
        self.inbox.put(messages.Generate(rid, list(prompt_ids), params, adapter_key))
        return RequestStream(self, rid, params.n, q)

    def _done(self, rid: str, aborted: bool) -> None:
        with self._lock:
            self._streams.pop(rid, None)
        self.inflight -= 1
        if aborted and self.alive:
            self.inbox.put(messages.Abort(rid))

    # -- adapters --

    async def load_adapter(self, key: str, source: "AdapterSource", pinned: bool = False) -> None:
        """Have the loader fetch `source` and the worker register it as `key` (concurrent calls share one load)."""
        if key in self.adapters:
            return
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            first = key not in self._loads
            self._loads.setdefault(key, []).append((asyncio.get_running_loop(), future))
        if first:
            self.inbox.put(messages.Load(key, source, pinned))
        await future

    async def unload_adapter(self, key: str) -> None:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._loads.setdefault(f"unload:{key}", []).append((asyncio.get_running_loop(), future))
        self.inbox.put(messages.Unload(key))
        await future

    # -- the reader thread --

    def _read(self) -> None:
        while True:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    self._fail_all(WorkerDiedError(f"worker {self.config.name} exited (code {self.process.exitcode})"))
                    return
                continue
            except (EOFError, OSError):
                return
            if isinstance(msg, messages.Stopped):
                self._fail_all(WorkerDiedError(f"worker {self.config.name} was stopped"))
                return
            self._dispatch(msg)

    def _dispatch(self, msg: messages.ToHandle) -> None:
        match msg:
            case messages.Outputs(outputs=outputs):
                self.stats.produced(sum(len(out.token_ids) for out in outputs))
                for out in outputs:
                    self._deliver(out.request_id, out)
            case messages.RequestFailed(request_id=rid, code=code, message=message, param=param):
                self._deliver(rid, EngineError(code, message, param))
            case messages.Loaded(key=key, failure=failure):
                if failure is None:
                    self.adapters.add(key)
                self._answer_waiters(key, failure)
            case messages.Unloaded(key=key, failure=failure):
                if failure is None:
                    self.adapters.discard(key)
                self._answer_waiters(f"unload:{key}", failure)
            case messages.Evicted(keys=keys):
                self.adapters.difference_update(keys)
            case messages.CacheStats(stats=stats):
                self.cache_stats = stats

    def _answer_waiters(self, waiting_key: str, failure: messages.Failure | None) -> None:
        """Settle every future waiting on a load (`key`) or an unload (`unload:key`), failed or not."""
        with self._lock:
            waiters = self._loads.pop(waiting_key, [])
        exc = None if failure is None else AdapterLoadError(failure.code, failure.message)
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future, exc)

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
            loads = [w for waiters in self._loads.values() for w in waiters]
            self._loads.clear()
        for loop, q in streams:
            loop.call_soon_threadsafe(q.put_nowait, exc)
        for loop, future in loads:
            loop.call_soon_threadsafe(_settle, future, exc)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker (and its loader); kill it if it does not stop in time."""
        if self._closed:
            return
        self._closed = True
        forkserver.stop(self.process, self.inbox, messages.Stop(), self._reader, timeout)


def _settle(future: asyncio.Future, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
