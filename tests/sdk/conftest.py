"""The SDK runs against the real service: the session's SeaweedFS, SQLite service and job-worker service
(tests/conftest.py), shared with the other areas rather than started again."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from inkwell import sdk


@pytest.fixture
def api(sqlite_service) -> Iterator[tuple[sdk.Client, str]]:
    """A Client for a fresh tenant, and that tenant's key."""
    _, key = sqlite_service.new_tenant("sdk")
    with sdk.Client(sqlite_service.url, key) as client:
        yield client, key


@pytest.fixture(scope="session")
def adapter_dir(sqlite_service, tmp_path_factory) -> Path:
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
