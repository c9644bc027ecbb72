"""Client against the real service (uvicorn + SQLite + SeaweedFS): datasets, jobs, events,
the registry (import, download with sha256 checks, aliases, deletes), errors and tenants."""

import asyncio
import hashlib
import json
import re
import threading
import time

import pytest

from inkwell import sdk

CHAT = [
    {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}!"}]} for i in range(4)
]


def test_models_and_datasets(api, tmp_path):
    client, _ = api
    assert "inkling-tiny" in [m.id for m in client.models.list()]
    assert client.models.get("inkling-tiny").num_hidden_layers == 4
    with pytest.raises(sdk.NotFoundError) as err:
        client.models.get("llama-7b")
    assert err.value.code == "unknown_base_model" and "inkling-tiny" in err.value.details["known"]

    from_list = client.datasets.upload(CHAT)
    assert (from_list.format, from_list.num_examples) == ("chat", 4)
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    from_path = client.datasets.upload(path, name="arith")
    assert (from_path.name, from_path.format, from_path.num_examples) == ("arith", "prompt_completion", 1)
    assert from_path.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert client.datasets.get(from_list.id).sha256 == from_list.sha256

    page = client.datasets.list(limit=1)
    assert [d.id for d in page] == [from_path.id] and page.next_cursor
    assert [d.id for d in client.datasets.iter(page_size=1)] == [from_path.id, from_list.id]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHAT[0]) + "\n{not json\n")
    with pytest.raises(sdk.ValidationError) as err:
        client.datasets.upload(bad)
    assert err.value.status == 422 and err.value.code == "invalid_dataset" and err.value.details["line"] == 2
    big = tmp_path / "big.jsonl"
    big.write_text((json.dumps({"prompt": "x" * 1000, "completion": "y"}) + "\n") * 2500)
    with pytest.raises(sdk.PayloadTooLargeError) as err:
        client.datasets.upload(big)
    assert err.value.details["limit_bytes"] == 2 * 1024 * 1024
    with pytest.raises(sdk.NotFoundError):
        client.datasets.get("ds_" + "0" * 24)


def test_wrong_key_and_other_tenants(api, sqlite_service):
    client, _ = api
    with sdk.Client(sqlite_service.url, "ink_not-a-key") as stranger, pytest.raises(sdk.AuthenticationError) as err:
        stranger.models.list()
    assert err.value.status == 401 and err.value.code == "unauthorized"
    dataset = client.datasets.upload(CHAT)
    job = client.train("inkling-tiny", dataset.id, adapter_name="mine", wait=False, max_steps=2)
    job.cancel()
    _, other_key = sqlite_service.new_tenant("other")
    with sdk.Client(sqlite_service.url, other_key) as other:
        for call in (lambda: other.datasets.get(dataset.id), lambda: other.jobs.get(job.id)):
            with pytest.raises(sdk.NotFoundError):
                call()
        assert list(other.jobs.iter()) == [] and list(other.datasets.iter()) == []


