"""Training sessions driven through the SDK against the real service (SQLite, SeaweedFS, session and serving
worker processes) on inkling-tiny in fp32: the primitives compute what the SFT job computes, states resume
exactly, sampler weights reach the serving tier, and bad input is refused without touching the session."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import peft
import pytest
import torch

from inkwell import sdk
from inkwell.models import load_base_model
from inkwell.sdk.errors import RequestFailedError, SessionClosedError
from inkwell.sdk.sessions import LEFT_OPEN_CLOSE_SECONDS
from inkwell.service.sessions.handle import SessionHandle
from inkwell.service.sessions.manager import SessionManager
from inkwell.trainer import TrainCallbacks, TrainEvent, train
from inkwell.trainer.config import parse_config
from inkwell.trainer.dataset import RowStream
from inkwell.trainer.prepare import prepare
from tests.service.helpers import Service, make_settings, sqlite_write_lock, start_service
from tests.trainer.helpers import reverse_sample, tiny_job

SESSION_ENV = {"INKWELL_SESSION_IDLE_SECONDS": "6", "INKWELL_SESSION_REAP_INTERVAL": "0.5"}
LORA = {"rank": 2, "alpha": 4}
ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def service(seaweed, tmp_path_factory) -> Iterator[Service]:
    """A service whose sessions go idle after 6 s (the SDK's heartbeats keep its own sessions open)."""
    saved = {k: os.environ.get(k) for k in SESSION_ENV}
    os.environ.update(SESSION_ENV)
    try:
        svc = start_service(make_settings(tmp_path_factory.mktemp("svc-sessions"), None, seaweed))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def tenant(service) -> tuple[str, str]:
    return service.new_tenant("sessions")


@pytest.fixture(scope="module")
def client(service, tenant) -> Iterator[sdk.Client]:
    with sdk.Client(service.url, tenant[1]) as c:
        yield c


def _base(service: Service) -> Path:
    return service.settings.data_dir / "models" / "inkling-tiny"


def _job_batches(config, steps: int) -> list[list[dict]]:
    """The SFT job's own batches as datums: one per packed sample, weights = its loss mask over the completion
    tokens of the whole step (the job's mean)."""
    prep = prepare(config)
    stream = RowStream(prep.train, config.seq_len, prep.pad_id, config.seed)
    batches = []
    for step in range(steps):
        rows = stream.rows(step * config.batch_size, config.batch_size)
        denominator = max(rows.loss_tokens, 1)
        datums = []
        for r in range(rows.input_ids.shape[0]):
            for seg in rows.segments[r].unique().tolist():
                where = rows.segments[r] == seg
                if rows.loss_mask[r][where].sum() == 0:
                    continue  # the row's padding
                datums.append(
                    {
                        "tokens": rows.input_ids[r][where].tolist(),
                        "loss_fn_inputs": {
                            "target_tokens": rows.targets[r][where].tolist(),
                            "weights": (rows.loss_mask[r][where] / denominator).tolist(),
                        },
                    }
                )
        batches.append(datums)
    return batches


def test_supervised_steps_reach_the_sft_jobs_losses(service, client, tmp_path):
    steps = 4
    config = parse_config(
        tiny_job(
            _base(service),
            reverse_sample(tmp_path / "reverse.jsonl", 24),
            tmp_path / "job",
            lr_schedule="constant",
            learning_rate=5e-3,
            max_steps=steps,
            checkpoint_every=0,
            max_grad_norm=1.0,
        )
    )
    losses: list[float] = []

    class Record(TrainCallbacks):
        def on_event(self, event: TrainEvent) -> None:
            losses.append(event.loss)

    batches = _job_batches(config, steps)
    train(config, Record())
    with client.sessions.create("inkling-tiny", lora=LORA, seed=config.seed) as session:
        session_losses = []
        for datums in batches:
            out = session.forward_backward(datums, "cross_entropy").result(timeout=120)
            session_losses.append(out["metrics"]["loss:sum"])
            session.optim_step(learning_rate=5e-3, grad_clip_norm=1.0, **ADAM).result(timeout=60)
    assert len(losses) == steps
    assert max(abs(a - b) for a, b in zip(losses, session_losses, strict=True)) < 1e-5, (losses, session_losses)
    assert session_losses[-1] < session_losses[0]


def _datum(tokens: list[int]) -> dict:
    return {
        "tokens": tokens[:-1],
        "loss_fn_inputs": {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    }


def test_a_saved_state_resumes_bit_for_bit(client):
    data = [_datum([5, 9, 12, 40, 41, 7, 3, 2]), _datum([8, 8, 1, 22, 90])]
    adam = {"learning_rate": 1e-2, **ADAM}
    with client.sessions.create("inkling-tiny", lora=LORA, seed=3) as first:
        first.forward_backward(data).result(timeout=120)
        first.optim_step(**adam).result(timeout=60)
        saved = first.save_state("after-one").result(timeout=60)
        assert saved == {"state": f"{first.id}/after-one", "step": 1}
        first.forward_backward(data).result(timeout=60)
        first.optim_step(**adam).result(timeout=60)
        expected = first.forward(data).result(timeout=60)["logprobs"]
    with client.sessions.from_state("inkling-tiny", saved["state"]) as resumed:
        resumed.forward_backward(data).result(timeout=120)
        assert resumed.refresh().info.step == 1
        step = resumed.optim_step(**adam).result(timeout=60)
        assert step["step"] == 2
        assert resumed.forward(data).result(timeout=60)["logprobs"] == expected  # exactly, float for float


def test_sampler_weights_sample_as_the_trainer_scores(client, service, tenant, tmp_path):
    """save_weights_for_sampler publishes a version the serving tier samples from at once; the sampler's logprobs
    of its own tokens equal compute_logprobs and the trainer's forward on the same tokens (fp32, CPU)."""
    data = [_datum([5, 9, 12, 40, 41, 7, 3, 2, 11, 13])]
    with client.sessions.create("inkling-tiny", lora=LORA, seed=1, adapter_name="sess-sampler") as session:
        for _ in range(3):
            session.forward_backward(data).result(timeout=120)
            session.optim_step(learning_rate=3e-2, **ADAM).result(timeout=60)
        weights = session.save_weights_for_sampler("step-3").result(timeout=120)
        assert weights.model == f"inkling-tiny:sess-sampler@{weights.version}" and weights.step == 3
        # the adapter reached the serving workers with the save itself (in memory), before any request named it
        workers = service.app.state.serving.router.workers["inkling-tiny"]
        assert any(f"{tenant[0]}/sess-sampler@{weights.version}" in w.adapters for w in workers)
        version = client.adapters.version("sess-sampler", "step-3")
        assert version.version == weights.version and version.lineage.source == "session"
        sampler = session.sampling_client(weights)
        prompt = [5, 9, 12, 40]
        out = sampler.sample(prompt, num_samples=2, max_tokens=6, temperature=0.0).result(timeout=120)
        seqs = out["sequences"]
        assert len(seqs) == 2 and seqs[0]["tokens"] == seqs[1]["tokens"] and 1 <= len(seqs[0]["tokens"]) <= 6
        assert seqs[0]["finish_reason"] == ("length" if len(seqs[0]["tokens"]) == 6 else "stop")
        full = prompt + seqs[0]["tokens"]
        scored = sampler.compute_logprobs(full).result(timeout=120)
        assert scored[0] is None
        gap = max(abs(a - b) for a, b in zip(scored[len(prompt) :], seqs[0]["logprobs"], strict=True))
        assert gap < 1e-4, gap
        trained = session.forward([_datum(full)]).result(timeout=60)["logprobs"][0]
        gap = max(abs(a - b) for a, b in zip(trained[len(prompt) - 1 :], seqs[0]["logprobs"], strict=True))
        assert gap < 1e-4, gap
        # the sampler's routing traces, fed back with its logprobs, replay its experts (docs/api.md's recipe)
        traced = sampler.sample(prompt, max_tokens=6, temperature=0.0, return_routing=True, prompt_routing=True)
        traced = traced.result(timeout=120)
        seq, pad = traced["sequences"][0], [0.0] * (len(prompt) - 1)
        assert seq["tokens"] == seqs[0]["tokens"] and traced["prompt_routing"][0] is None
        assert len(seq["routing"]) == len(seq["tokens"]) and out["sequences"][0]["routing"] is None
        # the k likeliest tokens at each sampled position: greedy took the first, with its own logprob
        top = sampler.sample(prompt, max_tokens=6, temperature=0.0, topk_logprobs=2).result(timeout=120)
        rows = top["sequences"][0]["topk_logprobs"]
        assert [row[0][0] for row in rows] == seqs[0]["tokens"] and all(len(row) == 2 for row in rows)
        assert [row[0][1] for row in rows] == pytest.approx(seqs[0]["logprobs"], abs=1e-6)
        assert "topk_logprobs" not in seqs[0]
        rl = {
            "tokens": full[:-1],
            "loss_fn_inputs": {
                "target_tokens": full[1:],
                "logprobs": pad + seq["logprobs"],
                "advantages": pad + [1.0] * len(seq["tokens"]),
            },
            "routing": traced["prompt_routing"][1:] + seq["routing"],
        }
        metrics = session.forward([rl], "importance_sampling").result(timeout=60)["metrics"]
        assert abs(metrics["kl_k1:mean"]) < 1e-4 and metrics["logprob_diff:max"] < 1e-4, metrics
        # the oracle: transformers' Inkling with the published version's peft layout decodes the same greedy tokens
        got = client.adapters.download("sess-sampler", weights.version, layout="peft", dest=tmp_path / "peft")
        model = peft.PeftModel.from_pretrained(load_base_model(_base(service)), str(got.path)).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in seqs[0]["tokens"]:
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert ids[0, len(prompt) :].tolist() == seqs[0]["tokens"]
        base = client.sampling_client("inkling-tiny").sample(prompt, max_tokens=6, temperature=0.0).result(timeout=120)
        assert base["sequences"][0]["logprobs"] != seqs[0]["logprobs"]  # the adapter, not the base, answered


def test_bad_input_is_refused_and_leaves_the_session_as_it_was(client, service, tenant):
    good = [_datum([5, 9, 12, 40, 41])]
    with client.sessions.create("inkling-tiny", lora=LORA, seed=2) as session:
        before = session.forward(good).result(timeout=120)["logprobs"]
        bad = [
            good[0],
            {"tokens": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, 1.0]}},
        ]
        with pytest.raises(sdk.ValidationError) as err:
            session.forward_backward(bad)
        assert err.value.details["index"] == 1 and "target_tokens" in err.value.details["field"]
        for datums, loss, field in [
            ([_datum([1, 2, 10**9])], "cross_entropy", "target_tokens"),
            (good, "stable_reinforce", "loss_fn"),
            ([{"tokens": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}], "importance_sampling", "logprobs"),
        ]:
            with pytest.raises(sdk.ValidationError) as err:
                session.forward_backward(datums, loss)
            assert field in str(err.value.details.get("field")), err.value
        short = dict(good[0], routing=[[[0, 1]] * 3] * 3)  # a routing trace of 3 positions for 4 tokens
        with pytest.raises(sdk.ValidationError) as err:
            session.forward_backward([good[0], short])
        assert (err.value.details["index"], err.value.details["field"]) == (1, "routing") and err.value.status == 422
        nan = dict(good[0], loss_fn_inputs={**good[0]["loss_fn_inputs"], "weights": [1.0, float("nan"), 1.0, 1.0]})
        with pytest.raises(sdk.ValidationError) as err:  # refused by the SDK: JSON has no NaN
            session.forward_backward([good[0], nan])
        assert (err.value.details["index"], err.value.details["field"]) == (1, "loss_fn_inputs.weights")
        headers = {"Authorization": f"Bearer {tenant[1]}", "Content-Type": "application/json"}
        body = json.dumps({"data": [good[0], nan]})  # Python's json writes NaN; the service names it
        with httpx.Client(base_url=service.url, headers=headers) as raw:
            answer = raw.post(f"/v1/sessions/{session.id}/forward_backward", content=body)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["details"] | {"retryable": False} == {
            "retryable": False,
            "field": "loss_fn_inputs.weights",
            "index": 1,
        }
        session.optim_step(learning_rate=1e-1, **ADAM).result(timeout=60)
        # the refused requests added no gradient: the step had nothing to apply
        assert session.forward(good).result(timeout=60)["logprobs"] == before
        # another tenant can neither see the session nor read its futures
        future = session.forward(good)
        _, other_key = service.new_tenant("intruder")
        with sdk.Client(service.url, other_key) as other:
            with pytest.raises(sdk.NotFoundError):
                other.sessions.get(session.id)
            with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {other_key}"}) as raw:
                assert raw.get(f"/v1/futures/{future.id}").status_code == 404
        future.result(timeout=60)


