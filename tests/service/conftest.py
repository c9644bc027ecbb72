"""Real parts for the service tests: the API served by uvicorn on a loopback port (in a thread), on SQLite and on
PostgreSQL. SeaweedFS, the PostgreSQL database and the SQLite-only service are the session's (tests/conftest.py)."""

from collections.abc import Iterator

import httpx
import pytest

from tests.service.helpers import Service, make_settings, start_service


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def service(request, tmp_path_factory, seaweed) -> Iterator[Service]:
    """The API on SQLite and on PostgreSQL (tests using it run once per backend)."""
    data_dir = tmp_path_factory.mktemp(f"svc-{request.param}")
    url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    svc = start_service(make_settings(data_dir, url, seaweed, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture
def tenant(service) -> tuple[str, httpx.Client]:
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        yield tenant_id, client
