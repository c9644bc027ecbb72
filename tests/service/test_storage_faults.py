"""SeaweedFS stopped during an upload: the API answers 503 `storage_unavailable` (retryable),
nothing is half-published, and after a restart the cleanup pass and a retry finish the job."""

from pathlib import Path

import pytest

from inkwell.service.registry import cleanup_orphans, version_prefix
from inkwell.service.storage.seaweed import EmbeddedSeaweed
from tests.service.helpers import (
    CHAT,
    assert_error,
    import_dir,
    jsonl,
    make_adapter_dir,
    make_settings,
    start_service,
    upload,
)


@pytest.fixture
def fragile(tmp_path):
    weed = EmbeddedSeaweed(tmp_path / "weed")
    weed.start()
    svc = start_service(make_settings(tmp_path / "svc", None, weed))
    yield weed, svc
    svc.stop()
    weed.stop(grace=0)  # a throwaway store: no graceful shutdown (2 s of weed's own) to wait for


def test_seaweed_stopped_mid_upload_is_503_and_nothing_half_published(fragile, tmp_path, monkeypatch):
    weed, svc = fragile
    tenant_id, key = svc.new_tenant()
    with svc.client(key) as client:
        v1 = import_dir(client, make_adapter_dir(svc, tmp_path / "v1", "sglang", seed=1), "fragile", "sglang")
        assert v1.status_code == 201
        source = make_adapter_dir(svc, tmp_path / "v2", "sglang", seed=2)

        store = svc.store
        real_put_file = store.put_file
        calls = []

        def put_file_then_storage_dies(key: str, path: Path, create_only: bool = True):
            calls.append(key)
            if len(calls) == 2:
                weed.stop(grace=0.5)  # the object store goes away in the middle of the publish
            return real_put_file(key, path, create_only)

        monkeypatch.setattr(store, "put_file", put_file_then_storage_dies)
        resp = import_dir(client, source, "fragile", "sglang")
        err = assert_error(resp, 503, "storage_unavailable")
        assert err["details"]["retryable"] is True and resp.headers["retry-after"]
        assert len(calls) == 2
        # While S3 is down: uploads fail the same way, reads of metadata still work, health says degraded.
        assert_error(upload(client, jsonl(CHAT)), 503, "storage_unavailable")
        assert client.get("/v1/datasets").json()["data"] == []
        health = client.get("/healthz")
        assert health.status_code == 503 and health.json()["storage"] == "unavailable"
        versions = client.get("/v1/adapters/fragile/versions").json()["data"]
        assert [v["version"] for v in versions] == [1]
        assert_error(client.get("/v1/adapters/fragile/versions/2"), 404, "not_found")
        file_path = client.get("/v1/adapters/fragile/versions/1/download").json()["files"][0]["download_path"]
        assert_error(client.get(file_path), 503, "storage_unavailable")

        monkeypatch.setattr(store, "put_file", real_put_file)
        weed.start()
        leftovers = store.list_objects(version_prefix(tenant_id, "fragile", 2))
        assert 1 <= len(leftovers) < 7  # the marker and what got through, never a visible version
        assert cleanup_orphans(svc.sm, store, grace_seconds=0) == len(leftovers)
        retry = import_dir(client, source, "fragile", "sglang")
        assert retry.status_code == 201, retry.text
        assert retry.json()["version"] == 2
        assert client.get("/healthz").json()["status"] == "ok"
        for f in client.get("/v1/adapters/fragile/versions/2/download").json()["files"]:
            assert f["size"] == len(client.get(f["download_path"]).content)
