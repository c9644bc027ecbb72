"""The SDK's error mapping, retry rules, checksum check and stream resumption, with faults
injected through httpx.MockTransport (everything else in tests/sdk runs against the real service)."""

import asyncio
import hashlib
import json
import socket

import httpx
import pytest

from inkwell import sdk
from inkwell.sdk.events import SSEParser

URL = "http://inkwell.test"
KEY = "ink_test"


def error(status: int, code: str, message: str = "boom", headers: dict | None = None, **details) -> httpx.Response:
    body = {"error": {"code": code, "message": message, "details": details}}
    return httpx.Response(status, json=body, headers=headers)


def model_json(name: str = "inkling-tiny") -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 1,
        "owned_by": "inkwell",
        "config_sha256": "0" * 64,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "n_routed_experts": 4,
        "vocab_size": 260,
    }


def scripted(*responses):
    """A transport answering with `responses` in order (a Response, or an exception to raise)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        item = responses[min(len(seen), len(responses)) - 1]
        if isinstance(item, Exception):
            raise item
        return item

    return handler, seen


def client(handler, **kwargs) -> sdk.Client:
    return sdk.Client(URL, KEY, transport=httpx.MockTransport(handler), **kwargs)


def test_missing_configuration_names_the_environment_variables(monkeypatch):
    monkeypatch.delenv("INKWELL_URL", raising=False)
    monkeypatch.delenv("INKWELL_API_KEY", raising=False)
    with pytest.raises(sdk.ConfigurationError) as err:
        sdk.Client()
    assert "INKWELL_URL" in err.value.message and "INKWELL_API_KEY" in err.value.message
    monkeypatch.setenv("INKWELL_URL", "http://127.0.0.1:1")
    with pytest.raises(sdk.ConfigurationError) as err:
        sdk.Client()
    assert "INKWELL_API_KEY" in err.value.message and "INKWELL_URL" not in err.value.message
    monkeypatch.setenv("INKWELL_API_KEY", KEY)
    assert sdk.Client().url == "http://127.0.0.1:1"


def test_retryable_503_is_retried_then_succeeds():
    handler, seen = scripted(
        error(503, "storage_unavailable", retryable=True),
        error(503, "storage_unavailable", retryable=True),
        httpx.Response(200, json=model_json()),
    )
    with client(handler) as c:
        c._transport.policy.backoff = 0.01
        assert c.models.get("inkling-tiny").id == "inkling-tiny"
    assert len(seen) == 3
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in seen)


def test_retries_are_bounded_and_the_last_error_is_raised():
    handler, seen = scripted(error(503, "database_unavailable", "db down", retryable=True))
    with client(handler, max_retries=2) as c, pytest.raises(sdk.ServiceUnavailableError) as err:
        c._transport.policy.backoff = 0.01
        c.models.list()
    assert len(seen) == 3
    assert (err.value.status, err.value.code, err.value.message, err.value.retryable) == (
        503,
        "database_unavailable",
        "db down",
        True,
    )


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (401, "unauthorized", sdk.AuthenticationError),
        (404, "unknown_base_model", sdk.NotFoundError),
        (409, "version_exists", sdk.ConflictError),
        (413, "payload_too_large", sdk.PayloadTooLargeError),
        (422, "invalid_dataset", sdk.ValidationError),
        (500, "internal_error", sdk.ServerError),
        (503, "storage_unavailable", sdk.ServiceUnavailableError),
    ],
)
def test_errors_map_to_types_and_are_not_retried_unless_retryable(status, code, cls):
    handler, seen = scripted(error(status, code, "what went wrong", line=3))
    with client(handler) as c, pytest.raises(cls) as err:
        c.models.get("x")
    assert len(seen) == 1
    assert isinstance(err.value, sdk.InkwellError)
    assert (err.value.status, err.value.code, err.value.message) == (status, code, "what went wrong")
    assert err.value.details["line"] == 3


def test_rate_limit_honours_retry_after():
    handler, seen = scripted(
        error(429, "rate_limited", headers={"Retry-After": "0.2"}), httpx.Response(200, json=model_json())
    )
    with client(handler) as c:
        c._transport.policy.backoff = 0.001
        assert c.models.get("inkling-tiny").vocab_size == 260
    assert len(seen) == 2
    handler, _ = scripted(error(429, "rate_limited", headers={"Retry-After": "7"}))
    with client(handler, max_retries=0) as c, pytest.raises(sdk.RateLimitError) as err:
        c.models.get("inkling-tiny")
    assert err.value.retry_after == 7.0 and err.value.retryable


def test_a_non_json_error_body_still_maps():
    handler, _ = scripted(httpx.Response(502, text="<html>bad gateway</html>"))
    with client(handler, max_retries=0) as c, pytest.raises(sdk.ServerError) as err:
        c.models.list()
    assert err.value.code == "http_502" and "bad gateway" in err.value.message


@pytest.mark.parametrize("from_file", [False, True])
def test_a_post_the_service_declares_retryable_is_resent_whole(from_file, tmp_path):
    dataset = {
        "id": "ds_" + "a" * 24,
        "name": "d",
        "format": "chat",
        "num_examples": 1,
        "size_bytes": 9,
        "sha256": "0" * 64,
        "created_at": "2026-11-29T00:00:00Z",
    }
    handler, seen = scripted(error(503, "storage_unavailable", retryable=True), httpx.Response(201, json=dataset))
    with client(handler) as c:
        c._transport.policy.backoff = 0.001
        records = [{"prompt": "a", "completion": "b"}]
        source = tmp_path / "d.jsonl" if from_file else records
        if from_file:
            source.write_text(json.dumps(records[0]) + "\n")
        assert c.datasets.upload(source).id == dataset["id"]
    assert len(seen) == 2 and seen[0].method == "POST"
    assert b'{"prompt": "a", "completion": "b"}' in seen[1].read()  # the body went out again, complete


@pytest.mark.parametrize(
    "failure,raised",
    [
        (httpx.Response(502, text="bad gateway"), sdk.ServerError),
        (httpx.ReadError("connection reset"), sdk.APIConnectionError),
    ],
    ids=["gateway-error", "dropped-connection"],
)
def test_a_failed_post_is_not_resent_but_a_failed_get_is(failure, raised):
    handler, seen = scripted(failure, httpx.Response(200, json=model_json()))
    with client(handler) as c:
        c._transport.policy.backoff = 0.001
        assert c.models.get("inkling-tiny").id == "inkling-tiny"
        assert len(seen) == 2
        seen.clear()
        with pytest.raises(raised):
            c.jobs.cancel("job_" + "0" * 24)
        assert len(seen) == 1  # the server may have acted on it: never resent


def test_connection_refused_is_retried_a_bounded_number_of_times():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    c = sdk.Client(f"http://127.0.0.1:{port}", KEY, max_retries=2)
    c._transport.policy.backoff = 0.01
    with pytest.raises(sdk.APIConnectionError) as err:
        c.models.list()
    assert f"127.0.0.1:{port}" in err.value.message and "INKWELL_URL" in err.value.message
    c.close()


def test_client_side_validation_fails_before_sending_anything(tmp_path):
    handler, seen = scripted(httpx.Response(500))
    with client(handler) as c:
        with pytest.raises(sdk.ValidationError, match="unknown hyperparameter 'lr'"):
            c.train("inkling-tiny", "ds_" + "0" * 24, adapter_name="a", lr=0.1, wait=False)
        with pytest.raises(sdk.ValidationError, match="unknown hyperparameter 'lr'"):  # before the upload
            c.train("inkling-tiny", [{"prompt": "a", "completion": "b"}], adapter_name="a", lr=0.1, wait=False)
        with pytest.raises(sdk.ValidationError, match="learning_rate"):
            c.train("inkling-tiny", "ds_" + "0" * 24, adapter_name="a", learning_rate=-1, wait=False)
        with pytest.raises(sdk.ValidationError, match="rank"):
            c.train("inkling-tiny", "ds_" + "0" * 24, adapter_name="a", lora={"rank": 0}, wait=False)
        with pytest.raises(sdk.ValidationError, match="not allowed"):
            c.train("inkling-tiny", "ds_" + "0" * 24, adapter_name="../etc", wait=False)
        with pytest.raises(FileNotFoundError, match="nope.jsonl' does not exist"):
            c.train("inkling-tiny", str(tmp_path / "nope.jsonl"), adapter_name="a", wait=False)
        with pytest.raises(FileNotFoundError, match="is a directory"):
            c.datasets.upload(tmp_path)
        with pytest.raises(FileNotFoundError, match="nope does not exist: give the adapter's directory"):
            c.adapters.import_(tmp_path / "nope", name="a", base_model="inkling-tiny", layout="peft")
        with pytest.raises(sdk.ValidationError, match="layout"):
            c.adapters.download("a", 1, layout="onnx", dest=tmp_path)
        (tmp_path / "a-file").write_text("")
        with pytest.raises(sdk.ValidationError, match="is a file: give a directory"):
            c.adapters.download("a", 1, dest=tmp_path / "a-file")
    assert seen == []


def _download_handler(payload: bytes, served: bytes, header_sha: str | None = None):
    sha = hashlib.sha256(payload).hexdigest()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/download"):
            files = [
                {
                    "layout": "sglang",
                    "path": name,
                    "size": len(payload),
                    "sha256": sha,
                    "url": f"http://s3.test/{name}",
                    "download_path": f"/v1/adapters/a/versions/1/files/sglang/{name}",
                }
                for name in ("adapter_config.json", "adapter_model.safetensors")
            ]
            return httpx.Response(
                200, json={"name": "a", "version": 1, "layout": "sglang", "expires_in": 60, "files": files}
            )
        body = served if request.url.path.endswith("safetensors") else payload
        return httpx.Response(200, content=body, headers={"X-Inkwell-SHA256": header_sha or sha})

    return handler


def test_download_verifies_sha256_and_keeps_nothing_on_mismatch(tmp_path):
    payload = b"x" * 1000
    with client(_download_handler(payload, payload)) as c:
        got = c.adapters.download("a", 1, dest=tmp_path / "ok")
    assert got.version == 1 and sorted(p.name for p in (tmp_path / "ok").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (tmp_path / "ok" / "adapter_model.safetensors").read_bytes() == payload
    corrupt = b"y" + payload[1:]
    with client(_download_handler(payload, corrupt), max_retries=1) as c, pytest.raises(sdk.IntegrityError) as err:
        c._transport.policy.backoff = 0.001
        c.adapters.download("a", 1, dest=tmp_path / "bad")
    assert err.value.code == "checksum_mismatch" and "adapter_model.safetensors" in err.value.message
    assert list((tmp_path / "bad").iterdir()) == []  # not even the file that verified, nor a .part


def test_download_rejects_a_server_header_that_disagrees(tmp_path):
    payload = b"z" * 10
    with (
        client(_download_handler(payload, payload, header_sha="f" * 64), max_retries=0) as c,
        pytest.raises(sdk.IntegrityError, match="X-Inkwell-SHA256"),
    ):
        c.adapters.download("a", 1, dest=tmp_path)


def _event(i: int, type_: str = "progress", state: str | None = None) -> str:
    ev = {
        "id": i,
        "job_id": "job_1",
        "type": type_,
        "state": state,
        "message": f"event {i}",
        "data": {"step": i, "loss": 1.0 / i} if type_ == "progress" else {},
        "created_at": "2026-11-29T00:00:00Z",
    }
    return f"id: {i}\nevent: {type_}\ndata: {json.dumps(ev)}\n\n"


class _DroppingStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """Sends `text`, then fails like a connection reset."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __iter__(self):
        yield self.text.encode()
        raise httpx.ReadError("connection reset mid-stream")

    async def __aiter__(self):
        yield self.text.encode()
        raise httpx.ReadError("connection reset mid-stream")


