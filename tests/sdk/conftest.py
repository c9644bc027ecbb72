"""The SDK runs against the real service: the service tests' own fixtures (SeaweedFS, uvicorn on a
loopback port, SQLite) are imported here rather than duplicated."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from inkwell import sdk
from tests.service.conftest import (  # noqa: F401  (seaweed, sqlite_service: fixtures)
    Service,
    make_settings,
    seaweed,
    sqlite_service,
    start_service,
)


@pytest.fixture
def api(sqlite_service) -> Iterator[tuple[sdk.Client, str]]:  # noqa: F811
    """A Client for a fresh tenant, and that tenant's key."""
    _, key = sqlite_service.new_tenant("sdk")
    with sdk.Client(sqlite_service.url, key) as client:
        yield client, key


@pytest.fixture(scope="session")
def adapter_dir(sqlite_service, tmp_path_factory) -> Path:  # noqa: F811
    """A small real adapter (sglang layout) for the service's own inkling-tiny."""
    from inkwell.adapters.adapter import init_adapter
    from inkwell.adapters.io import save_adapter
    from inkwell.models import base_model_identity, load_base_config

    base = sqlite_service.settings.data_dir / "models" / "inkling-tiny"
    config = load_base_config(base)
    adapter = init_adapter(
        config, sdk.LoraSpec(rank=2, alpha=4, targets=("attn",)), base_model_identity(base), b_std=0.01
    )
    return save_adapter(adapter, tmp_path_factory.mktemp("adapter") / "sglang", "sglang", config)


@pytest.fixture(scope="package")
def training_service(seaweed, tmp_path_factory) -> Iterator[Service]:  # noqa: F811
    """A service of its own with one real job worker process, so the worker sees only the SDK tests' jobs (SFT's
    and GRPO's share it: one worker start)."""
    from tests.service.test_jobs_e2e import start_worker, stop_worker

    data_dir = tmp_path_factory.mktemp("svc-training")
    svc = start_service(make_settings(data_dir, None, seaweed))
    worker = start_worker(svc, data_dir / "worker.log")
    yield svc
    stop_worker(worker)
    svc.stop()
