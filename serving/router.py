"""The serving router: which worker runs a request, loading its adapter there first if needed.

Workers are grouped by base model and started on first use. A request goes to the least loaded
worker that already holds its adapter version, else to the least loaded worker, which is asked
to load it. Each worker accepts a bounded number of requests in flight; beyond that on every
worker the router refuses with QueueFullError (HTTP 429 with Retry-After).
"""

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from inkwell.serving.contract import SamplingParams
from inkwell.serving.handle import RequestStream, WorkerDiedError, WorkerHandle
from inkwell.serving.sources import AdapterSource


class QueueFullError(RuntimeError):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class AdapterRef:
    """One adapter version: `key` is unique per version (a new version is a new key)."""

    key: str
    source: AdapterSource


class ServingRouter:
    """Routes requests to workers of their base model; `start_workers(base)` makes them on first use."""

    def __init__(
        self,
        start_workers: Callable[[str], list[WorkerHandle]],
        max_inflight_per_worker: int = 64,
        retry_after: int = 1,
    ):
        self.start_workers = start_workers
        self.max_inflight = max_inflight_per_worker
        self.retry_after = retry_after
        self.workers: dict[str, list[WorkerHandle]] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._reserved: dict[int, int] = {}
        self._closed = False
        self._lock = threading.Lock()  # between close() and a start finishing in its thread

    async def workers_for(self, base: str) -> list[WorkerHandle]:
        """The workers of `base`, started (once, off the event loop) by the first request that needs them,
        and started afresh when every one of them has died."""
        if base in self.workers and not any(w.alive for w in self.workers[base]):
            for worker in self.workers.pop(base):
                worker.close()
        if base not in self.workers:
            task = self._starting.get(base)
            if task is None:
                task = self._starting[base] = asyncio.ensure_future(asyncio.to_thread(self._start, base))
                task.add_done_callback(lambda _: self._starting.pop(base, None))
            return await asyncio.shield(task)
        return self.workers[base]

    def _start(self, base: str) -> list[WorkerHandle]:
        """Start the workers of `base` and keep them, in the start's thread: they are kept even when every
        request that waited for them has gone, and stopped at once when the router closed while they started
        (they were left running, unreachable, holding their devices)."""
        workers = self.start_workers(base)
        with self._lock:
            if not self._closed:
                self.workers[base] = workers
                return workers
        for worker in workers:
            worker.close()
        raise WorkerDiedError(f"the service stopped while the workers of {base!r} started")

    def _load(self, worker: WorkerHandle) -> int:
        return worker.inflight + self._reserved.get(id(worker), 0)

    def pick(self, workers: list[WorkerHandle], key: str | None) -> WorkerHandle:
        """Least loaded live worker holding `key`, else the least loaded live worker.

        QueueFullError when every live worker is full; WorkerDiedError when none is alive."""
        live = [w for w in workers if w.alive]
        if not live:
            raise WorkerDiedError(f"none of the {len(workers)} workers of this base model is running")
        open_ = [w for w in live if self._load(w) < self.max_inflight]
        if not open_:
            raise QueueFullError(
                f"all {len(workers)} workers have {self.max_inflight} requests in flight; retry shortly",
                self.retry_after,
            )
        holding = [w for w in open_ if key is not None and key in w.adapters]
        return min(holding or open_, key=self._load)

    async def submit(
        self, base: str, prompt_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> RequestStream:
        """Start a request on a worker (loading its adapter there first); iterate the stream for outputs."""
        worker = self.pick(await self.workers_for(base), adapter.key if adapter else None)
        self._reserved[id(worker)] = self._reserved.get(id(worker), 0) + 1
        try:
            if adapter is not None:
                await worker.load_adapter(adapter.key, adapter.source)
            return worker.submit(prompt_ids, params, adapter.key if adapter else None)
        finally:
            self._reserved[id(worker)] -= 1

    async def preload(self, base: str, adapter: AdapterRef) -> None:
        """Load `adapter` on every live worker of `base` now, so no request on it waits for a fetch."""
        workers = [w for w in await self.workers_for(base) if w.alive]
        await asyncio.gather(*(w.load_adapter(adapter.key, adapter.source) for w in workers))

    def fleet(self) -> dict[str, list[WorkerHandle]]:
        """The workers of each base model started so far; a base whose workers are still starting has none yet."""
        return {**{base: [] for base in self._starting}, **self.workers}

    def close(self) -> None:
        """Stop every worker, and those still starting once they have started."""
        with self._lock:
            self._closed = True
            workers = [w for ws in self.workers.values() for w in ws]
            self.workers.clear()
        for worker in workers:
            worker.close()