def test_job_create_list_cancel_events_logs(api):
    client, _ = api
    job = client.train(
        "inkling-tiny", CHAT, lora={"rank": 4, "targets": ["attn"]}, adapter_name="q-1", wait=False, max_steps=3
    )
    assert isinstance(job, sdk.Job) and job.state == "queued" and job.id.startswith("job_")
    assert job.info.lora["rank"] == 4 and job.info.hyperparameters["max_steps"] == 3
    assert job.progress.max_steps == 3
    assert [j.id for j in client.jobs.list(state="queued", adapter_name="q-1")] == [job.id]
    assert client.jobs.list(adapter_name="nobody").data == []
    other = client.train("inkling-tiny", job.info.dataset_id, adapter_name="q-2", wait=False)
    assert other.info.dataset_id == job.info.dataset_id  # a ds_ id is used as is, not re-uploaded
    assert len(client.datasets.list().data) == 1
    assert [j.id for j in client.jobs.iter(page_size=1)] == [other.id, job.id]

    started = time.monotonic()
    with pytest.raises(sdk.JobTimeoutError) as err:  # no worker serves this service: it stays queued
        job.wait(timeout=1.5, progress=False)
    assert isinstance(err.value, TimeoutError) and 1.4 < time.monotonic() - started < 15
    assert job.state == "queued"

    assert job.cancel().state == "cancelled" and job.info.finished_at is not None
    assert client.jobs.cancel(job.id).state == "cancelled"  # no-op
    events = list(job.events())
    assert [(e.type, e.state) for e in events] == [("state", "queued"), ("state", "cancelled")]
    assert [e.id for e in client.jobs.history(job.id)] == [e.id for e in events]
    assert list(client.jobs.events(job.id, after=events[0].id)) == events[1:]
    assert "cancelled" in job.logs()
    with pytest.raises(sdk.JobCancelledError) as err:
        job.wait(progress=False)
    assert err.value.details["job_id"] == job.id
    other.cancel()

    with pytest.raises(sdk.NotFoundError) as err:
        client.train("gpt-9", CHAT, adapter_name="x", wait=False)
    assert err.value.code == "unknown_base_model"
    with pytest.raises(sdk.NotFoundError):
        client.jobs.get("job_" + "0" * 24)


def _play_worker(service, job_id: str, events: list[tuple[str, str | None, dict]]) -> None:
    """Record a worker's events for the job as the job worker does (state and progress), without training."""
    from sqlalchemy import update

    from inkwell.service.db import repo
    from inkwell.service.db.models import JobRow

    with service.sm() as s:
        for type_, state, data in events:
            if state is not None:
                s.execute(update(JobRow).where(JobRow.id == job_id).values(state=state, worker_id="bar-test"))
            repo.add_event(s, job_id, type_, f"{type_} {state or data}", data, state=state)
        s.commit()


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_progress_bar_starts_where_a_running_job_is(api, sqlite_service, capsys, client_kind):
    """wait() on a running job: the bar starts at its state and step (the earlier events set it, they are not
    replayed on screen) and moves with the live ones."""
    client, key = api
    job = client.train("inkling-tiny", CHAT, adapter_name="bar", wait=False, max_steps=5)
    steps = [("progress", None, {"step": n, "max_steps": 5, "loss": 2.0 / n}) for n in (1, 2, 3)]
    _play_worker(sqlite_service, job.id, [("state", "running", {}), *steps])

    def finish() -> None:
        time.sleep(1.0)
        _play_worker(sqlite_service, job.id, [("progress", None, {"step": 4, "max_steps": 5, "loss": 0.25})])
        _play_worker(sqlite_service, job.id, [("state", "succeeded", {})])

    finisher = threading.Thread(target=finish)
    finisher.start()

    async def wait_async() -> str:
        async with sdk.AsyncClient(sqlite_service.url, key) as async_client:
            return (await (await async_client.jobs.get(job.id)).wait(timeout=30)).state

    try:
        state = job.wait(timeout=30).state if client_kind == "sync" else asyncio.run(wait_async())
        assert state == "succeeded"
    finally:
        finisher.join()
    drawn = re.findall(r"bar \[(\w+)\]:\s+\d+%\|[^|]*\| (\d)/5 ([^\r\n]*)", capsys.readouterr().err)
    shown = [(state, int(step), re.search(r"loss=([\d.]+)", rest)) for state, step, rest in drawn]
    assert shown, "the bar drew nothing"
    assert {state for state, _, _ in shown} == {"running", "succeeded"}  # never back to queued
    assert [step for _, step, _ in shown] == sorted(step for _, step, _ in shown)
    (first_state, first_step, first_loss), (last_state, last_step, last_loss) = shown[0], shown[-1]
    assert (first_state, first_step, first_loss[1]) == ("running", 3, "0.6667")  # where the job was, at once
    assert (last_state, last_step, last_loss[1]) == ("succeeded", 4, "0.2500")


