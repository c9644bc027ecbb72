"""Registry findings of an outside-in drill: corrupt objects are never served as a good 200, imports
refuse mismatched or ambiguous uploads without leaking server paths or leaving objects behind, and
integers past BIGINT in paths, bodies and refs are 4xx, not 500."""

import hashlib
import json

import httpx
import pytest

from inkwell.service import registry
from inkwell.service.db import repo
from inkwell.service.errors import APIError
from inkwell.service.registry import Publication, publish, version_prefix
from inkwell.service.routers import adapters as adapters_router
from tests.service.helpers import assert_error, import_dir, make_adapter_dir, sqlite_write_lock

BIG = 2**63  # one past the largest BIGINT
MAX = 2**63 - 1


def _flip_one_byte(service, key: str) -> bytes:
    """Bit rot in S3: the same key and size, one byte different."""
    data = bytearray(service.store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    service.store.put_bytes(key, bytes(data), create_only=False)
    return bytes(data)


# ---- 2. a corrupt object is not a 200 ------------------------------------------------------------


def _served_then_rotted(service, tmp_path, name: str, layout: str) -> tuple[str, str, bytes]:
    """An imported adapter whose weights file is served intact once, then rots in S3: the tenant's key, the
    file's route and the rotted bytes."""
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        assert import_dir(client, make_adapter_dir(service, tmp_path / "a", layout), name, layout).status_code == 201
        path = f"/v1/adapters/{name}/versions/1/files/{layout}/adapter_model.safetensors"
        good = client.get(path)
        assert good.status_code == 200 and hashlib.sha256(good.content).hexdigest() == good.headers["x-inkwell-sha256"]
    corrupt = _flip_one_byte(service, f"{version_prefix(tenant_id, name, 1)}{layout}/adapter_model.safetensors")
    return key, path, corrupt


def test_corrupt_object_is_a_502_integrity_error_not_a_200(sqlite_service, tmp_path):
    service = sqlite_service
    key, path, corrupt = _served_then_rotted(service, tmp_path, "rot", "sglang")
    with service.client(key) as client:
        resp = client.get(path)
        err = assert_error(resp, 502, "integrity_error")
        assert err["details"]["retryable"] is False and resp.content != corrupt
        # Another file of the version is still served.
        assert client.get("/v1/adapters/rot/versions/1/files/sglang/adapter_config.json").status_code == 200


def test_large_corrupt_object_stream_is_cut_short(sqlite_service, tmp_path, monkeypatch):
    """Above the in-memory bound the file streams, and its last chunk is held back until the hash matched."""
    service = sqlite_service
    monkeypatch.setattr(adapters_router, "VERIFY_IN_MEMORY_BYTES", 0, raising=False)
    key, path, corrupt = _served_then_rotted(service, tmp_path, "big-rot", "peft")
    with service.client(key) as client:
        try:
            resp = client.get(path)
        except httpx.HTTPError:
            return  # the connection was cut before the body was complete
        assert resp.status_code != 200 and resp.content != corrupt, resp.status_code


@pytest.mark.parametrize("streamed", [False, True])
def test_object_missing_from_storage_is_a_502_integrity_error(sqlite_service, tmp_path, monkeypatch, streamed):
    """A version's file gone from S3 behind the registry's back is lost at rest, as a rotted one is damaged: a 502
    integrity_error that is not retryable, not a 500, whether the file is read whole or would stream."""
    service = sqlite_service
    if streamed:
        monkeypatch.setattr(adapters_router, "VERIFY_IN_MEMORY_BYTES", 0, raising=False)
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        assert (
            import_dir(client, make_adapter_dir(service, tmp_path / "a", "sglang"), "lost", "sglang").status_code == 201
        )
        service.store.delete([f"{version_prefix(tenant_id, 'lost', 1)}sglang/adapter_model.safetensors"])
        err = assert_error(
            client.get("/v1/adapters/lost/versions/1/files/sglang/adapter_model.safetensors"), 502, "integrity_error"
        )
        assert err["details"]["retryable"] is False and "missing" in err["message"]
        assert client.get("/v1/adapters/lost/versions/1/files/sglang/adapter_config.json").status_code == 200


# ---- 3. import hardening -------------------------------------------------------------------------


def _post(client, files: list[tuple[str, bytes]], layout: str, name: str = "imp", **data):
    form = {"name": name, "base_model": "inkling-tiny", "layout": layout, **data}
    return client.post("/v1/adapters/import", data=form, files=[("files", f) for f in files])


def _files(directory) -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]


