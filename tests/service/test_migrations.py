"""`alembic upgrade head` on an empty database creates exactly the tables of the models."""

from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, inspect

from inkwell.service.db.migrate import upgrade_database
from inkwell.service.db.models import Base
from tests.service.helpers import scratch_pg_database


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        diff = compare_metadata(ctx, Base.metadata)
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    return diff


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request, tmp_path) -> Iterator[str]:
    """An empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        with scratch_pg_database("inkwell_mig") as url:
            yield url


def test_upgrade_head_equals_models(fresh_url):
    url = fresh_url
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