def test_capacity_idle_timeout_and_a_dead_worker(client, service, tenant):
    """Two sessions fit (the default); a third is a 429 with Retry-After. A session without heartbeats is
    closed after its idle timeout and says why; a session whose worker dies fails its pending futures retryably."""
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as raw:
        quiet = raw.post("/v1/sessions", json={"base_model": "inkling-tiny", "lora": LORA}).json()
        with client.sessions.create("inkling-tiny", lora=LORA) as busy:
            third = raw.post("/v1/sessions", json={"base_model": "inkling-tiny", "lora": LORA})
            assert third.status_code == 429 and third.headers["Retry-After"] == "10"
            assert third.json()["error"]["code"] == "too_many_sessions"
            deadline = time.monotonic() + 30
            while raw.get(f"/v1/sessions/{quiet['id']}").json()["state"] != "closed":
                assert time.monotonic() < deadline, "the idle session was never closed"
                time.sleep(0.5)
            gone = raw.post(f"/v1/sessions/{quiet['id']}/heartbeat")
            assert gone.status_code == 410 and gone.json()["error"]["code"] == "session_idle_timeout"
            assert "idle timeout" in gone.json()["error"]["message"]
            busy.forward([_datum([1, 2, 3])]).result(timeout=120)  # heartbeats kept it open
            pid = service.app.state.sessions.sessions[busy.id].handle.process.pid
            pending = busy.forward([_datum([1, 2, 3, 4] * 30)])
            os.kill(pid, 9)
            with pytest.raises(RequestFailedError) as err:
                pending.result(timeout=60)
            assert err.value.code == "session_worker_died" and err.value.retryable
            deadline = time.monotonic() + 10
            while busy.refresh().info.state != "closed":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            with pytest.raises(SessionClosedError):
                busy.forward([_datum([1, 2, 3])])
            busy._stop.set()


