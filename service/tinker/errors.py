"""Errors on `/api/v1` in the shape the Tinker client reads: `{"error": message, "category": "user"|"server"}`,
plus inkwell's `code` and `details`. A 4xx always has a body (the client retries a bare 400 as a proxy's), a 429
carries Retry-After, and 409 is never used for a refusal (the client retries 409 for five minutes)."""

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from inkwell.service.errors import APIError, validation_summary
from inkwell.service.sessions.futures import FutureError

# Failures of the service rather than of the request; every other code is the caller's to fix.
SERVER_CODES = frozenset(
    {
        "session_error",
        "sampling_error",
        "session_worker_died",
        "session_start_failed",
        "publish_failed",
        "worker_unavailable",
        "server_busy",
        "service_stopped",
        "internal_error",
    }
)


def category(code: str, retryable: bool) -> str:
    return "server" if retryable or code in SERVER_CODES else "user"


def tinker_error(status: int, code: str, message: str, details: dict, headers: dict | None = None) -> JSONResponse:
    body = {
        "error": message,
        "category": category(code, bool(details.get("retryable"))),
        "code": code,
        "details": jsonable_encoder(details),
    }
    return JSONResponse(body, status_code=status, headers=headers)


def future_failure(error: FutureError) -> dict[str, Any]:
    """A failed future as retrieve_future answers it (the client raises RequestFailedError with the message)."""
    return {
        "error": f"{error.code}: {error.message}",
        "category": category(error.code, error.retryable),
        "code": error.code,
        "details": {"retryable": error.retryable, **error.details},
    }


def _from_api_error(exc: APIError) -> JSONResponse:
    headers = None
    if exc.details.get("retryable") and exc.status in (429, 503):
        headers = {"Retry-After": str(exc.details.get("retry_after_seconds", 5))}
    status = 400 if exc.status == 409 else exc.status
    return tinker_error(status, exc.code, exc.message, exc.details, headers)


def _from_validation(exc: RequestValidationError) -> JSONResponse:
    message, errors = validation_summary(exc)
    return tinker_error(400, "validation_error", message, {"retryable": False, "errors": errors})


class TinkerRoute(APIRoute):
    """A route whose refusals (APIError, a body that does not validate) answer in Tinker's error shape; anything
    else goes on to the app's handlers (503 outages, 500 bugs), whose JSON the client also reads."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return _from_api_error(exc)
            except RequestValidationError as exc:
                return _from_validation(exc)

        return run
