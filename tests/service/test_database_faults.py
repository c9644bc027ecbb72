"""PostgreSQL refusing connections: the API answers 503 `database_unavailable` (retryable) and
recovers by itself once the database is back."""

import logging

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from inkwell.service.deps import get_session
from tests.service.helpers import assert_error, make_settings, own_pg_database, pg_allow_connections, start_service


@pytest.fixture
def own_database():
    with own_pg_database("inkwell_dbfault") as database:
        yield database


def test_database_down_is_503_retryable_then_recovers(own_database, seaweed, tmp_path):
    conn, name, url = own_database
    svc = start_service(make_settings(tmp_path, url, seaweed))
    try:
        _, key = svc.new_tenant()
        with svc.client(key) as client:
            assert client.get("/v1/models").status_code == 200
            pg_allow_connections(conn, name, False)
            err = assert_error(client.get("/v1/models"), 503, "database_unavailable")
            assert err["details"]["retryable"] is True
            job = {"base_model": "inkling-tiny", "dataset_id": "ds_0", "adapter_name": "a"}
            assert_error(client.post("/v1/jobs", json=job), 503, "database_unavailable")
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["database"] == "unavailable"
            pg_allow_connections(conn, name, True)
            assert client.get("/v1/models").status_code == 200
            assert client.get("/healthz").json()["status"] == "ok"
    finally:
        svc.stop()


def test_a_connection_lost_after_the_routes_last_statement_keeps_its_answer(own_database, caplog):
    """The route reads, then its connection dies before the request's session closes: the read's answer goes out
    (the failed rollback is logged, not raised from the dependency's exit), and the dead connection is not handed to
    the next request."""
    conn, _, url = own_database
    engine = create_engine(url, pool_pre_ping=True)
    app = FastAPI()
    app.state.read_sessionmaker = sessionmaker(engine)

    @app.get("/backend")
    def backend(s: Session = Depends(get_session)) -> dict:
        pid = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with conn.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        return {"pid": pid}

    try:
        with TestClient(app) as client, caplog.at_level(logging.WARNING, "inkwell.service"):
            first = client.get("/backend")
            assert first.status_code == 200
            assert "lost while closing" in caplog.text
            second = client.get("/backend")
            assert second.status_code == 200 and second.json()["pid"] != first.json()["pid"]
    finally:
        engine.dispose()
