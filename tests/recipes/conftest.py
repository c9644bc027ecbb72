"""The recipes run against the real service: the service tests' own fixtures (SeaweedFS, uvicorn on a loopback
port, SQLite), imported rather than duplicated."""

from tests.service.conftest import seaweed, sqlite_service  # noqa: F401  (fixtures)
