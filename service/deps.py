"""FastAPI dependencies shared by the routers: the DB session, the object store, paging, and the NUL check of
every path and query."""

import logging
from collections.abc import Iterator

from fastapi import Query, Request
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from inkwell.service.db import repo
from inkwell.service.errors import APIError, outage_line
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore

log = logging.getLogger("inkwell.service")


def refuse_nul(request: Request) -> None:
    """422 for a NUL in a path segment or query parameter, for every route (the app's dependency).

    Ids and names from the URL are looked up in SQL and PostgreSQL's driver refuses a string with a NUL (a 500);
    no id, name or filter holds one, so it is refused here, before any route, the same on every database.
    """
    where = [("path", k, v) for k, v in request.path_params.items() if isinstance(v, str)]
    where += [("query", k, v) for k, v in request.query_params.multi_items()]
    for part, key, value in where:
        if "\x00" in value:
            message = f"{part}.{key}: must not contain NUL (\\x00) characters"
            errors = [{"loc": [part, key], "msg": "must not contain NUL (\\x00) characters", "type": "value_error"}]
            raise APIError(422, "validation_error", message, errors=errors)


def get_session(request: Request) -> Iterator[Session]:
    """A session for this request: read-only engine for GET/HEAD, write-intent otherwise.

    Closing rolls back what the route left open. When the connection was lost after the route's last statement,
    that rollback fails, yet nothing is at stake: a database that lost the connection has discarded its transaction,
    and the route's answer (a read, a committed write, or its own error) is already made. The failure is logged, not
    raised from the dependency's exit, where it would drop the connection without a response.
    """
    sm = request.app.state.read_sessionmaker if request.method in ("GET", "HEAD") else request.app.state.sessionmaker
    s = sm()
    try:
        yield s
    finally:
        try:
            s.close()
        except OperationalError as exc:
            log.warning("database connection lost while closing a request's session: %s", outage_line(exc))


def get_store(request: Request) -> ObjectStore:
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


class Paging:
    def __init__(
        self,
        limit: int = Query(50, ge=1, le=200, description="items per page"),
        cursor: str | None = Query(None, description="`next_cursor` of the previous page"),
    ) -> None:
        self.limit = limit
        try:
            self.cursor = repo.parse_cursor(cursor)
        except ValueError as exc:
            raise APIError(422, "validation_error", str(exc), field="cursor") from exc
