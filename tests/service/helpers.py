"""Helpers shared by the service tests: a running API in a thread, `inkwell serve` in a subprocess,
PostgreSQL access, request shortcuts and adapter directories made with inkwell.adapters."""

import json
import os
import secrets
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg2
import uvicorn
from sqlalchemy import make_url

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.io import save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import BaseModelIdentity, load_base_config
from inkwell.service.app import create_app
from inkwell.service.db import repo
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore
from inkwell.service.storage.seaweed import EmbeddedSeaweed


def pg_connect(dbname: str = "test"):
    last = None
    for user in ("postgres", "root"):
        try:
            return psycopg2.connect(host="127.0.0.1", port=5432, dbname=dbname, user=user, connect_timeout=3), user
        except psycopg2.OperationalError as exc:
            last = exc
    raise last


@contextmanager
def sqlite_write_lock(settings: Settings) -> Iterator[None]:
    """Hold the write lock of the service's SQLite database from another connection, as a job worker's or a
    training session's write would, until the block ends."""
    writer = sqlite3.connect(make_url(settings.resolved_database_url).database, timeout=1, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        writer.execute("ROLLBACK")
        writer.close()


@contextmanager
def own_pg_database(prefix: str) -> Iterator[tuple[psycopg2.extensions.connection, str, str]]:
    """A new, empty PostgreSQL database named `prefix_<random>`: an admin connection (autocommit), its name and
    its URL. Dropped after WITH (FORCE), which ends its sessions and waits for them: a backend only signalled to
    end could still hold the database and fail the DROP."""
    conn, user = pg_connect()
    conn.autocommit = True
    name = f"{prefix}_{secrets.token_hex(5)}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield conn, name, f"postgresql+psycopg2://{user}@127.0.0.1:5432/{name}"
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@contextmanager
def scratch_pg_database(prefix: str) -> Iterator[str]:
    """The URL of an `own_pg_database`."""
    with own_pg_database(prefix) as (_, _, url):
        yield url


def pg_allow_connections(conn: psycopg2.extensions.connection, name: str, allow: bool) -> None:
    """Let database `name` take connections again, or refuse them and end its open sessions, waiting (up to 5 s
    each) until they are gone: a backend only signalled could still answer the next statement, then die."""
    with conn.cursor() as cur:
        cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allow else "false"}')
        if not allow:
            cur.execute("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = %s", (name,))


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
            INKWELL_S3_ACCESS_KEY=self.settings.s3_access_key,
            INKWELL_S3_SECRET_KEY=self.settings.s3_secret_key,
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


INKWELL = [sys.executable, "-m", "inkwell.cli"]


def serve_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of an embedded `inkwell serve` (its own SQLite and SeaweedFS) on `data_dir`."""
    env = {**os.environ, "INKWELL_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1", **extra}
    env.pop("INKWELL_S3_ENDPOINT", None)
    env.pop("INKWELL_DATABASE_URL", None)
    return env


def start_serve(env: dict[str, str], port: int, log: Path, workers: int) -> subprocess.Popen:
    """`inkwell serve` in a session of its own, so that a test can end it and all it started as one group."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*INKWELL, "serve", "--port", str(port), "--workers", str(workers)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_healthy(
    proc: subprocess.Popen,
    port: int,
    log: Path,
    until: Callable[[dict], bool] = lambda health: True,
    timeout: float = 180.0,
) -> dict:
    """The first 200 /healthz body of the serve `proc` that satisfies `until`; fails with its log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"inkwell serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            if resp.status_code == 200 and until(resp.json()):
                return resp.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"inkwell serve was not healthy within {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def make_settings(data_dir: Path, database_url: str | None, weed: EmbeddedSeaweed, **overrides) -> Settings:
    """Settings of a service on `weed` (its endpoint and keys) with a bucket of its own."""
    return Settings(
        data_dir=data_dir,
        database_url=database_url,
        s3_endpoint=weed.endpoint,
        s3_access_key=weed.access_key,
        s3_secret_key=weed.secret_key,
        bucket=f"b{secrets.token_hex(6)}",
        lease_seconds=overrides.pop("lease_seconds", 4.0),
        **overrides,
    )


CHAT = [
    {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}!"}]} for i in range(5)
]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client, data: bytes, name: str = "train.jsonl"):
    return client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")})


def assert_error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert body["error"]["message"]
    return body["error"]


SPEC = LoraSpec(rank=2, alpha=4, targets=("attn", "experts"))


def tiny_base(service):
    with service.sm() as s:
        row = repo.get_base_model(s, "inkling-tiny")
    return Path(row.path), BaseModelIdentity("inkling-tiny", row.config_sha256)


def make_adapter_dir(service, out: Path, layout: str, seed: int = 0, manifest: bool = True, base=None) -> Path:
    path, identity = tiny_base(service)
    config = load_base_config(path)
    adapter = init_adapter(config, SPEC, base or identity, seed=seed, b_std=0.01)
    directory = save_adapter(adapter, out, layout, config)
    if not manifest:
        (directory / "manifest.json").unlink()
    return directory


def import_dir(client, directory: Path, name: str, layout: str, version: int | None = None):
    files = [("files", (p.name, p.read_bytes())) for p in sorted(directory.iterdir())]
    data = {"name": name, "base_model": "inkling-tiny", "layout": layout}
    if version is not None:
        data["version"] = str(version)
    return client.post("/v1/adapters/import", data=data, files=files)