def test_import_422s_name_the_uploaded_file_not_a_server_path(sqlite_service, tmp_path):
    service = sqlite_service
    _, key = service.new_tenant()
    peft = make_adapter_dir(service, tmp_path / "p", "peft", manifest=False)
    config = (peft / "adapter_config.json").read_bytes()
    weights = (peft / "adapter_model.safetensors").read_bytes()
    scratch = str(service.settings.data_dir)
    cases = {
        "missing weights": [("adapter_config.json", config)],
        "config not JSON": [("adapter_config.json", b"not json"), ("adapter_model.safetensors", weights)],
        "weights not safetensors": [("adapter_config.json", config), ("adapter_model.safetensors", b"xx")],
        "config a JSON list": [("adapter_config.json", b"[]"), ("adapter_model.safetensors", weights)],
        "manifest a JSON list": [*_files(peft), ("manifest.json", b"[]")],
    }
    with service.client(key) as client:
        for what, files in cases.items():
            resp = _post(client, files, "peft")
            err = assert_error(resp, 422, "invalid_adapter")
            assert scratch not in resp.text and "/tmp" not in resp.text and "import-" not in resp.text, (
                what,
                resp.text,
            )
        err = assert_error(_post(client, cases["missing weights"], "peft"), 422, "invalid_adapter")
        assert "adapter_model.safetensors" in err["message"]


@pytest.mark.parametrize("manifest", [True, False])
def test_import_whose_declared_layout_does_not_match_its_files_is_422(sqlite_service, tmp_path, manifest):
    service = sqlite_service
    _, key = service.new_tenant()
    with service.client(key) as client:
        for actual, declared in (("sglang", "peft"), ("peft", "sglang")):
            directory = make_adapter_dir(service, tmp_path / f"{actual}-{manifest}", actual, manifest=manifest)
            err = assert_error(_post(client, _files(directory), declared, name=f"m-{actual}"), 422, "invalid_adapter")
            assert err["details"]["reason_code"] == "layout_mismatch", err
            assert actual in err["message"] and declared in err["message"]
        assert client.get("/v1/adapters").json()["data"] == []


def test_an_import_its_checks_refuse_does_not_wait_for_another_writer(sqlite_service, tmp_path):
    """The import's checks (the base model, the name's base) only read: while another process holds SQLite's write
    lock, an import naming an unknown base model is refused at once, where checks that took the lock waited for it,
    up to the 60 s busy timeout; once that writer is done, the same files import."""
    service = sqlite_service
    _, key = service.new_tenant()
    files = _files(make_adapter_dir(service, tmp_path / "p", "peft", manifest=False))
    with service.client(key, timeout=20) as client:
        with sqlite_write_lock(service.settings):
            err = assert_error(_post(client, files, "peft", base_model="inkling-nope"), 404, "unknown_base_model")
            assert "inkling-tiny" in err["message"]
        assert _post(client, files, "peft").status_code == 201


def test_import_with_a_file_given_twice_is_422(sqlite_service, tmp_path):
    service = sqlite_service
    _, key = service.new_tenant()
    peft = make_adapter_dir(service, tmp_path / "p", "peft", manifest=False)
    other = make_adapter_dir(service, tmp_path / "o", "peft", seed=7, manifest=False)
    files = [*_files(peft), ("adapter_model.safetensors", (other / "adapter_model.safetensors").read_bytes())]
    with service.client(key) as client:
        err = assert_error(_post(client, files, "peft"), 422, "invalid_adapter")
        assert err["details"]["reason_code"] == "duplicate_file" and "adapter_model.safetensors" in err["message"]
        # The same name after a directory part is the same file too.
        files = [*_files(peft), ("sub/adapter_config.json", (peft / "adapter_config.json").read_bytes())]
        err = assert_error(_post(client, files, "peft"), 422, "invalid_adapter")
        assert err["details"]["reason_code"] == "duplicate_file"
        assert client.get("/v1/adapters").json()["data"] == []


