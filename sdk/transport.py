"""The two thin transports: they send `Call`s over httpx (sync or async), retry what is safe to
retry, and drive `Op` generators. Everything else (what to send, how to read it, when to retry,
how to follow an event stream) is shared code in calls.py, events.py and `_Policy` below.
"""

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import httpx

from inkwell.sdk.calls import Call, Op
from inkwell.sdk.errors import APIConnectionError, InkwellError, RateLimitError, error_from_response
from inkwell.sdk.events import EventFollower, Page, SSEParser
from inkwell.service.schemas import JobEvent

# Connection never established: the server saw nothing, so any method may be resent.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

type NextCall = Callable[[Page], Call | None]


class _Policy:
    """Request building and the bounded retry rule, common to both transports."""

    def __init__(self, url: str, api_key: str, max_retries: int, backoff: float, max_backoff: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    def request_kwargs(self, call: Call, open_file: Callable[[Path], Any]) -> dict[str, Any]:
        headers = dict(call.headers)
        if call.auth:
            headers["Authorization"] = f"Bearer {self.api_key}"
        kwargs: dict[str, Any] = {"method": call.method, "url": call.path, "params": call.clean_params}
        kwargs["headers"] = headers
        if call.json is not None:
            kwargs["json"] = call.json
        if call.data is not None:
            kwargs["data"] = call.data
        if call.uploads:
            kwargs["files"] = [
                (
                    u.field,
                    (u.filename, u.source if isinstance(u.source, bytes) else open_file(u.source), u.content_type),
                )
                for u in call.uploads
            ]
        if call.timeout is not None:
            kwargs["timeout"] = call.timeout
        return kwargs

    def retry_delay(self, call: Call, attempt: int, exc: Exception) -> float | None:
        """Seconds to wait before resending `call`, or None to give up and raise."""
        if attempt >= (self.max_retries if call.max_retries is None else call.max_retries):
            return None
        if isinstance(exc, InkwellError):
            if not exc.retryable:
                return None
            if not (call.idempotent or exc.from_service or isinstance(exc, RateLimitError)):
                return None  # a gateway's 502/504 does not say whether the service acted on it
            hint = getattr(exc, "retry_after", None)
        elif isinstance(exc, _NOT_SENT) or (isinstance(exc, httpx.TransportError) and call.idempotent):
            hint = None
        else:
            return None  # the server may have acted on a non-idempotent request: never resend it
        delay = min(self.backoff * 2**attempt, self.max_backoff) * (0.5 + random.random() / 2)
        return max(delay, min(hint, self.max_backoff * 4)) if hint is not None else delay

    def connection_error(self, exc: httpx.TransportError) -> APIConnectionError:
        return APIConnectionError(
            f"cannot reach the inkwell service at {self.url} ({type(exc).__name__}: {exc}); "
            "check INKWELL_URL / --url and that `inkwell serve` is running",
            code="connection_error",
            details={"url": self.url, "retryable": True},
        )

    def reconnect_delay(self, follower: EventFollower, exc: Exception) -> float:
        """Seconds before reopening a dropped event stream; raises once the follower gives up."""
        delay = follower.on_drop(exc)
        if delay is not None:
            return delay
        if isinstance(exc, httpx.TransportError):
            raise self.connection_error(exc) from exc
        raise exc

    @staticmethod
    def raise_for_status(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        raise error_from_response(response.status_code, body, dict(response.headers), response.text)

    @staticmethod
    def parse_events(parser: SSEParser, line: str) -> JobEvent | None:
        message = parser.feed(line)
        return JobEvent.model_validate_json(message.data) if message is not None else None


class _Transport:
    """What both transports hold: the retry policy and an httpx client of their kind (`http_class`)."""

    http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.policy = _Policy(url, api_key, max_retries, backoff, max_backoff)
        self.http = self.http_class(
            transport=transport,
            base_url=self.policy.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            follow_redirects=True,
        )


class SyncTransport(_Transport):
    http_class = httpx.Client

    def close(self) -> None:
        self.http.close()

    def request(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                with ExitStack() as stack:
                    kwargs = self.policy.request_kwargs(call, lambda p: stack.enter_context(p.open("rb")))
                    response = self.http.send(self.http.build_request(**kwargs), stream=True)
                    stack.callback(response.close)
                    if response.status_code >= 400:
                        response.read()
                        _Policy.raise_for_status(response)
                    if call.sink is None:
                        response.read()
                        return call.parse(response)
                    call.sink.open()
                    stack.callback(call.sink.close)
                    for chunk in response.iter_bytes():
                        call.sink.write(chunk)
                    return call.sink.finish(response.headers)
            except (httpx.TransportError, InkwellError) as exc:
                delay = self.policy.retry_delay(call, attempt, exc)
                if delay is None:
                    if isinstance(exc, httpx.TransportError):
                        raise self.policy.connection_error(exc) from exc
                    raise
                attempt += 1
                time.sleep(delay)

    def run[T](self, op: Op[T] | Call) -> T:
        if isinstance(op, Call):
            return self.request(op)
        try:
            call = next(op)
            while True:
                call = op.send(self.request(call))
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    def paginate(self, first: Call, next_call: NextCall) -> Iterator[Any]:
        call: Call | None = first
        while call is not None:
            page = self.request(call)
            yield from page.data
            call = next_call(page)

    def follow(self, follower: EventFollower) -> Iterator[JobEvent]:
        while (call := follower.next_call()) is not None:
            try:
                with self.http.stream(**self.policy.request_kwargs(call, Path.open)) as response:
                    if response.status_code >= 400:
                        response.read()
                        _Policy.raise_for_status(response)
                    parser = SSEParser()
                    for line in response.iter_lines():
                        if (event := _Policy.parse_events(parser, line)) is not None:
                            yield event
                            if follower.on_event(event):
                                return
                time.sleep(follower.on_end())
            except (httpx.TransportError, InkwellError) as exc:
                time.sleep(self.policy.reconnect_delay(follower, exc))


class AsyncTransport(_Transport):
    http_class = httpx.AsyncClient

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                async with AsyncExitStack() as stack:
                    kwargs = self.policy.request_kwargs(call, lambda p: stack.enter_context(p.open("rb")))
                    response = await self.http.send(self.http.build_request(**kwargs), stream=True)
                    stack.push_async_callback(response.aclose)
                    if response.status_code >= 400:
                        await response.aread()
                        _Policy.raise_for_status(response)
                    if call.sink is None:
                        await response.aread()
                        return call.parse(response)
                    call.sink.open()
                    stack.callback(call.sink.close)
                    async for chunk in response.aiter_bytes():
                        call.sink.write(chunk)
                    return call.sink.finish(response.headers)
            except (httpx.TransportError, InkwellError) as exc:
                delay = self.policy.retry_delay(call, attempt, exc)
                if delay is None:
                    if isinstance(exc, httpx.TransportError):
                        raise self.policy.connection_error(exc) from exc
                    raise
                attempt += 1
                await asyncio.sleep(delay)

    async def run[T](self, op: Op[T] | Call) -> T:
        if isinstance(op, Call):
            return await self.request(op)
        try:
            call = next(op)
            while True:
                call = op.send(await self.request(call))
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    async def paginate(self, first: Call, next_call: NextCall) -> AsyncIterator[Any]:
        call: Call | None = first
        while call is not None:
            page = await self.request(call)
            for item in page.data:
                yield item
            call = next_call(page)

    async def follow(self, follower: EventFollower) -> AsyncIterator[JobEvent]:
        while (call := follower.next_call()) is not None:
            try:
                async with self.http.stream(**self.policy.request_kwargs(call, Path.open)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        _Policy.raise_for_status(response)
                    parser = SSEParser()
                    async for line in response.aiter_lines():
                        if (event := _Policy.parse_events(parser, line)) is not None:
                            yield event
                            if follower.on_event(event):
                                return
                await asyncio.sleep(follower.on_end())
            except (httpx.TransportError, InkwellError) as exc:
                await asyncio.sleep(self.policy.reconnect_delay(follower, exc))
