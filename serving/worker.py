"""The serving worker: one process per device (or device group) running the engine loop beside its colocated loader.

A native engine spanning several devices (`EngineConfig.ranks`) is one worker all the same: this process is its
rank 0 and starts the others; the router, the loader and the handle see one engine.

Between engine steps the worker drains its inbox (`messages.ToWorker`): new requests, aborts, load/unload
orders and staged adapters arriving from the loader. A new adapter arrives as a slot image in the loader's
staging ring (mapped once, see `transfer`); it is registered between two steps (a pinned one is copied into its
slot right away, in one copy) and the worker keeps its own copy of the image, so requests on other adapters keep
decoding while it is fetched and verified, and an evicted adapter can come back later. `handle.WorkerHandle` is
the service's end of this process.
"""

import multiprocessing
import queue
import time
from dataclasses import dataclass, field, replace

import torch

from inkwell import forkserver
from inkwell.models import load_base_config
from inkwell.serving import messages
from inkwell.serving.contract import AdapterIncompatibleError, EngineConfig, EngineError, Request, make_engine
from inkwell.serving.loader import loader_main, stop_loader
from inkwell.serving.slot_copy import slot_layout
from inkwell.serving.transfer import ImageReceiver

CACHE_STATS_SECONDS = 1.0  # how often at most the worker reports its prefix cache's counters (for /metrics)


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int = 1
    name: str = "worker"
    engine_kind: str = "native"  # a key of inkwell.serving.contract.ENGINES


class ServingWorker:
    """The engine, its loader process and the loop that feeds the engine from the inbox."""

    def __init__(self, config: WorkerConfig, inbox, outbox):
        self.inbox, self.outbox = inbox, outbox
        lora = config.engine
        model_config = load_base_config(config.model_dir)
        layout = slot_layout(model_config, lora.max_lora_rank, lora.lora_groups, getattr(torch, lora.dtype))
        # The loader first, before this process runs a torch op: on the CPU it is then a plain fork (forkserver.py)
        ctx = forkserver.nested_context(lora.device)
        self.loader_inbox = ctx.Queue()
        self.loader = ctx.Process(
            target=loader_main,
            args=(config.model_dir, config.engine, self.loader_inbox, inbox),
            name=f"{config.name}-loader",
            daemon=True,
        )
        self.loader.start()
        self.receiver = ImageReceiver(layout)
        try:
            self.engine = make_engine(config.engine_kind, config.model_dir, config.engine)
        except BaseException:
            stop_loader(self.loader, self.loader_inbox, self.receiver, timeout=5)
            raise
        self._cache_reported: tuple[float, messages.CacheStats | None] = (0.0, None)

    def run(self) -> None:
        engine = self.engine
        identity = engine.identity
        info = messages.WorkerInfo(
            identity.name, identity.config_sha256, engine.max_context, engine.model_config.vocab_size
        )
        self.outbox.put(messages.Ready(info))
        service = multiprocessing.parent_process()
        while True:
            try:
                msg = self.inbox.get_nowait() if engine.has_work() else self.inbox.get(timeout=1.0)
            except queue.Empty:
                if not engine.has_work() and service is not None and not service.is_alive():
                    msg = messages.Stop()  # the service was killed without stopping us: free the device
                else:
                    msg = None
            while msg is not None:
                if isinstance(msg, messages.Stop):
                    stop_loader(self.loader, self.loader_inbox, self.receiver, timeout=5)
                    engine.shutdown()
                    self.outbox.put(messages.Stopped())
                    return
                self.handle(msg)
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if engine.has_work():
                outputs = engine.step()
                if outputs:
                    self.outbox.put(messages.Outputs(outputs))
            self._report_cache()

    def _report_cache(self) -> None:
        """Send the prefix cache's counters to the handle when they moved, at most once per CACHE_STATS_SECONDS."""
        at, last = self._cache_reported
        stats = self.engine.cache_stats()
        now = time.monotonic()
        if stats is None or now - at < CACHE_STATS_SECONDS or (last is not None and last.stats == stats):
            return
        report = messages.CacheStats(replace(stats))  # a copy: the engine's own goes on counting
        self._cache_reported = (now, report)
        self.outbox.put(report)

    def handle(self, msg: messages.ToWorker) -> None:
        engine = self.engine
        match msg:
            case messages.Generate(request_id=rid, prompt_ids=prompt_ids, params=params, adapter=key):
                try:
                    engine.add_request(Request(rid, prompt_ids, params, key))
                except EngineError as exc:
                    self.outbox.put(messages.RequestFailed(rid, exc.code, str(exc), exc.param))
            case messages.Abort(request_id=rid):
                outputs = engine.abort(rid)
                if outputs:
                    self.outbox.put(messages.Outputs(outputs))
            case messages.Load(key=key):
                if key in engine.adapters:
                    self.outbox.put(messages.Loaded(key))
                else:
                    self.loader_inbox.put(msg)
            case messages.Staged():
                self._register(msg)
            case messages.StageFailed(key=key, failure=failure):
                self.outbox.put(messages.Loaded(key, failure))
            case messages.Unload(key=key):
                try:
                    engine.unload_adapter(key)
                    self.outbox.put(messages.Unloaded(key))
                except EngineError as exc:
                    self.outbox.put(messages.Unloaded(key, messages.Failure(exc.code, str(exc))))

    def _register(self, msg: messages.Staged) -> None:
        """Load a staged adapter (a pinned one is written into its slot straight from the ring row),
        then keep its image in worker memory and hand the row back."""
        adapter = self.receiver.adapter(msg.staged)
        before = set(self.engine.adapters)
        failure = None
        try:
            self.engine.load_adapter(msg.key, adapter, pinned=msg.pinned)
        except AdapterIncompatibleError as exc:
            failure = messages.Failure("adapter_incompatible", str(exc))
        except EngineError as exc:
            failure = messages.Failure(exc.code, str(exc))
        self.loader_inbox.put(self.receiver.release(msg.staged, adapter if failure is None else None))
        evicted = sorted(before - set(self.engine.adapters))
        if evicted:
            self.outbox.put(messages.Evicted(evicted))
        self.outbox.put(messages.Loaded(msg.key, failure))


def worker_main(config: WorkerConfig, inbox, outbox) -> None:
    """The worker process's entry point."""
    torch.set_num_threads(config.threads)
    try:
        worker = ServingWorker(config, inbox, outbox)
    except Exception as exc:  # report a bad model directory or config instead of dying silently
        outbox.put(messages.StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    worker.run()
