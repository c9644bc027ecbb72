"""One service for every Tinker test (SQLite, the session's SeaweedFS, session and serving workers on inkling-tiny),
and a tenant's key in the form the `tinker` client takes (`tml-` + the inkwell key)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from inkwell.service.tinker.auth import tinker_key
from tests.service.helpers import Service, make_settings, start_service


@pytest.fixture(scope="session")
def service(seaweed, tmp_path_factory) -> Iterator[Service]:
    with pytest.MonkeyPatch.context() as patch:  # sessions read their settings as the service starts
        patch.setenv("INKWELL_SESSION_REAP_INTERVAL", "0.5")  # the reapers' pass: 5 s by default
        svc = start_service(make_settings(tmp_path_factory.mktemp("svc-tinker"), None, seaweed))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def tenant(service) -> tuple[str, str]:
    """(tenant id, Tinker API key)."""
    tenant_id, key = service.new_tenant("tinker")
    return tenant_id, tinker_key(key)


@pytest.fixture(scope="session")
def base_dir(service) -> Path:
    return service.settings.data_dir / "models" / "inkling-tiny"
