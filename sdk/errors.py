"""Typed errors of the SDK, mapped from the service's `{"error": {"code", "message", "details"}}` body.

Callers branch on the class (or `.code`); `.retryable` says whether sending the same request
again can succeed, which is also what the transports' bounded retry loop obeys.
"""

from typing import Any


class InkwellError(Exception):
    """Base of every SDK error. `status` is the HTTP status, or None for errors raised client-side.
    `from_service` is True when the body was the service's own error JSON (not a proxy's page)."""

    from_service = False

    def __init__(
        self, message: str, *, status: int | None = None, code: str = "error", details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    @property
    def retryable(self) -> bool:
        return bool(self.details.get("retryable", False))

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"[{where}{self.code}] {self.message}"


class ConfigurationError(InkwellError):
    """The client is missing its URL or API key."""


class APIConnectionError(InkwellError):
    """The service could not be reached (after the bounded retries)."""

    @property
    def retryable(self) -> bool:
        return True


class AuthenticationError(InkwellError):
    """401: missing, malformed, unknown or revoked API key."""


class NotFoundError(InkwellError):
    """404: no such object for this tenant (another tenant's object looks exactly the same)."""


class ConflictError(InkwellError):
    """409: e.g. a version already exists, or a finished job cannot be cancelled."""


class PayloadTooLargeError(InkwellError):
    """413: the upload is over the service's limit (`details["limit_bytes"]`)."""


class ValidationError(InkwellError):
    """422 from the service, or a request the SDK rejected before sending it (status None)."""


class RateLimitError(InkwellError):
    """429: slow down; `retry_after` is the server's hint in seconds, when it gave one."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return True


class ServiceUnavailableError(InkwellError):
    """503: the database or object store is down; `retryable` is the server's word on retrying."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(InkwellError):
    """Any other 5xx: a bug in the service; `details["request_id"]` finds it in the server log."""


class IntegrityError(InkwellError):
    """A downloaded file's sha256 differs from the one the registry recorded; nothing was kept."""


class JobFailedError(InkwellError):
    """`Job.wait()` on a job that failed; `code` and `message` are the job's own error."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed: {message}", code=code, details={"job_id": job_id})
        self.job_id = job_id


class JobCancelledError(InkwellError):
    """`Job.wait()` on a job that was cancelled before it finished."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} was cancelled", code="job_cancelled", details={"job_id": job_id})
        self.job_id = job_id


class JobTimeoutError(InkwellError, TimeoutError):
    """`Job.wait(timeout=...)` ran out of time; the job itself keeps running."""


class SessionClosedError(InkwellError):
    """A training session that has ended (closed, idle too long, its worker lost); the message says why."""


class RequestFailedError(InkwellError):
    """A future settled with an error: `code` and `message` say why; `retryable` whether sending the same
    request again (on a new session, when the session is gone) can work."""


_BY_STATUS: dict[int, type[InkwellError]] = {
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: SessionClosedError,
    413: PayloadTooLargeError,
    422: ValidationError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def _retry_after(headers: dict[str, str], details: dict[str, Any]) -> float | None:
    raw = headers.get("retry-after", details.get("retry_after"))
    try:
        return max(float(raw), 0.0) if raw is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP-date Retry-After: fall back to our own backoff


def error_from_response(status: int, body: Any, headers: dict[str, str], text: str = "") -> InkwellError:
    """The typed error for an HTTP error response; tolerates bodies that are not the service's JSON."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "code" in error:
        code, message = str(error["code"]), str(error.get("message", ""))
        details = error.get("details") if isinstance(error.get("details"), dict) else {}
    else:
        snippet = " ".join(text.split())[:200]
        code, message, details = f"http_{status}", f"HTTP {status}: {snippet or 'no body'}", {}
        details["retryable"] = status in (502, 503, 504)
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else InkwellError)
    kwargs: dict[str, Any] = {"status": status, "code": code, "details": details}
    if cls in (RateLimitError, ServiceUnavailableError):
        kwargs["retry_after"] = _retry_after({k.lower(): v for k, v in headers.items()}, details)
    exc = cls(message, **kwargs)
    exc.from_service = isinstance(error, dict) and "code" in error
    return exc
