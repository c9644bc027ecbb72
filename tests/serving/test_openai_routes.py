"""The OpenAI routes in the real service (SQLite, embedded SeaweedFS, registry, worker process),
driven by the real `openai` client: adapters are imported through the registry API, fetched from
S3 by the worker's loader, and selected per request."""

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import uvicorn

from inkwell.adapters.io import save_adapter
from inkwell.models import encode_chat, encode_prompt_completion, init_base_model, load_base_config
from inkwell.service.app import create_app
from inkwell.service.bootstrap import register_base_model
from inkwell.service.db import repo
from inkwell.service.registry import object_key
from inkwell.service.settings import Settings
from inkwell.service.storage.seaweed import EmbeddedSeaweed
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from tests.service.helpers import sqlite_write_lock

SERVING_ENV = {
    "INKWELL_SERVING_MAX_LORA_RANK": "16",
    "INKWELL_SERVING_MAX_INFLIGHT_PER_WORKER": "3",
    "INKWELL_SERVING_MAX_BATCH_TOKENS": "64",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, url: str, app, keys: dict[str, str], tenant_ids: dict[str, str], model_dir: Path):
        self.url, self.app, self.keys, self.tenant_ids, self.model_dir = url, app, keys, tenant_ids, model_dir

    def client(self, tenant: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=120)

    def http(self, tenant: str = "a") -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.keys[tenant]}"}, timeout=120)