def test_import_version_past_bigint_is_422_and_writes_no_objects(service, tmp_path):
    tenant_id, key = service.new_tenant()
    peft = make_adapter_dir(service, tmp_path / "p", "peft", manifest=False)
    with service.client(key) as client:
        for bad in (BIG, 2**64, 0):
            assert_error(import_dir(client, peft, "huge", "peft", version=bad), 422, "validation_error")
        assert service.store.list_objects(f"adapters/{tenant_id}/") == []
        # The largest BIGINT is a version like any other (on PostgreSQL too).
        resp = import_dir(client, peft, "huge", "peft", version=MAX)
        assert resp.status_code == 201 and resp.json()["version"] == MAX, resp.text
        assert client.get(f"/v1/adapters/huge/versions/{MAX}").json()["version"] == MAX
        assert client.put("/v1/adapters/huge/aliases/top", json={"version": MAX}).json()["version"] == MAX
        # No number is left after it: a clean 409, and nothing written for the would-be next one.
        assert_error(import_dir(client, peft, "huge", "peft"), 409, "version_exists")
    keys = {o.key for o in service.store.list_objects(f"adapters/{tenant_id}/")}
    assert keys and all(k.startswith(version_prefix(tenant_id, "huge", MAX)) for k in keys)


def test_publish_refuses_an_out_of_range_version_before_writing(service, tmp_path):
    tenant_id, _ = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    for bad in (BIG, 0, -1):
        pub = Publication(tenant_id, "nope", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import", version=bad)
        with pytest.raises(ValueError):
            publish(service.sm, service.store, pub)
    assert service.store.list_objects(f"adapters/{tenant_id}/") == []


def test_publish_failing_before_its_row_commits_removes_its_objects(service, tmp_path, monkeypatch):
    tenant_id, _ = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    pub = Publication(tenant_id, "flaky", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import", version=1)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure while writing the row")

    with monkeypatch.context() as m:
        m.setattr(repo, "audit", boom)
        with pytest.raises(RuntimeError):
            publish(service.sm, service.store, pub)
    assert service.store.list_objects(version_prefix(tenant_id, "flaky", 1)) == []
    assert publish(service.sm, service.store, pub).version == 1


# ---- 4. integers past BIGINT in paths, bodies and refs ---------------------------------------------


def test_huge_integers_in_adapter_routes_are_4xx(service, tmp_path):
    tenant_id, key = service.new_tenant()
    with service.client(key) as client:
        assert (
            import_dir(client, make_adapter_dir(service, tmp_path / "a", "sglang"), "ints", "sglang").status_code == 201
        )
        for ref in (str(BIG), "9" * 30, "²", "١"):
            assert_error(client.get(f"/v1/adapters/ints/versions/{ref}"), 404, "not_found")
            assert_error(client.get(f"/v1/adapters/ints/versions/{ref}/download"), 404, "not_found")
            resp = client.get(f"/v1/adapters/ints/versions/{ref}/files/sglang/adapter_config.json")
            assert_error(resp, 404, "not_found")
        for version in (BIG, 2**64, 0):
            assert_error(client.delete(f"/v1/adapters/ints/versions/{version}"), 422, "validation_error")
        for version in (BIG, 2**64):
            resp = client.put("/v1/adapters/ints/aliases/prod", json={"version": version})
            assert resp.status_code in (404, 422), resp.text  # 422 once AliasSet.version is bounded too
        for cursor in (str(BIG), "9" * 30, "²"):
            assert_error(client.get("/v1/adapters/ints/versions", params={"cursor": cursor}), 422, "validation_error")
            assert_error(client.get("/v1/audit", params={"cursor": cursor}), 422, "validation_error")
        assert client.get("/v1/adapters/ints/versions/1").json()["version"] == 1
    with service.sm() as s:
        for ref in (BIG, str(BIG), 2**64, -1, 0):
            with pytest.raises(APIError) as info:
                registry.resolve(s, tenant_id, "ints", ref)
            assert info.value.status == 404
        assert json.loads(json.dumps(registry.resolve(s, tenant_id, "ints", "1").version)) == 1
