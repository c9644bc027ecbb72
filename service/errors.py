"""Every error leaves the API as {"error": {"code", "message", "details"}} with the right status.

Bad input is a 4xx naming the field and the fix; an unreachable S3 or database is a 503 with
`retryable: true`; anything else is a 500 carrying a request id to find it in the log.
"""

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inkwell.service.storage import StorageUnavailable

log = logging.getLogger("inkwell.service")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 413: "payload_too_large"}


class APIError(Exception):
    """An error the API reports to the client as is."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False, **details) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = {"retryable": retryable, **details}


def not_found(kind: str, ident: str) -> APIError:
    return APIError(404, "not_found", f"{kind} {ident!r} not found")


def error_response(status: int, code: str, message: str, details: dict, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": jsonable_encoder(details)}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_errors(exc: RequestValidationError) -> list[dict]:
    out = []
    for err in exc.errors():
        out.append({"loc": list(err.get("loc", ())), "msg": str(err.get("msg", "")), "type": err.get("type", "")})
    return out


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.details.get("retryable") and exc.status == 503:
            headers = {"Retry-After": "5"}
        return error_response(exc.status, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _validation_errors(exc)
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return error_response(422, "validation_error", message, {"retryable": False, "errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs"
        return error_response(exc.status_code, code, message, {"retryable": False}, getattr(exc, "headers", None))

    @app.exception_handler(StorageUnavailable)
    async def _storage(request: Request, exc: StorageUnavailable) -> JSONResponse:
        log.warning("storage unavailable: %s", exc)
        return error_response(
            503,
            "storage_unavailable",
            "the object store cannot be reached; nothing was published; retry shortly",
            {"retryable": True},
            {"Retry-After": "5"},
        )

    @app.exception_handler(OperationalError)
    async def _database(request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        return error_response(
            503, "database_unavailable", "the database cannot be reached; retry shortly", {"retryable": True}
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        request_id = secrets.token_hex(8)
        log.exception("internal error %s on %s %s", request_id, request.method, request.url.path)
        return error_response(
            500, "internal_error", "internal server error", {"retryable": False, "request_id": request_id}
        )
