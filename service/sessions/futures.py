"""Futures: every session and sampling request answers with a future id at once; its result is polled or
long-polled by that id.

A future belongs to one tenant (another tenant's id is simply not found), settles once (a result or an error
with a code), and is kept `ttl` seconds after it settled so a client that lost a poll can ask again. A future
whose worker died is settled with a retryable error, never left pending.
"""

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

FUTURE_TTL_SECONDS = 3600.0

type FutureState = Literal["pending", "succeeded", "failed"]


@dataclass
class FutureError:
    """Why a request failed: a code, a message a person can act on, and whether sending it again may work."""

    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Future:
    id: str
    tenant_id: str
    kind: str  # forward_backward, optim_step, sample, ...
    session_id: str | None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    state: FutureState = "pending"
    result: Any = None
    error: FutureError | None = None
    settled_at: float | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def wait(self, timeout: float) -> bool:
        """True once settled; False when `timeout` passed first."""
        if self.state != "pending":
            return True
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        return True


class FutureStore:
    """The futures of one API process. Settled from worker reader threads through the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ttl: float = FUTURE_TTL_SECONDS) -> None:
        self.loop, self.ttl = loop, ttl
        self._futures: dict[str, Future] = {}

    def create(self, tenant_id: str, kind: str, session_id: str | None = None) -> Future:
        self._expire()
        future = Future(f"fut_{secrets.token_hex(12)}", tenant_id, kind, session_id)
        self._futures[future.id] = future
        return future

    def get(self, tenant_id: str, future_id: str) -> Future | None:
        future = self._futures.get(future_id)
        return future if future is not None and future.tenant_id == tenant_id else None

    def pending(self, session_id: str) -> list[Future]:
        return [f for f in self._futures.values() if f.session_id == session_id and f.state == "pending"]

    def succeed(self, future: Future, result: Any) -> None:
        self._settle(future, "succeeded", result=result)

    def fail(self, future: Future, error: FutureError) -> None:
        self._settle(future, "failed", error=error)

    def settle_threadsafe(self, future: Future, result: Any = None, error: FutureError | None = None) -> None:
        """From another thread: settle on the event loop's thread."""
        if error is None:
            self.loop.call_soon_threadsafe(self.succeed, future, result)
        else:
            self.loop.call_soon_threadsafe(self.fail, future, error)

    def _settle(self, future: Future, state: FutureState, result: Any = None, error: FutureError | None = None) -> None:
        if future.state != "pending":
            return
        future.state, future.result, future.error = state, result, error
        future.settled_at = time.time()
        future._event.set()

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl
        for fid in [k for k, f in self._futures.items() if f.settled_at is not None and f.settled_at < cutoff]:
            del self._futures[fid]
