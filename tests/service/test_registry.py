"""Adapter registry against the running service: import, download with sha256, aliases, soft
delete + audit, tenant isolation, immutability under concurrent publishes, crash cleanup."""

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import save_file

from inkwell.models import BaseModelIdentity
from inkwell.service.db import repo
from inkwell.service.registry import Publication, VersionExists, cleanup_orphans, publish, version_prefix
from inkwell.service.storage import StorageUnavailable
from tests.service.helpers import assert_error, import_dir, make_adapter_dir


def test_import_both_layouts_download_verifies_sha256(service, tenant, tmp_path):
    _, client = tenant
    sg = make_adapter_dir(service, tmp_path / "sg", "sglang", seed=1)
    resp = import_dir(client, sg, "chat-bot", "sglang")
    assert resp.status_code == 201, resp.text
    v1 = resp.json()
    assert v1["version"] == 1 and v1["lineage"]["source"] == "import" and v1["lora"]["rank"] == 2
    assert {f["layout"] for f in v1["files"]} == {"sglang", "peft"}
    assert {f["path"] for f in v1["files"]} == {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}
    ext = make_adapter_dir(service, tmp_path / "peft", "peft", seed=2, manifest=False)
    v2 = import_dir(client, ext, "chat-bot", "peft")
    assert v2.status_code == 201, v2.text
    assert v2.json()["version"] == 2 and v2.json()["metrics"]["imported_layout"] == "peft"

    adapter = client.get("/v1/adapters/chat-bot").json()
    assert adapter["latest_version"] == 2 and adapter["num_versions"] == 2 and adapter["base_model"] == "inkling-tiny"
    listing = client.get("/v1/adapters/chat-bot/versions").json()["data"]
    assert [v["version"] for v in listing] == [2, 1]

    dl = client.get("/v1/adapters/chat-bot/versions/1/download", params={"layout": "sglang"}).json()
    assert len(dl["files"]) == 3
    for f in dl["files"]:
        streamed = client.get(f["download_path"])
        assert streamed.status_code == 200
        assert hashlib.sha256(streamed.content).hexdigest() == f["sha256"] == streamed.headers["x-inkwell-sha256"]
        presigned = httpx.get(f["url"])
        assert presigned.status_code == 200 and presigned.content == streamed.content
    # The sglang layout we stored is byte-identical to the one uploaded (same save_adapter).
    weights = next(f for f in dl["files"] if f["path"] == "adapter_model.safetensors")
    assert weights["sha256"] == hashlib.sha256((sg / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert_error(client.get("/v1/adapters/chat-bot/versions/1/files/sglang/other.bin"), 404, "not_found")
    assert_error(client.get("/v1/adapters/chat-bot/versions/9"), 404, "not_found")
    assert client.get("/v1/adapters/chat-bot/versions/latest").json()["version"] == 2


def test_stored_object_corruption_is_refused_not_streamed(service, tenant, tmp_path):
    tenant_id, client = tenant
    resp = import_dir(client, make_adapter_dir(service, tmp_path / "a", "sglang"), "corrupt-me", "sglang")
    assert resp.status_code == 201
    key = f"{version_prefix(tenant_id, 'corrupt-me', 1)}peft/adapter_config.json"
    service.store.put_bytes(key, b'{"tampered": true}', create_only=False)  # injected fault: bit rot in S3
    r = client.get("/v1/adapters/corrupt-me/versions/1/files/peft/adapter_config.json")
    assert assert_error(r, 502, "integrity_error")["details"]["retryable"] is False


def test_bad_imports_are_422(service, tenant, tmp_path):
    _, client = tenant
    good = make_adapter_dir(service, tmp_path / "good", "peft", manifest=False)
    for bad in ("a/b", "..", "x\x00y", "tab\there"):
        assert_error(import_dir(client, good, bad, "peft"), 422, "invalid_name")
    # A Llama LoRA: module names that do not exist in Inkling.
    llama = tmp_path / "llama"
    llama.mkdir()
    import torch

    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4096),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4096, 8),
        },
        llama / "adapter_model.safetensors",
    )
    (llama / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": "meta-llama/Llama-2-7b-hf",
            }
        )
    )
    err = assert_error(import_dir(client, llama, "llama", "peft"), 422, "invalid_adapter")
    assert "inkling-tiny" in err["message"] or "Inkling" in err["message"]
    # Trained on another base model (its manifest records another config).
    other = make_adapter_dir(service, tmp_path / "other", "sglang", base=BaseModelIdentity("other", "0" * 64))
    err = assert_error(import_dir(client, other, "other", "sglang"), 422, "invalid_adapter")
    assert err["details"]["reason_code"] == "wrong_base_model"
    # Truncated weights: the manifest catches it.
    trunc = make_adapter_dir(service, tmp_path / "trunc", "sglang")
    w = trunc / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:-10])
    err = assert_error(import_dir(client, trunc, "trunc", "sglang"), 422, "invalid_adapter")
    assert err["details"]["reason_code"] == "bad_manifest"
    assert_error(import_dir(client, good, "x", "onnx"), 422, "invalid_adapter")
    resp = client.post(
        "/v1/adapters/import",
        data={"name": "x", "base_model": "nope", "layout": "peft"},
        files=[("files", ("adapter_config.json", b"{}"))],
    )
    assert_error(resp, 404, "unknown_base_model")
    assert client.get("/v1/adapters").json()["data"] == []