def test_a_session_left_open_closes_with_its_client_and_at_its_programs_exit(service, tenant):
    """The session's heartbeats end with its client or its program: it is closed then (by its owner), not held
    until the idle timeout (6 s here; 10 minutes by default)."""
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as raw:

        def closed_code(session_id: str) -> str | None:
            return raw.get(f"/v1/sessions/{session_id}").json()["closed_code"]

        with sdk.Client(service.url, tenant[1]) as own:
            left = own.sessions.create("inkling-tiny", lora=LORA)
            assert closed_code(left.id) is None
        assert closed_code(left.id) == "closed_by_owner"

        async def left_open_by_an_async_client() -> str:
            async with sdk.AsyncClient(service.url, tenant[1]) as own:
                return (await own.sessions.create("inkling-tiny", lora=LORA)).id

        assert closed_code(asyncio.run(left_open_by_an_async_client())) == "closed_by_owner"
        script = (
            "from inkwell import sdk\n"
            f"client = sdk.Client({service.url!r}, {tenant[1]!r})\n"
            f"print(client.sessions.create('inkling-tiny', lora={LORA!r}).id)\n"
        )
        async_script = (  # asyncio.run ends without aclose: its loop is gone when the program's exit closes it
            "import asyncio\n"
            "from inkwell import sdk\n"
            "async def main():\n"
            f"    client = sdk.AsyncClient({service.url!r}, {tenant[1]!r})\n"
            f"    print((await client.sessions.create('inkling-tiny', lora={LORA!r})).id)\n"
            "asyncio.run(main())\n"
        )
        for program in (script, async_script):
            ended = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
            assert ended.returncode == 0, ended.stderr
            assert closed_code(ended.stdout.strip()) == "closed_by_owner", program


