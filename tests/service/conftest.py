"""Real parts for the service tests: one SeaweedFS per session, a throwaway PostgreSQL database
per session, and the API served by uvicorn on a loopback port (in a thread)."""

import contextlib
from collections.abc import Iterator

import httpx
import psycopg2
import pytest

from inkwell.service.storage.seaweed import EmbeddedSeaweed
from tests.service.helpers import Service, make_settings, scratch_pg_database, start_service


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[EmbeddedSeaweed]:
    weed = EmbeddedSeaweed(tmp_path_factory.mktemp("seaweed"))
    weed.start()
    yield weed
    weed.stop()


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(scratch_pg_database("inkwell_test"))
        except psycopg2.OperationalError as exc:
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required by the service tests: {exc}")
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def service(request, tmp_path_factory, seaweed) -> Iterator[Service]:
    """The API on SQLite and on PostgreSQL (tests using it run once per backend)."""
    data_dir = tmp_path_factory.mktemp(f"svc-{request.param}")
    url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    svc = start_service(make_settings(data_dir, url, seaweed, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def sqlite_service(tmp_path_factory, seaweed) -> Iterator[Service]:
    """The API on SQLite only, for tests that do not depend on the database backend."""
    data_dir = tmp_path_factory.mktemp("svc-sqlite-only")
    svc = start_service(make_settings(data_dir, None, seaweed, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture
def tenant(service) -> tuple[str, httpx.Client]:
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        yield tenant_id, client