def test_aliases_move_delete_is_soft_and_audited(service, tenant, tmp_path):
    _, client = tenant
    for seed in (1, 2):
        assert (
            import_dir(
                client, make_adapter_dir(service, tmp_path / f"v{seed}", "sglang", seed), "bot", "sglang"
            ).status_code
            == 201
        )
    assert client.put("/v1/adapters/bot/aliases/prod", json={"version": 1}).json()["version"] == 1
    assert client.get("/v1/adapters/bot/versions/prod").json()["version"] == 1
    moved = client.put("/v1/adapters/bot/aliases/prod", json={"version": 2}).json()
    assert moved["version"] == 2 and client.get("/v1/adapters/bot/versions/prod").json()["aliases"] == ["prod"]
    assert client.get("/v1/adapters/bot").json()["aliases"] == {"prod": 2}
    err = assert_error(client.delete("/v1/adapters/bot/versions/2"), 409, "version_aliased")
    assert err["details"]["aliases"] == ["prod"]
    deleted = client.delete("/v1/adapters/bot/versions/1").json()
    assert deleted["deleted"] and deleted["deleted_at"]
    assert [v["version"] for v in client.get("/v1/adapters/bot/versions").json()["data"]] == [2]
    everything = client.get("/v1/adapters/bot/versions", params={"include_deleted": True}).json()["data"]
    assert [(v["version"], v["deleted"]) for v in everything] == [(2, False), (1, True)]
    assert_error(client.get("/v1/adapters/bot/versions/1/download"), 409, "version_deleted")
    assert_error(client.put("/v1/adapters/bot/aliases/old", json={"version": 1}), 409, "version_deleted")
    assert_error(client.put("/v1/adapters/bot/aliases/3", json={"version": 2}), 422, "invalid_name")
    assert_error(client.put("/v1/adapters/bot/aliases/prod", json={"version": 7}), 404, "not_found")
    assert client.delete("/v1/adapters/bot/aliases/prod").status_code == 204
    assert_error(client.get("/v1/adapters/bot/versions/prod"), 404, "not_found")
    audit = client.get("/v1/audit").json()["data"]
    actions = [(a["action"], a["target"]) for a in reversed(audit)]
    assert actions == [
        ("adapter.version.publish", "bot@1"),
        ("adapter.version.publish", "bot@2"),
        ("adapter.alias.set", "bot@prod"),
        ("adapter.alias.set", "bot@prod"),
        ("adapter.version.delete", "bot@1"),
        ("adapter.alias.delete", "bot@prod"),
    ]
    assert audit[2]["data"] == {"from": 1, "to": 2} or audit[3]["data"] == {"from": 1, "to": 2}
    assert all(a["actor"] and a["actor"].startswith("key_") for a in audit)


def test_tenant_b_cannot_see_or_fetch_tenant_a_adapters(service, tmp_path):
    _, key_a = service.new_tenant("a")
    _, key_b = service.new_tenant("b")
    with service.client(key_a) as a, service.client(key_b) as b:
        assert import_dir(a, make_adapter_dir(service, tmp_path / "x", "sglang"), "secret", "sglang").status_code == 201
        a.put("/v1/adapters/secret/aliases/prod", json={"version": 1})
        dl = a.get("/v1/adapters/secret/versions/1/download").json()
        for path in (
            "/v1/adapters/secret",
            "/v1/adapters/secret/versions",
            "/v1/adapters/secret/versions/1",
            "/v1/adapters/secret/versions/prod",
            "/v1/adapters/secret/versions/1/download",
            dl["files"][0]["download_path"],
        ):
            assert_error(b.get(path), 404, "not_found")
        assert_error(b.put("/v1/adapters/secret/aliases/prod", json={"version": 1}), 404, "not_found")
        assert_error(b.delete("/v1/adapters/secret/versions/1"), 404, "not_found")
        assert b.get("/v1/adapters").json()["data"] == [] and b.get("/v1/audit").json()["data"] == []
        # B may use the same name for its own adapter: names are per tenant.
        assert import_dir(b, make_adapter_dir(service, tmp_path / "y", "sglang"), "secret", "sglang").status_code == 201
        assert a.get("/v1/adapters/secret").json()["num_versions"] == 1


