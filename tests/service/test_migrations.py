"""`alembic upgrade head` on an empty database creates exactly the tables of the models."""

import secrets

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, inspect

from inkwell.service.db.migrate import upgrade_database
from inkwell.service.db.models import Base
from tests.service.helpers import pg_connect


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
        admin, user = pg_connect()
        admin.autocommit = True
        name = f"inkwell_mig_{secrets.token_hex(5)}"
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        url = f"postgresql+psycopg2://{user}@127.0.0.1:5432/{name}"
        request.addfinalizer(lambda: _drop(admin, name))
    upgrade_database(url)
    assert _diff(url) == []
    upgrade_database(url)  # idempotent: already at head
    assert _diff(url) == []
    # The comparison itself sees drift: a model with one more column and table differs.
    probe = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(probe)
    probe.tables["jobs"].append_column(Column("surprise", Integer))
    Table("extra", probe, Column("id", Integer, primary_key=True))
    engine = create_engine(url)
    with engine.connect() as probe_conn:
        drift = compare_metadata(MigrationContext.configure(probe_conn, opts={"compare_type": True}), probe)
    engine.dispose()
    assert {d[0] for d in drift} == {"add_table", "add_column"}


def _drop(conn, name: str) -> None:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()
