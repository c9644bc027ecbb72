"""Bad input found by an outside-in drill answers 4xx, never 500 or a dropped connection, on SQLite and
PostgreSQL: numbers past 64 bits, NUL bytes, JSON nested past what json.loads reads, non-finite floats, LoRA
targets that are not a list. And a checksum failure between the API and S3 is `retryable: false`."""

import base64
import hashlib

import httpx
import pytest
from botocore.exceptions import FlexibleChecksumError

from inkwell.trainer.config import MAX_INT64
from tests.service.helpers import CHAT, assert_error, import_dir, jsonl, make_adapter_dir, upload

HUGE = str(2**70)
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def job_body(tenant):
    _, client = tenant
    ds = upload(client, jsonl(CHAT)).json()["id"]
    return {"base_model": "inkling-tiny", "dataset_id": ds, "adapter_name": "hard"}


def post_json(client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text, headers={"content-type": "application/json"})


def test_seed_past_what_torch_takes_is_422(tenant, job_body):
    _, client = tenant
    for seed in (2**70, 2**64, MAX_INT64 + 1, -1):
        resp = client.post("/v1/jobs", json={**job_body, "hyperparameters": {"seed": seed}})
        err = assert_error(resp, 422, "validation_error")
        assert err["details"]["errors"][0]["loc"][-1] == "seed", err
    ok = client.post("/v1/jobs", json={**job_body, "hyperparameters": {"seed": MAX_INT64}})
    assert ok.status_code == 201 and ok.json()["hyperparameters"]["seed"] == MAX_INT64
    assert client.post(f"/v1/jobs/{ok.json()['id']}/cancel").json()["state"] == "cancelled"


def test_non_finite_floats_and_unbounded_counts_are_422(tenant, job_body):
    _, client = tenant
    # json.loads reads Infinity and NaN; PostgreSQL's JSON cannot store them.
    for field, where in (("weight_decay", "hyperparameters"), ("max_grad_norm", "hyperparameters"), ("alpha", "lora")):
        text = (
            f'{{"base_model": "inkling-tiny", "dataset_id": "{job_body["dataset_id"]}", "adapter_name": "hard", '
            f'"{where}": {{"{field}": Infinity}}}}'
        )
        err = assert_error(post_json(client, "/v1/jobs", text), 422, "validation_error")
        assert err["details"]["errors"][0]["loc"][-1] == field, err
    for field in ("warmup_steps", "checkpoint_every", "eval_every"):
        resp = client.post("/v1/jobs", json={**job_body, "hyperparameters": {field: 2**70}})
        assert assert_error(resp, 422, "validation_error")["details"]["errors"][0]["loc"][-1] == field


@pytest.mark.parametrize("field", ["dataset_id", "eval_dataset_id"])
def test_an_empty_dataset_id_in_a_job_is_422(tenant, job_body, field):
    """Found by the API fuzz (tests/service/test_fuzz.py): an empty id was taken for "none given", skipped the
    dataset lookup and failed on the jobs table's foreign key (a 500). No id is empty."""
    _, client = tenant
    err = assert_error(client.post("/v1/jobs", json={**job_body, field: ""}), 422, "validation_error")
    assert err["details"]["errors"][0]["loc"][-1] == field, err


@pytest.mark.parametrize(
    "targets, says",
    [(None, "must be a list"), ("attn", "not a bare string"), (5, "must be a list"), ({"attn": 1}, "must be a list")],
    ids=["null", "bare-string", "number", "object"],
)
def test_lora_targets_must_be_a_list(tenant, job_body, targets, says):
    _, client = tenant
    err = assert_error(
        client.post("/v1/jobs", json={**job_body, "lora": {"targets": targets}}), 422, "validation_error"
    )
    assert err["details"]["errors"][0]["loc"][-1] == "targets" and says in err["message"], err


def test_integers_past_64_bits_in_paths_and_queries_are_422(tenant, job_body):
    _, client = tenant
    job = client.post("/v1/jobs", json=job_body).json()
    try:
        for resp in (
            client.get(f"/v1/jobs/{job['id']}/events", params={"after": HUGE}),
            client.get(f"/v1/jobs/{job['id']}/events", params={"after": str(MAX_INT64 + 1)}),
            client.get(f"/v1/jobs/{job['id']}/events", params={"limit": HUGE}),
            client.get("/v1/jobs", params={"limit": HUGE}),
        ):
            assert_error(resp, 422, "validation_error")
        for path in ("/v1/jobs", "/v1/datasets", "/v1/adapters", "/v1/audit"):
            assert_error(client.get(path, params={"cursor": HUGE}), 422, "validation_error")
        assert client.get(f"/v1/jobs/{job['id']}/events", params={"after": str(MAX_INT64)}).json()["data"] == []
    finally:
        client.post(f"/v1/jobs/{job['id']}/cancel")


def test_event_stream_resuming_past_64_bits_is_422_not_a_dropped_connection(tenant, job_body):
    _, client = tenant
    job = client.post("/v1/jobs", json=job_body).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")  # terminal: a stream that starts ends at once
    stream = f"/v1/jobs/{job['id']}/events/stream"
    for kwargs in ({"params": {"after": "1e30"}}, {"params": {"after": HUGE}}, {"headers": {"Last-Event-ID": HUGE}}):
        with client.stream("GET", stream, timeout=30, **kwargs) as resp:
            resp.read()
        assert_error(resp, 422, "validation_error")
    with client.stream("GET", stream, headers={"Last-Event-ID": str(MAX_INT64)}, timeout=30) as resp:
        assert resp.status_code == 200 and resp.read() == b""