def test_two_concurrent_publishes_of_one_version_exactly_one_wins(service, tenant, tmp_path):
    _, client = tenant
    dirs = [make_adapter_dir(service, tmp_path / f"c{i}", "sglang", seed=i) for i in range(2)]
    barrier = threading.Barrier(2)

    def go(i):
        with service.client(client.headers["authorization"].split()[1]) as c:
            barrier.wait()
            return import_dir(c, dirs[i], "race", "sglang", version=5)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(go, range(2)))
    codes = sorted(r.status_code for r in results)
    assert codes == [201, 409], [r.text for r in results]
    loser = next(r for r in results if r.status_code == 409)
    assert loser.json()["error"]["code"] == "version_exists"
    winner = next(r for r in results if r.status_code == 201).json()
    stored = client.get("/v1/adapters/race/versions/5").json()
    assert stored["files"] == winner["files"]
    for f in client.get("/v1/adapters/race/versions/5/download").json()["files"]:
        assert hashlib.sha256(client.get(f["download_path"]).content).hexdigest() == f["sha256"]


def test_eight_racing_publishers_in_process(service, tmp_path):
    tenant_id, _ = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    barrier = threading.Barrier(8)

    def go(i):
        pub = Publication(tenant_id, "racer", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import", version=1)
        barrier.wait()
        try:
            return publish(service.sm, service.store, pub).version
        except VersionExists:
            return None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(go, range(8)))
    assert results.count(1) == 1 and results.count(None) == 7
    # Without an explicit version, racers each get their own next number.
    barrier = threading.Barrier(4)

    def auto(i):
        pub = Publication(tenant_id, "racer", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import")
        barrier.wait()
        return publish(service.sm, service.store, pub).version

    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(auto, range(4))) == [2, 3, 4, 5]


def test_crash_between_objects_and_row_leaves_nothing_visible_and_is_cleaned(service, tmp_path, monkeypatch):
    tenant_id, key = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    pub = Publication(tenant_id, "crashy", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import", version=1)

    def crash(*args, **kwargs):
        raise SystemExit("injected crash after the objects, before the row")

    with monkeypatch.context() as m:
        m.setattr(repo, "ensure_adapter", crash)
        with pytest.raises(SystemExit):
            publish(service.sm, service.store, pub)
    prefix = version_prefix(tenant_id, "crashy", 1)
    assert len(service.store.list_objects(prefix)) == 4  # marker + 3 files
    with service.client(key) as c:
        assert_error(c.get("/v1/adapters/crashy/versions/1"), 404, "not_found")
        assert c.get("/v1/adapters").json()["data"] == []
    cleanup_orphans(service.sm, service.store, grace_seconds=3600)
    assert len(service.store.list_objects(prefix)) == 4  # too young to be an orphan yet
    with service.client(key) as c:  # a dataset whose row was never written, beside a real one
        real = c.post("/v1/datasets", files={"file": ("d.jsonl", b'{"prompt": "a", "completion": "b"}\n')}).json()
    stray = f"datasets/{tenant_id}/ds_{'0' * 24}.jsonl"
    service.store.put_bytes(stray, b"{}\n")
    removed = cleanup_orphans(service.sm, service.store, grace_seconds=0)
    assert removed >= 5 and service.store.list_objects(prefix) == []
    assert [o.key for o in service.store.list_objects(f"datasets/{tenant_id}/")] == [
        f"datasets/{tenant_id}/{real['id']}.jsonl"
    ]
    assert publish(service.sm, service.store, pub).version == 1  # the number is free again
    cleanup_orphans(service.sm, service.store, grace_seconds=0)  # published objects stay
    assert len(service.store.list_objects(prefix)) == 4


def test_a_deleted_datasets_object_that_an_outage_kept_is_swept(service, monkeypatch):
    """The delete of a dataset is done once its row says so; an object the store could not delete then (an
    injected outage) is an orphan, and the sweep removes it."""
    tenant_id, key = service.new_tenant()
    with service.client(key) as c:
        ds = c.post("/v1/datasets", files={"file": ("d.jsonl", b'{"prompt": "a", "completion": "b"}\n')}).json()["id"]

        def outage(keys: list[str]) -> None:
            raise StorageUnavailable("injected: the object store is down")

        with monkeypatch.context() as m:
            m.setattr(service.store, "delete", outage)
            assert c.delete(f"/v1/datasets/{ds}").status_code == 204
        assert_error(c.get(f"/v1/datasets/{ds}"), 404, "not_found")
    kept = f"datasets/{tenant_id}/{ds}.jsonl"
    assert [o.key for o in service.store.list_objects(kept)] == [kept]
    cleanup_orphans(service.sm, service.store, grace_seconds=0)
    assert service.store.list_objects(kept) == []