def test_wait_on_a_job_that_ends_as_the_wait_begins(api, sqlite_service, monkeypatch):
    """The job ends between wait()'s look at it and its read of the events so far: the wait returns at once (it
    followed the stream from the terminal event on, which the service closes at once, until it gave up)."""
    client, _ = api
    job = client.train("inkling-tiny", CHAT, adapter_name="ending", wait=False, max_steps=5)
    _play_worker(sqlite_service, job.id, [("state", "running", {})])
    history = client.jobs.history

    def ending_history(job_id: str, **kwargs):
        _play_worker(sqlite_service, job_id, [("state", "succeeded", {})])  # the race, injected
        return history(job_id, **kwargs)

    monkeypatch.setattr(client.jobs, "history", ending_history)
    started = time.monotonic()
    assert job.wait(timeout=60).state == "succeeded"
    assert time.monotonic() - started < 5


def test_registry_import_download_alias_delete(api, adapter_dir, sqlite_service, tmp_path):
    client, _ = api
    v1 = client.adapters.import_(adapter_dir, name="imported", base_model="inkling-tiny", layout="sglang")
    assert (v1.version, v1.lineage.source, v1.base_model) == (1, "import", "inkling-tiny")
    assert {f.layout for f in v1.files} == {"sglang", "peft"}
    v2 = client.adapters.import_(adapter_dir, name="imported", base_model="inkling-tiny", layout="sglang")
    assert v2.version == 2
    with pytest.raises(sdk.ConflictError) as err:
        client.adapters.import_(adapter_dir, name="imported", base_model="inkling-tiny", layout="sglang", version=1)
    assert err.value.code == "version_exists"

    adapter = client.adapters.get("imported")
    assert (adapter.latest_version, adapter.num_versions) == (2, 2)
    assert [a.name for a in client.adapters.iter()] == ["imported"]
    assert [v.version for v in client.adapters.versions("imported")] == [2, 1]

    got = client.adapters.download("imported", layout="peft", dest=tmp_path / "latest")
    assert got.version == 2 and got.layout == "peft"
    recorded = {f.path: f.sha256 for f in v2.files if f.layout == "peft"}
    on_disk = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in got.path.iterdir()}
    assert on_disk == recorded and "adapter_model.safetensors" in on_disk
    with pytest.raises(sdk.ValidationError, match="cannot make the directory .*: Not a directory"):
        client.adapters.download("imported", dest=tmp_path / "latest" / "adapter_config.json" / "under")

    alias = client.adapters.set_alias("imported", "prod", 1)
    assert (alias.alias, alias.version) == ("prod", 1)
    assert client.adapters.version("imported", "prod").version == 1
    via_alias = client.adapters.download("imported", "prod", dest=tmp_path / "prod", presigned=True)
    assert via_alias.version == 1
    sglang_v1 = {f.path: f.sha256 for f in v1.files if f.layout == "sglang"}
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in via_alias.path.iterdir()} == sglang_v1

    with pytest.raises(sdk.ConflictError) as err:
        client.adapters.delete_version("imported", 1)
    assert err.value.code == "version_aliased" and err.value.details["aliases"] == ["prod"]
    client.adapters.set_alias("imported", "prod", 2)  # moves
    assert client.adapters.get("imported").aliases == {"prod": 2}
    assert client.adapters.delete_version("imported", 1).deleted
    assert [v.version for v in client.adapters.versions("imported")] == [2]
    assert [v.version for v in client.adapters.versions("imported", include_deleted=True)] == [2, 1]
    with pytest.raises(sdk.ConflictError) as err:
        client.adapters.download("imported", 1, dest=tmp_path / "gone")
    assert err.value.code == "version_deleted"
    client.adapters.delete_alias("imported", "prod")
    assert client.adapters.get("imported").aliases == {}
    with pytest.raises(sdk.NotFoundError):
        client.adapters.delete_alias("imported", "prod")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(sdk.ValidationError) as err:
        client.adapters.import_(broken, name="broken", base_model="inkling-tiny", layout="sglang")
    assert err.value.code == "invalid_adapter"
    with pytest.raises(FileNotFoundError, match="prod-missing does not exist"):
        client.adapters.import_(tmp_path / "prod-missing", name="x", base_model="inkling-tiny", layout="sglang")

    _, other_key = sqlite_service.new_tenant("other")
    with sdk.Client(sqlite_service.url, other_key) as other:
        with pytest.raises(sdk.NotFoundError):
            other.adapters.get("imported")
        with pytest.raises(sdk.NotFoundError):
            other.adapters.download("imported", 2, dest=tmp_path / "stolen")
        assert not (tmp_path / "stolen").exists() or not any((tmp_path / "stolen").iterdir())


