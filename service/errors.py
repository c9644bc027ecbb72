"""Every error leaves the API as {"error": {"code", "message", "details"}} with the right status.

Bad input is a 4xx naming the field and the fix; an unreachable S3 or database is a 503 with
`retryable: true`; bytes that fail their checksum, and an object the database records but the store no longer
holds, are a 502 `integrity_error` with `retryable: false` (sending the same request again does not bring them
back); anything else is a 500 carrying a request id
to find it in the log.
"""

import logging
import secrets

from botocore.exceptions import ChecksumError, ClientError, FlexibleChecksumError
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inkwell.service.storage import ObjectCorrupt, ObjectMissing, StorageUnavailable
from inkwell.validation import place, reason

log = logging.getLogger("inkwell.service")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 413: "payload_too_large"}
# S3 error codes for a body that did not match the checksum sent with it.
_S3_INTEGRITY_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"})
# What psycopg2 raises (a ValueError, before the query is sent) for a string holding a NUL.
_PG_NUL_MESSAGE = "cannot contain NUL (0x00) characters"


class APIError(Exception):
    """An error the API reports to the client as is."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False, **details) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = {"retryable": retryable, **details}


def outage_line(exc: Exception) -> str:
    """An outage's exception (the database's, the object store's) as one log line: the driver's own error and its
    first line (psycopg2 adds hints and SQLAlchemy a link on lines of their own: four lines a warning, and a job
    worker warns at every retry)."""
    cause = getattr(exc, "orig", None) or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


def not_found(kind: str, ident: str) -> APIError:
    return APIError(404, "not_found", f"{kind} {ident!r} not found")


def error_response(status: int, code: str, message: str, details: dict, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": jsonable_encoder(details)}}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_summary(exc: RequestValidationError) -> tuple[str, list[dict]]:
    """The message naming the first thing wrong, and every error as {loc, msg, type}: one wording for `/v1` and
    Tinker's routes. A body that is not JSON is said as such, with the parser's reason and where it stopped
    (FastAPI reports it at loc ["body", <character>] as "JSON decode error")."""
    errors = []
    for err in exc.errors():
        loc, msg, kind = list(err.get("loc", ())), reason(err), err.get("type", "")
        if kind == "json_invalid" and len(loc) == 2:
            parser_said = (err.get("ctx") or {}).get("error", "unreadable")
            loc, msg = ["body"], f"not valid JSON ({parser_said} at character {loc[1]}); send a JSON object"
        errors.append({"loc": loc, "msg": msg, "type": kind})
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = place(first)
    return (f"{where}: {first['msg']}" if where else first["msg"]), errors


def _integrity_failure(exc: BaseException | None) -> BaseException | None:
    """The checksum mismatch behind `exc` (S3 refusing a body, botocore refusing a response), if there is one.

    `StorageUnavailable` wraps every botocore error, a failed checksum among them, and a mismatch must not be
    reported as an outage that a retry gets past.
    """
    for _ in range(8):  # exc, its cause, the cause's cause...
        if exc is None:
            return None
        if isinstance(exc, ChecksumError | FlexibleChecksumError):
            return exc
        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _S3_INTEGRITY_CODES:
            return exc
        exc = exc.__cause__
    return None


def _integrity_response(cause: BaseException) -> JSONResponse:
    """The one 502 `integrity_error`: a stored object damaged or lost at rest, or bytes that failed their checksum
    on the way to or from the object store. Not retryable: the same request fails the same way."""
    log.error("integrity failure: %s", cause)
    if isinstance(cause, ObjectMissing):
        message = "a stored object that the database records is missing from the object store; retrying will not help"
    elif isinstance(cause, ObjectCorrupt):
        message = "a stored object does not match its recorded sha256: it is damaged, and retrying will not help"
    else:
        message = (
            "bytes exchanged with the object store failed their checksum (the request's data or a stored object "
            "is corrupt); nothing was published"
        )
    return error_response(502, "integrity_error", message, {"retryable": False})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.details.get("retryable") and exc.status in (429, 503):
            headers = {"Retry-After": str(exc.details.get("retry_after_seconds", 5))}
        return error_response(exc.status, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, errors = validation_summary(exc)
        return error_response(422, "validation_error", message, {"retryable": False, "errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's "error parsing the body" for JSON nested deeper than json.loads goes: say what it was.
            reason = "JSON nested too deeply to read"
            errors = [{"loc": ["body"], "msg": reason, "type": "json_invalid"}]
            return error_response(422, "validation_error", f"body: {reason}", {"retryable": False, "errors": errors})
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs"
            if b"%2f" in request.scope.get("raw_path", b"").lower():  # routed as decoded: a '/' splits the segment
                message += " (a path segment holds an encoded '/', %2F: no id, name, alias or version contains one)"
        return error_response(exc.status_code, code, message, {"retryable": False}, getattr(exc, "headers", None))

    @app.exception_handler(StorageUnavailable)
    async def _storage(request: Request, exc: StorageUnavailable) -> JSONResponse:
        if cause := _integrity_failure(exc):
            return _integrity_response(cause)
        log.warning("storage unavailable: %s", outage_line(exc))
        return error_response(
            503,
            "storage_unavailable",
            "the object store cannot be reached; nothing was published; retry shortly",
            {"retryable": True},
            {"Retry-After": "5"},
        )

    @app.exception_handler(ObjectCorrupt)
    async def _corrupt(request: Request, exc: ObjectCorrupt) -> JSONResponse:
        return _integrity_response(exc)

    @app.exception_handler(ObjectMissing)
    async def _missing(request: Request, exc: ObjectMissing) -> JSONResponse:
        # A route reads only objects its rows record (a missing row is the route's 404): one that is gone was lost.
        return _integrity_response(exc)

    @app.exception_handler(OperationalError)
    async def _database(request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", outage_line(exc))
        return error_response(
            503, "database_unavailable", "the database cannot be reached; retry shortly", {"retryable": True}
        )

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        if _PG_NUL_MESSAGE in str(exc):
            # A NUL in a body or form field no schema checks: the URL's are refused before any route
            # (`deps.refuse_nul`), this catches the rest on PostgreSQL.
            reason = "a text field must not contain NUL (\\x00) characters"
            return error_response(422, "validation_error", reason, {"retryable": False, "errors": []})
        raise exc  # any other ValueError is a bug: on to the 500 below, logged and re-raised as before

    @app.exception_handler(ClientError)
    async def _s3_refused(request: Request, exc: ClientError) -> JSONResponse:
        if cause := _integrity_failure(exc):  # S3 refused a body whose checksum did not match (400 BadDigest)
            return _integrity_response(cause)
        raise exc  # any other refusal by S3 is a bug of ours: on to the 500 below, as before

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        request_id = secrets.token_hex(8)
        log.exception("internal error %s on %s %s", request_id, request.method, request.url.path)
        return error_response(
            500, "internal_error", "internal server error", {"retryable": False, "request_id": request_id}
        )
