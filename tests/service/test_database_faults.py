"""PostgreSQL refusing connections: the API answers 503 `database_unavailable` (retryable) and
recovers by itself once the database is back."""

import secrets

import pytest

from tests.service.helpers import assert_error, make_settings, pg_connect, start_service


@pytest.fixture
def own_database():
    conn, user = pg_connect()
    conn.autocommit = True
    name = f"inkwell_dbfault_{secrets.token_hex(5)}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    yield conn, name, f"postgresql+psycopg2://{user}@127.0.0.1:5432/{name}"
    with conn.cursor() as cur:
        cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()


def _refuse_connections(conn, name: str, refuse: bool) -> None:
    with conn.cursor() as cur:
        cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"false" if refuse else "true"}')
        if refuse:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_database_down_is_503_retryable_then_recovers(own_database, seaweed, tmp_path):
    conn, name, url = own_database
    svc = start_service(make_settings(tmp_path, url, seaweed))
    try:
        _, key = svc.new_tenant()
        with svc.client(key) as client:
            assert client.get("/v1/models").status_code == 200
            _refuse_connections(conn, name, True)
            err = assert_error(client.get("/v1/models"), 503, "database_unavailable")
            assert err["details"]["retryable"] is True
            job = {"base_model": "inkling-tiny", "dataset_id": "ds_0", "adapter_name": "a"}
            assert_error(client.post("/v1/jobs", json=job), 503, "database_unavailable")
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["database"] == "unavailable"
            _refuse_connections(conn, name, False)
            assert client.get("/v1/models").status_code == 200
            assert client.get("/healthz").json()["status"] == "ok"
    finally:
        svc.stop()