def test_cancelled_async_wait_says_the_job_goes_on(api, sqlite_service):
    """Cancelling an AsyncJob.wait (Ctrl+C under asyncio.run cancels the main task) stops the wait, not the job, and
    the CancelledError says so and how to cancel the job; a KeyboardInterrupt's note did this for the sync wait only."""
    _, key = api

    async def main():
        async with sdk.AsyncClient(sqlite_service.url, key) as client:
            job = await client.train("inkling-tiny", CHAT, adapter_name="async-wait", wait=False)  # no worker: queued
            waiting = asyncio.create_task(job.wait(progress=False))
            await asyncio.sleep(0.5)  # following the job's events
            assert not waiting.done()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError) as err:
                await waiting
            assert f"job {job.id} goes on running on the service" in "".join(err.value.__notes__)
            assert f"inkwell jobs cancel {job.id}" in "".join(err.value.__notes__)
            assert (await client.jobs.get(job.id)).state == "queued"

    asyncio.run(main())


def test_ctrl_c_as_the_wait_bar_appears_says_the_job_goes_on(api, sqlite_service, monkeypatch):
    """A Ctrl+C landing while the wait's progress bar first draws (injected there: the bar's first draw raises it)
    still stops the wait, not the job, and says so; it once came before the wait's handler and said nothing."""
    from inkwell.sdk import jobs

    def interrupted(self):
        raise KeyboardInterrupt

    _, key = api
    with sdk.Client(sqlite_service.url, key) as client:
        job = client.train("inkling-tiny", CHAT, adapter_name="ctrl-c-bar", wait=False)  # no worker: queued
        monkeypatch.setattr(jobs._ProgressBar, "_show", interrupted)
        with pytest.raises(KeyboardInterrupt) as err:
            job.wait()
        assert f"job {job.id} goes on running on the service" in "".join(err.value.__notes__)
        assert client.jobs.get(job.id).state == "queued"


def test_async_client(api, adapter_dir, sqlite_service, tmp_path):
    _, key = api

    async def main():
        async with sdk.AsyncClient(sqlite_service.url, key) as client:
            models, dataset = await asyncio.gather(client.models.list(), client.datasets.upload(CHAT))
            assert "inkling-tiny" in [m.id for m in models] and dataset.num_examples == 4
            job = await client.train("inkling-tiny", dataset.id, adapter_name="async-q", wait=False, max_steps=2)
            assert isinstance(job, sdk.AsyncJob) and job.state == "queued"
            assert [j.id async for j in client.jobs.iter(state="queued")] == [job.id]
            await job.cancel()
            assert [e.state async for e in job.events()] == ["queued", "cancelled"]
            with pytest.raises(sdk.JobCancelledError):
                await job.wait(progress=False)
            version = await client.adapters.import_(
                adapter_dir, name="async-imported", base_model="inkling-tiny", layout="sglang"
            )
            got = await client.adapters.download("async-imported", version.version, dest=tmp_path / "a")
            assert sorted(p.name for p in got.path.iterdir()) == sorted(
                f.path for f in version.files if f.layout == "sglang"
            )
            with pytest.raises(sdk.NotFoundError):
                await client.adapters.get("nope")

    asyncio.run(main())