def _resuming_handler(seen: list[httpx.Request]):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(200, stream=_DroppingStream(": keepalive\n\n" + _event(1) + _event(2)))
        after = int(request.headers["last-event-id"])
        body = "".join(_event(i) for i in range(after + 1, 4)) + _event(4, "state", "succeeded")
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return handler


def test_event_stream_resumes_after_a_drop_from_the_last_event_id():
    seen: list[httpx.Request] = []
    with client(_resuming_handler(seen)) as c:
        events = list(c.jobs.events("job_1"))
    assert [e.id for e in events] == [1, 2, 3, 4]
    assert events[-1].state == "succeeded"
    assert seen[1].headers["last-event-id"] == "2" and seen[1].url.params["after"] == "2"


def test_async_twin_retries_and_resumes_streams_too():
    async def main():
        seen: list[httpx.Request] = []
        transport = httpx.MockTransport(_resuming_handler(seen))
        async with sdk.AsyncClient(URL, KEY, transport=transport) as c:
            events = [e async for e in c.jobs.events("job_1")]
        assert [e.id for e in events] == [1, 2, 3, 4] and seen[1].headers["last-event-id"] == "2"
        handler, calls = scripted(
            error(503, "storage_unavailable", retryable=True), httpx.Response(200, json=model_json())
        )
        async with sdk.AsyncClient(URL, KEY, transport=httpx.MockTransport(handler)) as c:
            c._transport.policy.backoff = 0.001
            assert (await c.models.get("inkling-tiny")).id == "inkling-tiny"
        assert len(calls) == 2
        handler, _ = scripted(error(401, "unauthorized", "unknown key"))
        async with sdk.AsyncClient(URL, KEY, transport=httpx.MockTransport(handler)) as c:
            with pytest.raises(sdk.AuthenticationError, match="unknown key"):
                await c.models.list()

    asyncio.run(main())


def test_sse_parser_follows_the_spec_for_multiline_data_and_comments():
    parser = SSEParser()
    out = [parser.feed(line) for line in [": hi", "id: 7", "event: log", "data: a", "data:b", "", ""]]
    messages = [m for m in out if m is not None]
    assert len(messages) == 1 and (messages[0].id, messages[0].event, messages[0].data) == ("7", "log", "a\nb")


def test_importing_the_sdk_stays_light():
    import subprocess
    import sys

    heavy = "('torch', 'fastapi', 'sqlalchemy', 'boto3')"
    code = f"import sys; from inkwell import sdk; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
