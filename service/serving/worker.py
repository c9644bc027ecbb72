"""A serving worker: one process per device running the engine loop, and its handle in the service.

The worker owns an `Engine` and a colocated loader process. Between engine steps it drains its
inbox: new requests, aborts, load/unload orders and staged adapters arriving from the loader.
A new adapter arrives as a slot image in the loader's staging ring (mapped once, see `transfer`);
it is registered between two steps (a pinned one is copied into its slot right away, in one copy)
and the worker keeps its own copy of the image, so requests on other adapters keep decoding while
it is fetched and verified, and an evicted adapter can come back later.

`WorkerHandle` is the service side: it starts the process, sends requests, and turns the
worker's output messages into per-request asyncio queues (a reader thread feeds the event loop).
"""

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from inkwell.service.engine import (
    AdapterIncompatibleError,
    EngineConfig,
    EngineError,
    Request,
    SamplingError,
    SamplingParams,
)
from inkwell.service.engine.engine import StepOutput
from inkwell.service.engine.interface import make_engine
from inkwell.service.engine.slot_copy import slot_layout
from inkwell.service.serving.loader import loader_main, stop_loader
from inkwell.service.serving.transfer import ImageReceiver, StagedAdapter

if TYPE_CHECKING:  # sources import boto3, which a GPU worker that never reads S3 need not have
    from inkwell.service.serving.sources import AdapterSource

log = logging.getLogger("inkwell.serving")


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int = 1
    name: str = "worker"
    engine_kind: str = "native"  # a key of inkwell.service.engine.interface.ENGINES


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker reports once its engine is up."""

    base_name: str
    config_sha256: str
    max_context: int
    vocab_size: int


class AdapterLoadError(RuntimeError):
    """The loader could not fetch or verify an adapter (`code` adapter_load_failed), or the engine
    cannot serve it (`code` adapter_incompatible: rank, targets or base)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class WorkerDiedError(RuntimeError):
    """The worker process exited while requests were in flight."""


# ---- the worker process ----------------------------------------------------------------------


class _WorkerLoop:
    def __init__(self, config: WorkerConfig, inbox, outbox):
        self.engine = make_engine(config.engine_kind, config.model_dir, config.engine)
        self.inbox, self.outbox = inbox, outbox
        lora = config.engine
        layout = slot_layout(self.engine.model_config, lora.max_lora_rank, lora.lora_groups, getattr(torch, lora.dtype))
        self.receiver = ImageReceiver(layout)
        ctx = mp.get_context("spawn")
        self.loader_inbox = ctx.Queue()
        self.loader = ctx.Process(
            target=loader_main,
            args=(config.model_dir, config.engine, self.loader_inbox, inbox),
            name=f"{config.name}-loader",
            daemon=True,
        )
        self.loader.start()

    def run(self) -> None:
        engine = self.engine
        self.outbox.put(
            (
                "ready",
                WorkerInfo(
                    engine.identity.name,
                    engine.identity.config_sha256,
                    engine.max_context,
                    engine.model_config.vocab_size,
                ),
            )
        )
        while True:
            try:
                msg = self.inbox.get_nowait() if engine.has_work() else self.inbox.get()
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg[0] == "stop":
                    stop_loader(self.loader, self.loader_inbox, self.receiver, timeout=5)
                    self.outbox.put(("stopped",))
                    return
                self.handle(msg)
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if engine.has_work():
                outputs = engine.step()
                if outputs:
                    self.outbox.put(("outputs", outputs))

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        engine = self.engine
        if kind == "generate":
            _, rid, prompt_ids, params, key = msg
            try:
                engine.add_request(Request(rid, prompt_ids, params, key))
            except EngineError as exc:
                self.outbox.put(("error", rid, exc.code, str(exc), exc.param))
            except SamplingError as exc:
                self.outbox.put(("error", rid, "invalid_sampling", str(exc), exc.param))
        elif kind == "abort":
            outputs = engine.abort(msg[1])
            if outputs:
                self.outbox.put(("outputs", outputs))
        elif kind == "load":
            _, key, source, pinned = msg
            if key in engine.adapters:
                self.outbox.put(("loaded", key, None))
            else:
                self.loader_inbox.put(("load", key, source, pinned))
        elif kind == "adapter":
            self._register(*msg[1:])
        elif kind == "adapter_failed":
            self.outbox.put(("loaded", msg[1], (msg[2], msg[3])))
        elif kind == "unload":
            try:
                engine.unload_adapter(msg[1])
                self.outbox.put(("unloaded", msg[1], None))
            except EngineError as exc:
                self.outbox.put(("unloaded", msg[1], (exc.code, str(exc))))

    def _register(self, key: str, staged: StagedAdapter, pinned: bool) -> None:
        """Load a staged adapter (a pinned one is written into its slot straight from the ring row),
        then keep its image in worker memory and hand the row back."""
        adapter = self.receiver.adapter(staged)
        before = set(self.engine.adapters)
        try:
            self.engine.load_adapter(key, adapter, pinned=pinned)
            error = None
        except AdapterIncompatibleError as exc:
            error = ("adapter_incompatible", str(exc))
        except EngineError as exc:
            error = (exc.code, str(exc))
        self.loader_inbox.put(self.receiver.release(staged, adapter if error is None else None))
        evicted = sorted(before - set(self.engine.adapters))
        if evicted:
            self.outbox.put(("evicted", evicted))
        self.outbox.put(("loaded", key, error))


