"""Datasets, base models, auth and tenant isolation against the running service (both DBs)."""

import json

from tests.service.helpers import CHAT, assert_error, jsonl, upload


def test_models_lists_the_embedded_tiny_model(tenant):
    _, client = tenant
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    tiny = next(m for m in body["data"] if m["id"] == "inkling-tiny")
    assert tiny["hidden_size"] == 128 and tiny["num_hidden_layers"] == 4 and len(tiny["config_sha256"]) == 64
    assert client.get("/v1/models/inkling-tiny").json()["id"] == "inkling-tiny"
    err = assert_error(client.get("/v1/models/llama-7b"), 404, "unknown_base_model")
    assert "inkling-tiny" in err["details"]["known"]


def test_dataset_upload_list_get_and_pagination(tenant):
    _, client = tenant
    ids = []
    for i in range(3):
        resp = upload(client, jsonl(CHAT[: i + 1]), f"d{i}.jsonl")
        assert resp.status_code == 201, resp.text
        body = resp.json()
        assert body["format"] == "chat" and body["num_examples"] == i + 1 and body["name"] == f"d{i}.jsonl"
        ids.append(body["id"])
    pc = upload(client, jsonl([{"prompt": "2+2=", "completion": "4"}]))
    assert pc.json()["format"] == "prompt_completion"
    page1 = client.get("/v1/datasets", params={"limit": 2}).json()
    assert len(page1["data"]) == 2 and page1["next_cursor"]
    page2 = client.get("/v1/datasets", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    seen = [d["id"] for d in page1["data"] + page2["data"]]
    assert seen == [pc.json()["id"], *reversed(ids)] and page2["next_cursor"] is None
    got = client.get(f"/v1/datasets/{ids[0]}").json()
    assert got["num_examples"] == 1 and got["sha256"] == __import__("hashlib").sha256(jsonl(CHAT[:1])).hexdigest()


def test_malformed_jsonl_names_the_line(tenant):
    _, client = tenant
    data = jsonl(CHAT[:2]) + b'{"messages": [{"role": "user", "content": "x"}\n' + jsonl(CHAT[:1])
    err = assert_error(upload(client, data), 422, "invalid_dataset")
    assert err["details"]["line"] == 3 and "line 3" in err["message"] and "JSON" in err["message"]
    err = assert_error(
        upload(client, jsonl(CHAT[:1]) + jsonl([{"messages": [{"role": "user", "content": "q"}]}])),
        422,
        "invalid_dataset",
    )
    assert err["details"]["line"] == 2 and "assistant" in err["message"]
    err = assert_error(
        upload(client, jsonl(CHAT[:1]) + jsonl([{"prompt": "a", "completion": "b"}])), 422, "invalid_dataset"
    )
    assert err["details"]["line"] == 2 and "one format" in err["message"]
    assert_error(upload(client, b"\n\n"), 422, "invalid_dataset")
    assert_error(upload(client, b"\xff\xfe"), 422, "invalid_dataset")
    assert_error(upload(client, jsonl(CHAT), name="a b.jsonl"), 422, "invalid_name")


def test_oversized_upload_is_413(tenant, service):
    _, client = tenant
    limit = service.settings.max_upload_bytes
    line = json.dumps(CHAT[0]).encode() + b"\n"
    big = line * (limit // len(line) + 2)
    err = assert_error(upload(client, big), 413, "payload_too_large")
    assert err["details"]["limit_bytes"] == limit
    just_over = line * (limit // len(line)) + b" " * (limit % len(line) + 1)
    assert len(just_over) == limit + 1
    assert_error(upload(client, just_over), 413, "payload_too_large")


def test_missing_wrong_or_revoked_key_is_401(service):
    with service.client(None) as anon:
        err = assert_error(anon.get("/v1/datasets"), 401, "unauthorized")
        assert "Authorization: Bearer" in err["message"]
        assert anon.get("/healthz").json()["status"] == "ok"
    with service.client("ink_not-a-real-key") as wrong:
        assert_error(wrong.get("/v1/jobs"), 401, "unauthorized")
    with service.client("sk-123") as malformed:
        assert_error(malformed.get("/v1/adapters"), 401, "unauthorized")
    tenant_id, key = service.new_tenant()
    with service.client(key) as ok:
        assert ok.get("/v1/datasets").status_code == 200
    from inkwell.service.db import repo

    with service.sm() as s:
        assert repo.revoke_api_key(s, repo.find_api_key(s, key).id)
        s.commit()
    with service.client(key) as revoked:
        assert_error(revoked.get("/v1/datasets"), 401, "unauthorized")


def test_keys_are_stored_hashed(service):
    _, key = service.new_tenant()
    from sqlalchemy import select

    from inkwell.service.db.models import ApiKey

    with service.sm() as s:
        stored = [(k.key_hash, k.prefix) for k in s.scalars(select(ApiKey))]
    assert all(key != h and key not in h for h, _ in stored)
    assert any(h == __import__("hashlib").sha256(key.encode()).hexdigest() for h, _ in stored)


def test_tenant_b_gets_404_for_tenant_a_dataset_and_job(service):
    _, key_a = service.new_tenant("a")
    _, key_b = service.new_tenant("b")
    with service.client(key_a) as a, service.client(key_b) as b:
        ds = upload(a, jsonl(CHAT)).json()["id"]
        job = a.post("/v1/jobs", json={"base_model": "inkling-tiny", "dataset_id": ds, "adapter_name": "x"}).json()
        assert_error(b.get(f"/v1/datasets/{ds}"), 404, "not_found")
        assert_error(b.get(f"/v1/jobs/{job['id']}"), 404, "not_found")
        assert_error(b.get(f"/v1/jobs/{job['id']}/events"), 404, "not_found")
        assert_error(b.post(f"/v1/jobs/{job['id']}/cancel"), 404, "not_found")
        assert_error(
            b.post("/v1/jobs", json={"base_model": "inkling-tiny", "dataset_id": ds, "adapter_name": "x"}),
            404,
            "not_found",
        )
        assert b.get("/v1/datasets").json()["data"] == [] and b.get("/v1/jobs").json()["data"] == []
        assert a.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"


def test_job_bad_input(tenant):
    _, client = tenant
    ds = upload(client, jsonl(CHAT)).json()["id"]
    base = {"base_model": "inkling-tiny", "dataset_id": ds, "adapter_name": "ok"}
    assert_error(client.post("/v1/jobs", json={**base, "base_model": "gpt-9"}), 404, "unknown_base_model")
    assert_error(client.post("/v1/jobs", json={**base, "dataset_id": "ds_nope"}), 404, "not_found")
    for bad in ("a/b", "../etc", "x..y", "bad\x07name", "", "-lead"):
        err = assert_error(client.post("/v1/jobs", json={**base, "adapter_name": bad}), 422, "invalid_name")
        assert err["details"]["name"] == bad
    err = assert_error(client.post("/v1/jobs", json={**base, "lora": {"rank": 0}}), 422, "validation_error")
    assert err["details"]["errors"][0]["loc"][-1] == "rank"
    err = assert_error(
        client.post("/v1/jobs", json={**base, "lora": {"targets": ["mlp", "ffn"]}}), 422, "validation_error"
    )
    assert "ffn" in err["message"]
    assert_error(client.post("/v1/jobs", json={**base, "hyperparameters": {"lr": 1}}), 422, "validation_error")
    err = assert_error(
        client.post("/v1/jobs", json={**base, "hyperparameters": {"batch_size": 3, "grad_accum": 2}}),
        422,
        "invalid_job",
    )
    assert "batch_size" in err["message"]
    err = assert_error(
        client.post("/v1/jobs", json={**base, "hyperparameters": {"lr_schedule": "zigzag"}}), 422, "invalid_job"
    )
    assert "lr_schedule" in err["message"]
    assert_error(
        client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}),
        422,
        "validation_error",
    )
    assert_error(client.get("/v1/jobs", params={"cursor": "abc"}), 422, "validation_error")
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    assert_error(client.delete("/v1/jobs"), 405, "method_not_allowed")


def test_job_lifecycle_without_worker_queue_and_cancel(tenant):
    _, client = tenant
    ds = upload(client, jsonl(CHAT)).json()["id"]
    job = client.post(
        "/v1/jobs",
        json={"base_model": "inkling-tiny", "dataset_id": ds, "adapter_name": "q", "hyperparameters": {"max_steps": 3}},
    ).json()
    assert job["state"] == "queued" and job["progress"]["max_steps"] == 3 and job["attempts"] == 0
    listed = client.get("/v1/jobs", params={"state": "queued", "adapter_name": "q"}).json()["data"]
    assert [j["id"] for j in listed] == [job["id"]]
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
    events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
    assert [(e["type"], e["state"]) for e in events] == [("state", "queued"), ("state", "cancelled")]
    with client.stream("GET", f"/v1/jobs/{job['id']}/events/stream") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = "".join(resp.iter_text())
    assert text.count("event: state") == 2 and f"id: {events[-1]['id']}" in text
    logs = client.get(f"/v1/jobs/{job['id']}/logs").text
    assert "job queued" in logs and "cancelled" in logs


def test_metrics_and_openapi(service, tenant):
    _, client = tenant
    client.get("/v1/models")
    text = client.get("/metrics").text
    assert 'inkwell_http_requests_total{method="GET",route="/v1/models",status="200"}' in text
    assert "inkwell_jobs{" in text
    paths = client.get("/openapi.json").json()["paths"]
    assert "/v1/adapters/import" in paths
    # routes that parse their JSON body themselves document it all the same, with nested types inlined
    for path, title in [("/v1/chat/completions", "ChatCompletionRequest"), ("/api/v1/optim_step", "OptimStepRequest")]:
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["title"] == title and "$ref" not in json.dumps(body), body
    step = paths["/api/v1/optim_step"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "learning_rate" in json.dumps(step["properties"]["optim_params"])


def test_a_dataset_is_deleted_unless_a_job_still_needs_it(service, tenant):
    """A dataset's data can be deleted (its row stays, named by the jobs that trained on it); refused while a queued
    or running job trains or evaluates on it; another tenant's is a 404, like a missing one."""
    tenant_id, client = tenant
    ds = upload(client, jsonl(CHAT)).json()["id"]
    held = upload(client, jsonl(CHAT)).json()["id"]
    body = {"base_model": "inkling-tiny", "dataset_id": held, "eval_dataset_id": ds, "adapter_name": "del"}
    job = client.post("/v1/jobs", json=body).json()
    err = assert_error(client.delete(f"/v1/datasets/{ds}"), 409, "dataset_in_use")
    assert err["details"]["jobs"] == [job["id"]] and "cancel" in err["message"]
    with service.client(service.new_tenant()[1]) as other:
        assert_error(other.delete(f"/v1/datasets/{ds}"), 404, "not_found")
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
    key = f"datasets/{tenant_id}/{ds}.jsonl"
    assert service.app.state.store.get_bytes(key) == jsonl(CHAT)
    deleted = client.delete(f"/v1/datasets/{ds}")
    assert deleted.status_code == 204 and deleted.content == b""
    assert not service.app.state.store.list_objects(key)  # the data is gone
    assert_error(client.get(f"/v1/datasets/{ds}"), 404, "not_found")
    assert ds not in [d["id"] for d in client.get("/v1/datasets").json()["data"]]
    assert_error(client.delete(f"/v1/datasets/{ds}"), 404, "not_found")
    assert_error(client.post("/v1/jobs", json=body), 404, "not_found")  # no new job on it
    assert client.get(f"/v1/jobs/{job['id']}").json()["eval_dataset_id"] == ds  # the old one still names it
    audit = client.get("/v1/audit").json()["data"][0]
    assert (audit["action"], audit["target"]) == ("dataset.delete", ds)
