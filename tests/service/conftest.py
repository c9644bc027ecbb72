"""Real parts for the service tests: one SeaweedFS per session, a throwaway PostgreSQL database
per session, and the API served by uvicorn on a loopback port (in a thread)."""

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg2
import pytest
import uvicorn

from inkwell.service.app import create_app
from inkwell.service.db import repo
from inkwell.service.db.session import make_engine, make_sessionmaker
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore
from inkwell.service.storage.seaweed import EmbeddedSeaweed

PG_DSN = "host=127.0.0.1 port=5432 dbname=test"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[EmbeddedSeaweed]:
    weed = EmbeddedSeaweed(tmp_path_factory.mktemp("seaweed"))
    weed.start()
    yield weed
    weed.stop()


def _pg_connect(dbname: str = "test"):
    last = None
    for user in ("postgres", "root"):
        try:
            return psycopg2.connect(host="127.0.0.1", port=5432, dbname=dbname, user=user, connect_timeout=3), user
        except psycopg2.OperationalError as exc:
            last = exc
    raise last


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    try:
        conn, user = _pg_connect()
    except psycopg2.OperationalError as exc:
        pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required by the service tests: {exc}")
    conn.autocommit = True
    name = f"inkwell_test_{secrets.token_hex(6)}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg2://{user}@127.0.0.1:5432/{name}"
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A running API: its URL, settings, and direct DB/S3 handles for setup and assertions."""

    url: str
    settings: Settings
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def sm(self):
        return self.app.state.sessionmaker

    @property
    def store(self) -> ObjectStore:
        return self.app.state.store

    def new_tenant(self, prefix: str = "t") -> tuple[str, str]:
        """(tenant_id, api key) of a fresh tenant."""
        with self.sm() as s:
            tenant = repo.create_tenant(s, f"{prefix}-{secrets.token_hex(4)}")
            _, key = repo.create_api_key(s, tenant.id)
            s.commit()
            return tenant.id, key

    def client(self, key: str | None, timeout: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def env(self) -> dict[str, str]:
        """Environment for a worker subprocess that talks to the same DB and S3."""
        env = dict(os.environ)
        env.update(
            INKWELL_DATA_DIR=str(self.settings.data_dir),
            INKWELL_DATABASE_URL=self.settings.resolved_database_url,
            INKWELL_S3_ENDPOINT=self.app.state.s3_endpoint,
            INKWELL_BUCKET=self.settings.bucket,
            INKWELL_LEASE_SECONDS=str(self.settings.lease_seconds),
            INKWELL_WORKER_POLL_SECONDS="0.2",
            OMP_NUM_THREADS="1",
        )
        return env

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start_service(settings: Settings) -> Service:
    app = create_app(settings)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the service did not start; see the log above")
        time.sleep(0.05)
    return Service(f"http://127.0.0.1:{port}", settings, app, server, thread)


def make_settings(data_dir: Path, database_url: str | None, endpoint: str, **overrides) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=database_url,
        s3_endpoint=endpoint,
        bucket=f"b{secrets.token_hex(6)}",
        lease_seconds=overrides.pop("lease_seconds", 4.0),
        **overrides,
    )


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def service(request, tmp_path_factory, seaweed) -> Iterator[Service]:
    """The API on SQLite and on PostgreSQL (tests using it run once per backend)."""
    data_dir = tmp_path_factory.mktemp(f"svc-{request.param}")
    url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    svc = start_service(make_settings(data_dir, url, seaweed.endpoint, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def sqlite_service(tmp_path_factory, seaweed) -> Iterator[Service]:
    """The API on SQLite only, for tests that do not depend on the database backend."""
    data_dir = tmp_path_factory.mktemp("svc-sqlite-only")
    svc = start_service(make_settings(data_dir, None, seaweed.endpoint, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture
def tenant(service) -> tuple[str, httpx.Client]:
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        yield tenant_id, client


def engine_for(url: str):
    return make_sessionmaker(make_engine(url))
