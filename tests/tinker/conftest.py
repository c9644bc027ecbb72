"""One service for every Tinker test (the session's SQLite service of tests/conftest.py, on SeaweedFS, with its
session and serving workers on inkling-tiny), and a tenant's key in the form the `tinker` client takes (`tml-` +
the inkwell key)."""

from pathlib import Path

import pytest

from inkwell.service.tinker.auth import tinker_key
from tests.service.helpers import Service


@pytest.fixture(scope="session")
def service(sqlite_service) -> Service:
    return sqlite_service


@pytest.fixture(scope="session")
def tenant(service) -> tuple[str, str]:
    """(tenant id, Tinker API key)."""
    tenant_id, key = service.new_tenant("tinker")
    return tenant_id, tinker_key(key)


@pytest.fixture(scope="session")
def base_dir(service) -> Path:
    return service.settings.data_dir / "models" / "inkling-tiny"
