"""Pages, the server-sent-events parser and the job event follower (resume, deadline, bounded retries).

All three are pure state machines, so the sync and async transports share them unchanged.
"""

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from inkwell.sdk.calls import Call, segment
from inkwell.sdk.errors import InkwellError, JobTimeoutError
from inkwell.service.schemas import TERMINAL_STATES, JobEvent

KEEPALIVE_SECONDS = 15.0  # the service's `: keepalive` interval; a stream silent for 3x that is dead


@dataclass
class Page[T]:
    """One page of a list; pass `next_cursor` back as `cursor` for the next one (None = last page)."""

    data: list[T]
    next_cursor: str | None = None

    def __iter__(self) -> Iterator[T]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


@dataclass
class SSEMessage:
    id: str | None
    event: str | None
    data: str


@dataclass
class SSEParser:
    """Incremental text/event-stream parser (WHATWG rules for the fields the service sends)."""

    _id: str | None = None
    _event: str | None = None
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> SSEMessage | None:
        """Feed one line (without its line ending); returns a message when a blank line ends one."""
        if not line:
            if not self._data:
                self._event = None
                return None
            message = SSEMessage(self._id, self._event, "\n".join(self._data))
            self._event, self._data = None, []
            return message
        if line.startswith(":"):
            return None  # comment, e.g. the keepalive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None


class EventFollower:
    """Decides what the next connection to a job's event stream is, when a stream is finished,
    and how long to wait after a drop: it resumes from the last event id it saw, stops after
    the job's terminal state event, and gives up after `max_retries` drops in a row."""

    def __init__(
        self, job_id: str, after: int | None = None, timeout: float | None = None, max_retries: int = 5
    ) -> None:
        self.job_id = job_id
        self.after = after
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.max_retries = max_retries
        self.failures = 0
        self.done = False

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise JobTimeoutError(
                f"job {self.job_id} did not finish in time; it keeps running (wait again or cancel it)",
                code="wait_timeout",
                details={"job_id": self.job_id},
            )
        return remaining

    def next_call(self) -> Call | None:
        if self.done:
            return None
        remaining = self._remaining()
        read = 3 * KEEPALIVE_SECONDS if remaining is None else min(remaining, 3 * KEEPALIVE_SECONDS)
        headers = {"Accept": "text/event-stream"}
        if self.after is not None:
            headers["Last-Event-ID"] = str(self.after)
        return Call(
            "GET",
            f"/v1/jobs/{segment(self.job_id)}/events/stream",
            params={"after": self.after},
            headers=headers,
            timeout=httpx.Timeout(10.0, read=read),
        )

    def on_event(self, event: JobEvent) -> bool:
        """Record an event; True when it is the job's last one."""
        self.after = event.id
        self.failures = 0
        self.done = event.type == "state" and event.state in TERMINAL_STATES
        return self.done

    def on_end(self) -> float:
        """The server closed the stream without a terminal event (e.g. it restarted): seconds to
        wait before reconnecting; raises once that keeps happening."""
        self.failures += 1
        if self.failures > self.max_retries:
            raise InkwellError(
                f"the event stream of job {self.job_id} keeps closing early; check the service",
                code="stream_closed",
                details={"job_id": self.job_id, "retryable": True},
            )
        return self._backoff()

    def on_drop(self, exc: Exception) -> float | None:
        """Seconds to wait before reconnecting after `exc`, or None to give up (the caller raises)."""
        self._remaining()
        if isinstance(exc, InkwellError) and not exc.retryable:
            return None
        self.failures += 1
        if self.failures > self.max_retries:
            return None
        if isinstance(exc, httpx.ReadTimeout):
            return 0.0  # silent past the keepalive interval: just reopen
        return self._backoff()

    def _backoff(self) -> float:
        return min(0.5 * 2 ** (self.failures - 1), 8.0) * (0.5 + random.random() / 2)