def test_alias_version_past_64_bits_is_422(tenant, service, tmp_path):
    _, client = tenant
    assert (
        import_dir(client, make_adapter_dir(service, tmp_path / "a", "sglang"), "big-alias", "sglang").status_code
        == 201
    )
    for version in (2**70, MAX_INT64 + 1):
        resp = client.put("/v1/adapters/big-alias/aliases/prod", json={"version": version})
        assert assert_error(resp, 422, "validation_error")["details"]["errors"][0]["loc"][-1] == "version"
    assert_error(client.put("/v1/adapters/big-alias/aliases/prod", json={"version": MAX_INT64}), 404, "not_found")


@pytest.mark.parametrize(
    "method, path, params",
    [
        ("GET", "/v1/jobs/job_%00x", None),
        ("GET", "/v1/jobs/job_%00x/events", None),
        ("POST", "/v1/jobs/job_%00x/cancel", None),
        ("GET", "/v1/datasets/ds_%00x", None),
        ("GET", "/v1/models/inkling%00", None),
        ("GET", "/v1/adapters/a%00b", None),
        ("GET", "/v1/jobs", {"adapter_name": "a\x00b"}),
        ("GET", "/v1/jobs", {"base_model": "a\x00b"}),
        ("GET", "/v1/adapters", {"base_model": "a\x00b"}),
    ],
    ids=["job", "events", "cancel", "dataset", "model", "adapter", "q-adapter", "q-base", "q-adapters-base"],
)
def test_nul_in_path_or_query_is_422(tenant, method, path, params):
    _, client = tenant
    err = assert_error(client.request(method, path, params=params), 422, "validation_error")
    assert "NUL" in err["message"], err


def test_nul_in_job_body_ids_is_422(tenant, job_body):
    _, client = tenant
    for field in ("base_model", "dataset_id", "eval_dataset_id"):
        resp = client.post("/v1/jobs", json={**job_body, field: "x\x00y"})
        err = assert_error(resp, 422, "validation_error")
        assert err["details"]["errors"][0]["loc"][-1] == field and "NUL" in err["message"], err


def test_json_nested_too_deeply_is_422(tenant):
    _, client = tenant
    text = '{"a": ' + DEEP + "}"
    headers = {"content-type": "application/json"}
    for resp in (
        post_json(client, "/v1/jobs", text),
        client.put("/v1/adapters/x/aliases/y", content=text, headers=headers),
    ):
        err = assert_error(resp, 422, "validation_error")
        assert "nested too deeply" in err["message"], err
    deep_line = ('{"messages": ' + DEEP + "}\n").encode()
    err = assert_error(upload(client, jsonl(CHAT[:2]) + deep_line), 422, "invalid_dataset")
    assert err["details"]["line"] == 3 and "nested too deeply" in err["details"]["reason"], err


def test_a_body_that_is_not_json_says_so_and_where_it_stops(tenant):
    _, client = tenant
    for text, reason, at in (
        ("not-json", "Expecting value", 0),
        ('{"base_model": "x",', "Expecting property name", 19),
    ):
        err = assert_error(post_json(client, "/v1/jobs", text), 422, "validation_error")
        assert err["message"].startswith(f"body: not valid JSON ({reason}"), err
        assert f"at character {at}); send a JSON object" in err["message"], err
        assert err["details"]["errors"] == [{"loc": ["body"], "msg": err["message"][6:], "type": "json_invalid"}], err


def test_a_slash_inside_a_path_segment_is_named_in_the_404(tenant):
    _, client = tenant
    for path in ("/v1/adapters/x/versions/%2Ftmp%2Fdl", "/v1/jobs/a%2fb"):
        err = assert_error(client.get(path), 404, "not_found")
        assert "holds an encoded '/'" in err["message"], err
    plain = assert_error(client.get("/v1/adapters/x/versions/1/nope"), 404, "not_found")
    assert "encoded" not in plain["message"], plain


def test_s3_refusing_a_body_for_its_checksum_is_integrity_error_not_retryable(sqlite_service, monkeypatch):
    """SeaweedFS itself refuses the upload (400 BadDigest): the checksum sent is not the bytes' (as when they
    changed on the way)."""
    _, key = sqlite_service.new_tenant()
    client_s3 = sqlite_service.store.client
    put_object = client_s3.put_object
    other = base64.b64encode(hashlib.sha256(b"not these bytes").digest()).decode()

    def put_with_another_checksum(**kwargs):
        return put_object(**{**kwargs, "ChecksumSHA256": other})

    monkeypatch.setattr(client_s3, "put_object", put_with_another_checksum)
    with sqlite_service.client(key) as client:
        err = assert_error(upload(client, jsonl(CHAT)), 502, "integrity_error")
        assert err["details"]["retryable"] is False
        monkeypatch.undo()
        assert client.get("/v1/datasets").json()["data"] == []
        assert upload(client, jsonl(CHAT)).status_code == 201


def test_botocore_checksum_failure_is_not_reported_as_an_outage(sqlite_service, monkeypatch):
    """botocore's own checksum check is a BotoCoreError, which the store wraps as StorageUnavailable."""
    _, key = sqlite_service.new_tenant()
    store = sqlite_service.store

    def corrupt(**kwargs):  # an injected fault: what botocore raises when a checksum does not match
        raise FlexibleChecksumError(error_msg="Expected checksum abc did not match calculated checksum def")

    monkeypatch.setattr(store.client, "put_object", corrupt)
    with sqlite_service.client(key) as client:
        resp = upload(client, jsonl(CHAT))
        err = assert_error(resp, 502, "integrity_error")
        assert err["details"]["retryable"] is False and "retry-after" not in resp.headers
