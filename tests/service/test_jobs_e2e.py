"""The whole path on the real service, a real worker process and the real trainer (inkling-tiny):
dataset -> job -> worker trains -> version published -> sha256-checked download -> alias moves ->
delete audited. Plus cancel of a running job, and kill -9 of a worker mid-job."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from inkwell.service.db import repo
from inkwell.service.registry import cleanup_orphans
from tests.service.helpers import jsonl, upload

EXAMPLES = [
    {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
    for i in range(24)
]
LORA = {"rank": 2, "alpha": 4, "targets": ["attn", "mlp", "experts"]}


def job_body(dataset_id: str, name: str, max_steps: int, checkpoint_every: int) -> dict:
    return {
        "base_model": "inkling-tiny",
        "dataset_id": dataset_id,
        "adapter_name": name,
        "lora": LORA,
        "hyperparameters": {
            "max_steps": max_steps,
            "batch_size": 2,
            "seq_len": 64,
            "learning_rate": 5e-3,
            "checkpoint_every": checkpoint_every,
            "eval_fraction": 0.1,
            "warmup_steps": 0,
        },
    }


def start_worker(service, log_path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [sys.executable, "-m", "inkwell.service.workers"],
        env={**service.env(), "INKWELL_TRAIN_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def two_workers(service, tmp_path) -> Iterator[tuple[list[subprocess.Popen], Path]]:
    """Two worker processes (logs w0.log, w1.log in tmp_path), stopped on the way out; yields them and w0.log."""
    workers = [start_worker(service, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        yield workers, tmp_path / "w0.log"
    finally:
        for w in workers:
            stop_worker(w)


def submit(client, name: str, max_steps: int, checkpoint_every: int) -> tuple[str, dict]:
    """Upload EXAMPLES and submit a job training adapter `name` on them: (dataset id, the job)."""
    ds = upload(client, jsonl(EXAMPLES)).json()["id"]
    return ds, client.post("/v1/jobs", json=job_body(ds, name, max_steps, checkpoint_every)).json()


def wait_for(predicate, timeout: float, what: str, worker_log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    tail = worker_log.read_text()[-3000:] if worker_log and worker_log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def test_dataset_job_worker_publish_download_alias_delete(service, tenant, tmp_path):
    _, client = tenant
    ds, job = submit(client, "e2e", max_steps=4, checkpoint_every=2)
    log = tmp_path / "worker.log"
    worker = start_worker(service, log)
    try:
        events = []
        with client.stream("GET", f"/v1/jobs/{job['id']}/events/stream", timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["state"] == "succeeded", (done, log.read_text()[-3000:])
    finally:
        stop_worker(worker)
    states = [e["state"] for e in events if e["type"] == "state"]
    assert states == ["queued", "running", "succeeded"], events
    progress = [e["data"]["step"] for e in events if e["type"] == "progress"]
    assert progress == [1, 2, 3, 4], events
    assert [e["data"]["step"] for e in events if e["type"] == "checkpoint"] == [2]
    assert [e["data"]["version"] for e in events if e["type"] == "published"] == [1]
    assert done["adapter_version"] == 1 and done["progress"]["step"] == 4 and done["attempts"] == 1
    assert done["last_checkpoint_step"] == 2 and done["error"] is None

    tenant_id = tenant[0]
    checkpoints = f"checkpoints/{tenant_id}/{job['id']}/"
    assert [o.key for o in service.store.list_objects(checkpoints)], "the step-2 checkpoint is in S3"
    cleanup_orphans(service.sm, service.store, grace_seconds=3600)
    assert service.store.list_objects(checkpoints) == []  # a finished job's checkpoints are garbage

    v1 = client.get("/v1/adapters/e2e/versions/1").json()
    assert v1["lineage"] == {
        "source": "job",
        "job_id": job["id"],
        "dataset_id": ds,
        "base_model": "inkling-tiny",
        "base_config_sha256": v1["lineage"]["base_config_sha256"],
    }
    assert v1["metrics"]["steps"] == 4 and v1["lora"]["rank"] == 2
    assert {f["layout"] for f in v1["files"]} == {"sglang", "peft"}
    downloaded = tmp_path / "dl"
    downloaded.mkdir()
    for f in client.get("/v1/adapters/e2e/versions/1/download", params={"layout": "sglang"}).json()["files"]:
        body = client.get(f["download_path"]).content
        assert hashlib.sha256(body).hexdigest() == f["sha256"]
        (downloaded / f["path"]).write_bytes(body)
    # The downloaded directory is a valid adapter: importing it makes version 2 of the same adapter.
    files = [("files", (p.name, p.read_bytes())) for p in sorted(downloaded.iterdir())]
    v2 = client.post(
        "/v1/adapters/import", data={"name": "e2e", "base_model": "inkling-tiny", "layout": "sglang"}, files=files
    )
    assert v2.status_code == 201, v2.text
    assert v2.json()["version"] == 2
    assert client.put("/v1/adapters/e2e/aliases/prod", json={"version": 1}).json()["version"] == 1
    assert client.put("/v1/adapters/e2e/aliases/prod", json={"version": 2}).json()["version"] == 2
    assert client.get("/v1/adapters/e2e/versions/prod").json()["version"] == 2
    assert client.delete("/v1/adapters/e2e/versions/1").json()["deleted"] is True
    audit = [(a["action"], a["target"]) for a in client.get("/v1/audit").json()["data"]]
    assert audit[0] == ("adapter.version.delete", "e2e@1")
    assert ("adapter.version.publish", "e2e@1") in audit and ("adapter.alias.set", "e2e@prod") in audit


def holder(service, job_id: str, workers: list[subprocess.Popen]) -> subprocess.Popen:
    """The worker process that holds the job's lease (its worker id ends with the pid)."""
    with service.sm() as s:
        worker_id = repo.get_job(s, None, job_id).worker_id
    return next(w for w in workers if worker_id.endswith(f":{w.pid}"))


