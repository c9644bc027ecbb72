"""`alembic upgrade head` on an empty database creates exactly the tables of the models."""

import secrets

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from inkwell.service.db.migrate import upgrade_database
from inkwell.service.db.models import Base


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        diff = compare_metadata(ctx, Base.metadata)
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    return diff


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_upgrade_head_equals_models(backend, tmp_path, request):
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        base = request.getfixturevalue("pg_database")
        # A second throwaway database: the session one may already hold the service's tables.
        import psycopg2

        from inkwell.tests.service.conftest import _pg_connect

        conn, user = _pg_connect()
        conn.autocommit = True
        name = f"inkwell_mig_{secrets.token_hex(5)}"
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        url = base.rsplit("/", 1)[0] + f"/{name}"
        request.addfinalizer(lambda: _drop(conn, name, psycopg2))
    upgrade_database(url)
    assert _diff(url) == []
    upgrade_database(url)  # idempotent: already at head
    assert _diff(url) == []


def _drop(conn, name: str, psycopg2) -> None:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()