def test_creates_at_once_never_overfill_the_slots_and_a_bad_one_is_told_so(service, tenant):
    """Four creates at once take the free slots and no more; with every slot taken, a create for an unknown base
    model is a 404 (it was a 429, which the Tinker client retried for 100 s before it gave up on a typo)."""
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    body = {"base_model": "inkling-tiny", "lora": LORA}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as raw:
        free = 2 - sum(s["state"] != "closed" for s in raw.get("/v1/sessions").json()["data"])
        with ThreadPoolExecutor(4) as pool:
            created = list(pool.map(lambda _: raw.post("/v1/sessions", json=body), range(4)))
        try:
            assert sorted(r.status_code for r in created) == [201] * free + [429] * (4 - free)
            unknown = raw.post("/v1/sessions", json={**body, "base_model": "llama-3"})
            assert unknown.status_code == 404 and "llama-3" in unknown.json()["error"]["message"]
        finally:
            for r in created:
                if r.status_code == 201:
                    raw.delete(f"/v1/sessions/{r.json()['id']}")


def test_a_service_slow_to_answer_does_not_hold_a_programs_exit(service, tenant, monkeypatch):
    """A program that ends with a session open closes it in one try of at most LEFT_OPEN_CLOSE_SECONDS: the
    service has it once the request arrives. Here the service answers the close 15 s late (an injected fault),
    which the program's end waited for; a service that never answered held it for the client's four 60 s reads."""
    real_close = SessionManager.close

    async def late_answer(manager: SessionManager, live, code: str, reason: str) -> None:
        await real_close(manager, live, code, reason)
        await asyncio.sleep(15)

    monkeypatch.setattr(SessionManager, "close", late_answer)
    script = (
        "from inkwell import sdk\n"
        f"client = sdk.Client({service.url!r}, {tenant[1]!r})\n"
        f"print(client.sessions.create('inkling-tiny', lora={LORA!r}).id, flush=True)\n"
    )
    program = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    session_id = program.stdout.readline().strip()
    ending = time.monotonic()
    assert program.wait(120) == 0
    assert time.monotonic() - ending < LEFT_OPEN_CLOSE_SECONDS + 3
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {tenant[1]}"}) as raw:
        assert raw.get(f"/v1/sessions/{session_id}").json()["closed_code"] == "closed_by_owner"