def claims(client, url: str) -> list[dict]:
    """The job's `running` state events: one per claim."""
    events = client.get(f"{url}/events", params={"limit": 1000}).json()["data"]
    return [e for e in events if e["type"] == "state" and e["state"] == "running"]


def last_checkpoint_before(events: list[dict], event_id: int) -> int:
    return max(e["data"]["step"] for e in events if e["type"] == "checkpoint" and e["id"] < event_id)


def test_sigterm_requeues_the_job_and_cancel_stops_it_on_the_next_worker(sqlite_service, tmp_path):
    service = sqlite_service
    _, key = service.new_tenant()
    with service.client(key) as client:
        _, job = submit(client, "cancel-me", max_steps=2000, checkpoint_every=3)
        url = f"/v1/jobs/{job['id']}"
        with two_workers(service, tmp_path) as (workers, log):
            wait_for(lambda: (client.get(url).json()["last_checkpoint_step"] or 0) >= 3, 240, "a checkpoint", log)
            first = holder(service, job["id"], workers)
            first.send_signal(signal.SIGTERM)  # graceful stop: the job goes back to the queue at once
            assert first.wait(60) == 0
            wait_for(lambda: len(claims(client, url)) == 2, 120, "the other worker to claim the job", log)
            assert client.get(url).json()["attempts"] == 1  # the stopped worker's claim was handed back, not counted
            assert client.post(f"{url}/cancel").json()["cancel_requested"] is True
            final = wait_for(
                lambda: (j := client.get(url).json())["state"] == "cancelled" and j, 60, "the job to be cancelled", log
            )
        assert final["finished_at"] and final["adapter_version"] is None
        assert final["progress"]["step"] < 2000
        assert client.get("/v1/adapters").json()["data"] == []
        events = client.get(f"{url}/events", params={"limit": 1000}).json()["data"]
        states = [e for e in events if e["type"] == "state"]
        assert [e["state"] for e in states] == ["queued", "running", "queued", "running", "cancelled"], states
        assert "re-queued" in states[2]["message"]
        assert states[3]["data"]["resume_step"] == last_checkpoint_before(events, states[2]["id"])


@pytest.mark.skipif(os.name != "posix", reason="kill -9")
# Resuming from a checkpoint is the same code on either database; the claims it rests on (a dead worker's lease
# expiring, one claimant) are tested on both in test_claims.py, so this minute-long run is taken on PostgreSQL only.
@pytest.mark.parametrize("service", ["postgres"], indirect=True)
def test_kill_9_worker_mid_job_another_resumes_from_last_checkpoint(service, tenant, tmp_path):
    _, client = tenant
    _, job = submit(client, "survivor", max_steps=60, checkpoint_every=3)
    url = f"/v1/jobs/{job['id']}"
    with two_workers(service, tmp_path) as (workers, log):
        wait_for(lambda: client.get(url).json()["last_checkpoint_step"], 240, "a first checkpoint", log)
        victim = holder(service, job["id"], workers)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        at_kill = client.get(url).json()
        final = wait_for(
            lambda: (j := client.get(url).json())["state"] in ("succeeded", "failed") and j,
            300,
            "the job to finish on the other worker",
            log,
        )
    assert at_kill["state"] == "running" and at_kill["progress"]["step"] < 60, at_kill
    checkpoint_at_kill = at_kill["last_checkpoint_step"]
    assert final["state"] == "succeeded", final
    assert final["attempts"] == 2 and final["adapter_version"] == 1
    claimed = claims(client, url)
    assert len(claimed) == 2 and claimed[1]["data"]["resume_step"] == checkpoint_at_kill
    assert claimed[0]["data"]["worker"] != claimed[1]["data"]["worker"]
    version = client.get("/v1/adapters/survivor/versions/1").json()
    # Lost work is at most one checkpoint interval: the survivor trained only the steps after the last checkpoint.
    assert version["metrics"]["resumed_from_step"] == checkpoint_at_kill
    assert version["metrics"]["steps"] == 60 - checkpoint_at_kill