def worker_main(config: WorkerConfig, inbox, outbox) -> None:
    torch.set_num_threads(config.threads)
    try:
        loop = _WorkerLoop(config, inbox, outbox)
    except Exception as exc:  # report a bad model directory or config instead of dying silently
        outbox.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    loop.run()


# ---- the service side ------------------------------------------------------------------------


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
        ctx = mp.get_context("spawn")
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.process = ctx.Process(target=worker_main, args=(config, self.inbox, self.outbox), name=config.name)
        self.info: WorkerInfo | None = None
        self.adapters: set[str] = set()
        self.inflight = 0
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._loads: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closed = False

    def start(self, timeout: float = 300.0) -> WorkerInfo:
        """Start the process and wait until its engine is up (blocking)."""
        self.process.start()
        try:
            msg = self.outbox.get(timeout=timeout)
        except queue.Empty as exc:
            self.close()
            raise WorkerDiedError(f"worker {self.config.name} did not start within {timeout:.0f}s") from exc
        if msg[0] != "ready":
            self.close()
            raise WorkerDiedError(f"worker {self.config.name} failed to start: {msg[1]}")
        self.info = msg[1]
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
        self.inbox.put(("generate", rid, list(prompt_ids), params, adapter_key))
        return RequestStream(self, rid, params.n, q)

    def _done(self, rid: str, aborted: bool) -> None:
        with self._lock:
            self._streams.pop(rid, None)
        self.inflight -= 1
        if aborted and self.alive:
            self.inbox.put(("abort", rid))

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
            self.inbox.put(("load", key, source, pinned))
        await future

    async def unload_adapter(self, key: str) -> None:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._loads.setdefault(f"unload:{key}", []).append((asyncio.get_running_loop(), future))
        self.inbox.put(("unload", key))
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
            if msg[0] == "stopped":
                self._fail_all(WorkerDiedError(f"worker {self.config.name} was stopped"))
                return
            self._dispatch(msg)

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            for out in msg[1]:
                self._deliver(out.request_id, out)
        elif kind == "error":
            _, rid, code, message, param = msg
            self._deliver(rid, EngineError(code, message, param))
        elif kind in ("loaded", "unloaded"):
            _, key, error = msg
            if kind == "loaded" and error is None:
                self.adapters.add(key)
            if kind == "unloaded" and error is None:
                self.adapters.discard(key)
            with self._lock:
                waiters = self._loads.pop(key if kind == "loaded" else f"unload:{key}", [])
            for loop, future in waiters:
                exc = None if error is None else AdapterLoadError(*error)
                loop.call_soon_threadsafe(_settle, future, exc)
        elif kind == "evicted":
            self.adapters.difference_update(msg[1])

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
        if self.process.is_alive():
            self.inbox.put(("stop",))
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._reader is not None:
            self._reader.join(timeout=5)


def _settle(future: asyncio.Future, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