def test_a_session_closed_before_its_worker_launched_leaves_no_worker(service, tenant, monkeypatch):
    """Closed while its worker has not launched yet (the fork server still importing, the first session after a
    start): the worker is never launched, where it was launched after the close and held its device, unreachable,
    until the service (or a test run) waited on it forever at exit."""
    closed, started = threading.Event(), threading.Event()
    real_start, real_close = SessionHandle.start, SessionHandle.close

    def slow_launch(handle: SessionHandle, timeout: float):  # injected: the launch comes after the owner's close
        closed.wait(30)
        try:
            return real_start(handle, timeout)
        finally:
            started.set()

    def noted_close(handle: SessionHandle, timeout: float = 10.0) -> None:
        real_close(handle, timeout)
        closed.set()

    monkeypatch.setattr(SessionHandle, "start", slow_launch)
    monkeypatch.setattr(SessionHandle, "close", noted_close)
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as raw:
        opened = raw.post("/v1/sessions", json={"base_model": "inkling-tiny", "lora": LORA}).json()
        assert opened["state"] == "starting"
        assert raw.delete(f"/v1/sessions/{opened['id']}").json()["closed_code"] == "closed_by_owner"
    assert started.wait(60), "the session's start never returned"
    process = service.app.state.sessions.sessions[opened["id"]].handle.process
    if process.is_alive():
        process.kill()  # not left to hang the test run at its exit
        pytest.fail("the closed session's worker was launched after its close and kept running")
    assert process.pid is None


def test_importance_sampling_with_the_samplers_own_logprobs_is_cross_entropys_gradient(client):
    tokens = [5, 9, 12, 40, 41, 7]
    data = [_datum(tokens)]
    adam = {"learning_rate": 1e-2, **ADAM}
    with (
        client.sessions.create("inkling-tiny", lora=LORA, seed=4) as a,
        client.sessions.create("inkling-tiny", lora=LORA, seed=4) as b,
    ):
        logprobs = a.forward(data).result(timeout=120)["logprobs"][0]
        rl = {
            "tokens": tokens[:-1],
            "loss_fn_inputs": {"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": [1.0] * 5},
        }
        out = a.forward_backward([rl], "importance_sampling").result(timeout=60)
        assert torch.allclose(torch.tensor(out["logprobs"][0]), torch.tensor(logprobs))
        b.forward_backward(data, "cross_entropy").result(timeout=120)
        a.optim_step(**adam).result(timeout=60)
        b.optim_step(**adam).result(timeout=60)
        after_a = a.forward(data).result(timeout=60)["logprobs"][0]
        after_b = b.forward(data).result(timeout=60)["logprobs"][0]
        # K targets per token on /v1 (Tinker's top-K cross entropy): [N][K] logprobs, column 0 the datum's own
        wide = {
            "tokens": tokens[:-1],
            "loss_fn_inputs": {"target_tokens": [[t, 7] for t in tokens[1:]], "weights": [[1.0, 0.5]] * 5},
        }
        both = a.forward([wide]).result(timeout=60)["logprobs"][0]
        assert [len(row) for row in both] == [2] * 5
        assert [row[0] for row in both] == pytest.approx(after_a, abs=1e-6)
    assert max(abs(x - y) for x, y in zip(after_a, after_b, strict=True)) < 1e-6
    assert after_a != logprobs


def test_a_session_starts_and_the_service_answers_while_another_process_holds_the_write_lock(service, tenant):
    """Creating a session reads its base model's row, off the event loop and without the write lock (SQLite's WAL
    readers never wait for its writer): it starts, and the service answers beside it, while a job worker, say,
    holds that lock. A read with the write lock on the event loop froze every route for up to the 60 s busy
    timeout."""
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    with sqlite_write_lock(service.settings), httpx.Client(base_url=service.url, headers=headers, timeout=20) as raw:
        with ThreadPoolExecutor(1) as pool:
            created = pool.submit(raw.post, "/v1/sessions", json={"base_model": "inkling-tiny", "lora": LORA})
            assert raw.get("/v1/sessions").status_code == 200
            session = created.result()
        assert session.status_code == 201, session.text
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as raw:
        raw.delete(f"/v1/sessions/{session.json()['id']}")