def _import(http: httpx.Client, name: str, base: str, directory: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(directory.iterdir())]
    resp = http.post("/v1/adapters/import", data={"name": name, "base_model": base, "layout": "sglang"}, files=files)
    assert resp.status_code == 201, resp.text


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_adapters):
    root = tmp_path_factory.mktemp("svc")
    saved_env = {k: os.environ.get(k) for k in SERVING_ENV}
    os.environ.update(SERVING_ENV)
    weed = EmbeddedSeaweed(root / "s3")
    endpoint = weed.start()
    settings = Settings(
        data_dir=root / "data",
        s3_endpoint=endpoint,
        s3_access_key=weed.access_key,
        s3_secret_key=weed.secret_key,
        bucket=f"b{secrets.token_hex(4)}",
    )
    app = create_app(settings)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    model_dir = root / "data" / "models" / "inkling-tiny"
    config = load_base_config(model_dir)
    other_base = init_base_model("inkling-tiny", root / "other-base", seed=1, name="tiny-other")
    keys, tenant_ids = {}, {}
    with app.state.sessionmaker() as s:
        register_base_model(s, "tiny-other", other_base)
        for tenant in ("a", "b"):
            row = repo.create_tenant(s, f"{tenant}-{secrets.token_hex(3)}")
            keys[tenant], tenant_ids[tenant] = repo.create_api_key(s, row.id)[1], row.id
        s.commit()
    served = Served(f"http://127.0.0.1:{port}", app, keys, tenant_ids, model_dir)
    dirs = [save_adapter(a, root / f"a{i}", "sglang", config) for i, a in enumerate(tiny_adapters)]
    with served.http("a") as http:
        _import(http, "alpha", "inkling-tiny", dirs[0])
        _import(http, "beta", "inkling-tiny", dirs[1])
        _import(http, "beta", "inkling-tiny", dirs[2])  # version 2 of beta is a different adapter
        _import(http, "elsewhere", "tiny-other", dirs[3])
        assert http.put("/v1/adapters/beta/aliases/prod", json={"version": 1}).status_code == 200
    with served.http("b") as http:
        _import(http, "secret", "inkling-tiny", dirs[4])
    yield served
    server.should_exit = True
    thread.join(60)
    weed.stop(grace=0)  # a throwaway store: no graceful shutdown (2 s of weed's own) to wait for
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def reference(served, tiny_adapters):
    engine = Engine(served.model_dir, EngineConfig(max_lora_rank=16))
    for i, adapter in enumerate(tiny_adapters):
        engine.load_adapter(f"a{i}", adapter)
    tokenizer = engine.tokenizer

    def text(adapter: str | None, prompt_ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return engine.generate([Request("r", prompt_ids, params, adapter)])["r"][0].text

    text.tokenizer = tokenizer
    text.engine = engine
    return text


def test_completions_non_stream_and_stream_with_adapter(served, reference):
    client = served.client()
    prompt_ids = encode_prompt_completion(reference.tokenizer, "Once upon")[0]
    expected = reference("a0", prompt_ids, 12)
    resp = client.completions.create(model="inkling-tiny:alpha", prompt="Once upon", max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected
    assert resp.usage.prompt_tokens == len(prompt_ids) and 1 <= resp.usage.completion_tokens <= 12
    base = client.completions.create(model="inkling-tiny", prompt="Once upon", max_tokens=12, temperature=0)
    assert base.choices[0].text == reference(None, prompt_ids, 12) != expected

    chunks = list(
        client.completions.create(
            model="inkling-tiny:alpha@1",
            prompt="Once upon",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_chat_versions_aliases_n_and_logprobs(served, reference):
    client = served.client()
    messages = [{"role": "user", "content": "hi there"}]
    prompt_ids = encode_chat(reference.tokenizer, messages, add_generation_prompt=True)[0]
    v1, v2 = reference("a1", prompt_ids, 10), reference("a2", prompt_ids, 10)
    assert v1 != v2
    latest = client.chat.completions.create(model="inkling-tiny:beta", messages=messages, max_tokens=10, temperature=0)
    assert latest.choices[0].message.content == v2 and latest.choices[0].message.role == "assistant"
    pinned = client.chat.completions.create(
        model="inkling-tiny:beta@prod",
        messages=messages,
        max_tokens=10,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.message.content for c in pinned.choices] == [v1, v1]
    steps = pinned.choices[0].logprobs.content
    assert len(steps) == pinned.usage.completion_tokens // 2 and len(steps[0].top_logprobs) == 2
    assert steps[0].top_logprobs[0].logprob >= steps[0].top_logprobs[1].logprob
    stream = client.chat.completions.create(
        model="inkling-tiny:beta@1", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == v1
    completion = served.client().completions.create(
        model="inkling-tiny:alpha", prompt="abc", max_tokens=5, temperature=0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
    assert all(len(top) <= 3 for top in lp.top_logprobs)


def test_a_developer_message_is_the_system_turn(served):
    """Clients written for OpenAI's newer chat API send the system turn as "developer": the same prompt, the same
    answer as with "system"."""
    client = served.client()
    answers = {}
    for role in ("developer", "system"):
        messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
        resp = client.chat.completions.create(
            model="inkling-tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True
        )
        steps = [step.logprob for step in resp.choices[0].logprobs.content]
        answers[role] = (resp.usage.prompt_tokens, resp.choices[0].message.content, steps)
    assert answers["developer"] == answers["system"]


def test_echo_scores_the_prompt(served, reference):
    """echo + logprobs + max_tokens 0, as evaluation harnesses ask: the prompt's own logprobs."""
    client = served.client()
    resp = client.completions.create(
        model="inkling-tiny:alpha", prompt="The cat sat", max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = resp.choices[0]
    prompt_ids = encode_prompt_completion(reference.tokenizer, "The cat sat")[0]
    assert choice.text == "The cat sat" and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(prompt_ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    params = SamplingParams(max_tokens=0, prompt_logprobs=True)
    want = reference.engine.generate([Request("e", prompt_ids, params, "a0")])["e"][0].prompt_logprobs
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert lp.text_offset[-1] == len("The cat sa")
    more = client.completions.create(model="inkling-tiny:alpha", prompt="The cat sat", max_tokens=4, echo=True)
    assert more.choices[0].text.startswith("The cat sat")


def test_a_batch_of_token_id_prompts_answers_each(served):
    """A list of token-id lists is a batch of prompts, as a list of strings is (choice i*n+j: prompt i, draw j)."""
    prompts = [[5, 6, 7], [8, 9]]
    out = served.client().completions.create(
        model="inkling-tiny", prompt=prompts, max_tokens=2, n=2, temperature=0, echo=True, logprobs=0
    )
    assert len(out.choices) == 4 and out.usage.prompt_tokens == 3 + 2  # each prompt once, however many draws
    for i, prompt in enumerate(prompts):
        one = served.client().completions.create(
            model="inkling-tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0
        )
        for j in range(2):
            assert out.choices[2 * i + j].text == one.choices[0].text
            assert out.choices[2 * i + j].logprobs.tokens == one.choices[0].logprobs.tokens


def test_token_ids_past_the_tokenizers_are_taken_up_to_the_models_vocabulary(served):
    """inkling-tiny's vocabulary is padded past its tokenizer's 263 ids to 384, and the model can sample those ids:
    a prompt holding one is answered (its text is empty), as the trainer takes it; one past the model's is a 400."""
    out = served.client().completions.create(
        model="inkling-tiny", prompt=[5, 300, 6], max_tokens=2, temperature=0, echo=True, logprobs=0
    )
    assert out.choices[0].logprobs.tokens[1] == "" and out.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model="inkling-tiny", prompt=[5, 384], max_tokens=2)
    assert err.value.body["param"] == "prompt" and "[0, 384)" in err.value.body["message"]


def test_seeded_sampling_is_repeatable(served):
    client = served.client()
    kw = dict(model="inkling-tiny:alpha", prompt="seed", max_tokens=8, temperature=1.0, top_p=0.9)
    one = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == one


@pytest.mark.parametrize(
    "model,status,code",
    [
        ("inkling-tiny:nope", 404, "model_not_found"),
        ("inkling-tiny:secret", 404, "model_not_found"),  # tenant b's adapter: not found for tenant a
        ("inkling-tiny:alpha@9", 404, "model_not_found"),
        ("inkling-tiny:elsewhere", 400, "model_mismatch"),  # trained on tiny-other
        ("no-such-base", 404, "model_not_found"),
        ("inkling-tiny:", 404, "model_not_found"),
    ],
)
def test_bad_models_are_4xx_openai_errors(served, model, status, code):
    with pytest.raises(openai.APIStatusError) as err:
        served.client().completions.create(model=model, prompt="x", max_tokens=2)
    assert err.value.status_code == status
    body = err.value.body
    assert body["code"] == code and body["message"] and body["param"] == "model"


@pytest.mark.parametrize(
    "kwargs,param,code",
    [
        ({"temperature": 5}, "temperature", "invalid_parameter"),
        ({"top_p": 0}, "top_p", "invalid_parameter"),
        ({"max_tokens": 0}, "max_tokens", "invalid_parameter"),
        ({"n": 0}, "n", "invalid_parameter"),
        ({"max_tokens": 2000}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "x" * 1100}, "prompt", "context_length_exceeded"),
        ({"max_tokens": "many"}, "max_tokens", "invalid_parameter"),
        ({"prompt": [[5, 6], "x"]}, "prompt", "invalid_parameter"),
        ({"prompt": [5, True]}, "prompt", "invalid_parameter"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ({"logit_bias": {"42": 5}}, "logit_bias", "unsupported_parameter"),
        ({"suffix": "}"}, "suffix", "unsupported_parameter"),
        ({"best_of": 3, "n": 1}, "best_of", "unsupported_parameter"),
        ({"seed": 2**64}, "seed", "invalid_parameter"),  # beyond every 64-bit reading
        ({"seed": -(2**63) - 1}, "seed", "invalid_parameter"),
        ({"seed": 1.5}, "seed", "invalid_parameter"),
        ({"seed": "7"}, "seed", "invalid_parameter"),
    ],
)
def test_bad_parameters_are_400(served, kwargs, param, code):
    args = {"model": "inkling-tiny:alpha", "prompt": "x", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(**args)
    assert err.value.body["code"] == code and err.value.body["param"] == param


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_chat_parameters_are_400_under_the_names_sent(served, kwargs, param):
    """The chat's own names (top_logprobs, max_completion_tokens), not the engine's (logprobs, max_tokens)."""
    args = {"model": "inkling-tiny", "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(**args)
    assert err.value.body["code"] == "invalid_parameter" and err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(f"{param}: "), err.value.body


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_chat_features_the_engine_lacks_are_refused_not_ignored(served, kwargs, param):
    """Tools, constrained output and image parts: a 400 naming them, where they were dropped without a word."""
    args = {"model": "inkling-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(**{**args, **kwargs})
    assert err.value.body["param"].split(".")[0] == param, err.value.body
    neutral = {"tool_choice": "none", "response_format": {"type": "text"}}  # asking for nothing is fine
    texts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    ok = served.client().chat.completions.create(
        **{**args, **neutral, "messages": [{"role": "user", "content": texts}]}, temperature=0
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_raw_http_errors(served):
    with served.http() as http:
        resp = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
        resp = http.post("/v1/chat/completions", json={"model": "inkling-tiny", "messages": []})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
        resp = http.post("/v1/chat/completions", json={"model": "inkling-tiny", "messages": [{"role": "x"}]})
        assert resp.status_code == 400
        tool_turn = {"role": "tool", "content": "42", "tool_call_id": "c1"}
        resp = http.post("/v1/chat/completions", json={"model": "inkling-tiny", "messages": [tool_turn]})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "messages.0.role"
        assert "role must be one of assistant, developer, system, user, got 'tool'" in error["message"]
    resp = httpx.post(f"{served.url}/v1/completions", json={"model": "inkling-tiny", "prompt": "x"})
    assert resp.status_code == 401


def test_full_workers_answer_429_with_retry_after(served):
    """Three long streams fill the worker (max 3 in flight); the fourth request is refused."""
    body = {"model": "inkling-tiny", "prompt": "x", "max_tokens": 900, "temperature": 0, "stream": True}
    with served.http() as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            resp = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
            assert resp.json()["error"]["type"] == "rate_limit_error"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    deadline = time.monotonic() + 30
    while True:  # closing the streams aborts their requests, which frees the worker
        try:
            ok = served.client().completions.create(model="inkling-tiny", prompt="x", max_tokens=2, temperature=0)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "closed streams never freed the worker"
            time.sleep(0.2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_dead_worker_fails_its_requests_with_503_and_is_restarted(served):
    client = served.client()
    client.completions.create(model="inkling-tiny", prompt="x", max_tokens=1)  # the worker is up
    router = served.app.state.serving.router
    (worker,) = router.workers["inkling-tiny"]
    errors: list[Exception] = []

    def long_request():
        try:
            client.completions.create(model="inkling-tiny", prompt="x", max_tokens=900, temperature=0)
        except openai.APIStatusError as exc:
            errors.append(exc)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.inflight == 0:
        assert time.monotonic() < deadline, "the request never reached the worker"
        time.sleep(0.05)
    loaders = _children(worker.process.pid)
    assert loaders, "the worker has no colocated loader process"
    worker.process.kill()  # the worker process this service started
    thread.join(60)
    assert len(errors) == 1 and errors[0].status_code == 503
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in loaders):
        assert time.monotonic() < deadline, "the killed worker's loader outlived it"
        time.sleep(0.2)
    assert errors[0].body["code"] == "worker_unavailable"
    again = client.completions.create(model="inkling-tiny:alpha", prompt="x", max_tokens=3, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
    assert router.workers["inkling-tiny"][0] is not worker


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def _children(pid: int) -> list[int]:
    """Live child processes of `pid`, read from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_64_bit_seed_answers_and_the_worker_keeps_serving(served):
    """A seed that is a valid 64-bit integer but overflowed the choices' generator seeds once killed the worker
    (and every request in flight on it): now it samples like any seed, repeatably and per choice."""
    client = served.client()
    client.completions.create(model="inkling-tiny", prompt="x", max_tokens=1)  # the worker is up
    (worker,) = served.app.state.serving.router.workers["inkling-tiny"]
    kw = dict(model="inkling-tiny:alpha", prompt="seed", max_tokens=8, temperature=1.0, n=2)
    for seed in (18446744073709551, 2**64 - 1, -(2**63)):
        one = client.completions.create(seed=seed, **kw)
        assert [c.finish_reason in ("stop", "length") for c in one.choices] == [True, True]
        again = client.completions.create(seed=seed, **kw)
        assert [c.text for c in again.choices] == [c.text for c in one.choices]
    chat = client.chat.completions.create(
        model="inkling-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=18446744073709551
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert worker.alive and served.app.state.serving.router.workers["inkling-tiny"] == [worker]


def _send(served: Served, path: str, body: dict) -> socket.socket:
    """POST `body` on a raw connection and return it unread: closing it is a client walking away."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {served.keys['a']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", urlsplit(served.url).port))
    sock.sendall(head.encode() + data)
    return sock


def test_abandoned_non_streaming_completions_free_their_slots(served):
    """Clients that give up on a non-streaming completion must not keep its slot: once their connections close,
    their requests are aborted, so the full worker takes new requests at once instead of decoding for nobody."""
    client = served.client()
    client.completions.create(model="inkling-tiny", prompt="x", max_tokens=1)  # the worker is up
    (worker,) = served.app.state.serving.router.workers["inkling-tiny"]
    long = {"model": "inkling-tiny", "max_tokens": 900, "temperature": 0, "n": 16}  # each: seconds of decoding
    socks = [
        _send(served, "/v1/completions", {**long, "prompt": "hello world"}),
        _send(served, "/v1/completions", {**long, "prompt": "hello world"}),
        _send(served, "/v1/chat/completions", {**long, "messages": [{"role": "user", "content": "story time"}]}),
    ]
    try:
        deadline = time.monotonic() + 30
        while worker.inflight < 3:  # all three are on the worker (max 3 in flight): it is full
            assert time.monotonic() < deadline, "the requests never reached the worker"
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 5
    while worker.inflight:
        assert time.monotonic() < deadline, "requests of clients that went away still hold their slots"
        time.sleep(0.05)
    started = time.monotonic()
    ok = client.completions.create(model="inkling-tiny", prompt="x", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert time.monotonic() - started < 5, "the engine is still decoding the abandoned choices"


def _assert_retry_semantics(resp: httpx.Response) -> dict:
    """The error body of `resp`: retryable exactly for 429 and 503, which also say when (Retry-After)."""
    error = resp.json()["error"]
    retryable = resp.status_code in (429, 503)
    assert error["details"]["retryable"] is retryable, (resp.status_code, error)
    if retryable:
        assert int(resp.headers["Retry-After"]) >= 1
    return error


def test_an_adapter_that_fails_to_load_is_503_without_internals(served, tiny_adapters, tmp_path, monkeypatch):
    """A load failure names the problem; the S3 endpoint, object keys and tenant id stay in the server log."""
    directory = save_adapter(tiny_adapters[3], tmp_path / "broken", "sglang", load_base_config(served.model_dir))
    with served.http() as http:
        _import(http, "broken", "inkling-tiny", directory)
    tenant, store = served.tenant_ids["a"], served.app.state.store
    store.put_bytes(object_key(tenant, "broken", 1, "sglang", "adapter_model.safetensors"), b"x", create_only=False)
    body = {"model": "inkling-tiny:broken", "prompt": "x", "max_tokens": 2}
    with served.http() as http:
        corrupt = http.post("/v1/completions", json=body)
        resolver = served.app.state.serving.resolver
        real, down = resolver.resolve, f"http://127.0.0.1:{_free_port()}"

        def unreachable(tenant_id, name):  # the same adapter, its S3 endpoint down
            resolved = real(tenant_id, name)
            source = dataclasses.replace(resolved.adapter.source, endpoint=down)
            adapter = dataclasses.replace(resolved.adapter, key=f"{resolved.adapter.key}#down", source=source)
            return dataclasses.replace(resolved, adapter=adapter)

        monkeypatch.setattr(resolver, "resolve", unreachable)
        unreached = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}]})
    for resp in (corrupt, unreached):
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "adapter_load_failed" and error["param"] == "model" and error["message"]
        for internal in (tenant, store.endpoint, down, "127.0.0.1", "adapters/", "sglang/", "safetensors"):
            assert internal not in error["message"], (internal, error["message"])
        _assert_retry_semantics(resp)


def test_an_adapter_unloaded_before_its_request_arrives_is_a_retryable_503(served, monkeypatch):
    """Another request's load may unload an idle adapter (to make room) after it was loaded for this request and
    before the request reaches the worker: the engine refuses the request as `adapter_not_loaded`, no fault of the
    request's. A 503 with Retry-After, streaming or not, and the next try loads the adapter again."""
    client = served.client()
    client.completions.create(model="inkling-tiny", prompt="x", max_tokens=1)  # the worker is up
    (worker,) = served.app.state.serving.router.workers["inkling-tiny"]
    load = worker.load_adapter

    async def load_then_lose(key, source, pinned=False):
        await load(key, source, pinned)
        await worker.unload_adapter(key)  # what an eviction by another request's load does, at the worst moment

    monkeypatch.setattr(worker, "load_adapter", load_then_lose)
    body = {"model": "inkling-tiny:alpha", "prompt": "x", "max_tokens": 2}
    with served.http() as http:
        resp = http.post("/v1/completions", json=body)
        streamed = http.post("/v1/completions", json={**body, "stream": True})
    monkeypatch.undo()
    assert resp.status_code == 503, resp.text
    error = _assert_retry_semantics(resp)
    assert error["code"] == "adapter_not_loaded" and error["param"] == "model"
    assert served.tenant_ids["a"] not in error["message"]
    event = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
    assert event["error"]["code"] == "adapter_not_loaded" and event["error"]["details"]["retryable"] is True
    again = client.completions.create(model="inkling-tiny:alpha", prompt="x", max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_more_prompts_than_ever_fit_is_400_and_full_is_429(served):
    """A request of more prompts than the workers ever hold in flight can never be served: a 400 saying how many
    fit, not a 429 to retry forever; a request that fits gets its answer."""
    with served.http() as http:
        resp = http.post("/v1/completions", json={"model": "inkling-tiny", "prompt": ["x"] * 1000, "max_tokens": 2})
        assert resp.status_code == 400, resp.text
        error = _assert_retry_semantics(resp)
        assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
        assert "1000" in error["message"] and "at most 3" in error["message"]
        resp = http.post("/v1/completions", json={"model": "inkling-tiny", "prompt": ["x"] * 4, "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_prompts"
        fits = http.post(
            "/v1/completions", json={"model": "inkling-tiny", "prompt": ["x"] * 3, "max_tokens": 2, "n": 2}
        )
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 6


def test_error_bodies_say_retryable_only_for_429_and_503(served):
    """4xx: the caller must change something (retryable false); 429 and 503: retry later (true, Retry-After)."""
    body = {"model": "inkling-tiny", "prompt": "x", "max_tokens": 2}
    with served.http() as http:
        answers = [
            http.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}),
            http.post("/v1/completions", json={**body, "temperature": 9}),
            http.post("/v1/completions", json={**body, "seed": 2**64}),
            http.post("/v1/completions", json={**body, "model": "inkling-tiny:nope"}),
            http.post("/v1/completions", json={**body, "model": "inkling-tiny:elsewhere"}),
            http.post("/v1/completions", json={**body, "prompt": ["x"] * 4}),
            http.post(
                "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
            ),
            httpx.post(f"{served.url}/v1/completions", json=body),  # no API key
        ]
        # greedy from "x", as the 429 test above: a sampled stream can draw the end token within its first steps,
        # finish, and free its slot before the last request arrives
        long = {**body, "max_tokens": 900, "temperature": 0, "stream": True}
        streams = [http.stream("POST", "/v1/completions", json=long) for _ in range(3)]
        try:
            assert all(s.__enter__().status_code == 200 for s in streams)
            answers.append(http.post("/v1/completions", json=body))  # the worker is full
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert [r.status_code for r in answers] == [400, 400, 400, 404, 400, 400, 400, 401, 429]
    for resp in answers:
        _assert_retry_semantics(resp)


def test_a_request_is_answered_while_another_process_holds_the_databases_write_lock(served):
    """Naming a model only reads the registry, and SQLite's WAL readers never wait for its writer: a request is
    answered while another process (a job worker, a training session's publish) holds the write lock, where a
    resolve that took that lock would wait for it, up to the 60 s busy timeout, and then fail."""
    with sqlite_write_lock(served.app.state.settings), served.http() as http:
        for model in ("inkling-tiny", "inkling-tiny:alpha", "inkling-tiny:beta@prod"):
            body = {"model": model, "prompt": "hello", "max_tokens": 2}
            resp = http.post("/v1/completions", json=body, timeout=20)
            assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, resp.text
