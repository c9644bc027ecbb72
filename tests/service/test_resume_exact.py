"""A job a worker resumes after kill -9 continues exactly: every step's loss and eval loss after the
resume point, and the published adapter, equal those of the same job run without interruption.

LoRA dropout, gradient accumulation, warmup and mid-run eval passes make each piece of resumed
state matter (RNG, data position, optimizer moments, the scheduler's learning rate).
"""

import os
import signal

import pytest
import torch
from safetensors.torch import load as load_safetensors

from tests.service.helpers import jsonl, upload
from tests.service.test_jobs_e2e import EXAMPLES, holder, two_workers, wait_for

MAX_STEPS = 10


def job_body(dataset_id: str, name: str) -> dict:
    return {
        "base_model": "inkling-tiny",
        "dataset_id": dataset_id,
        "adapter_name": name,
        "lora": {"rank": 2, "alpha": 4, "dropout": 0.1, "targets": ["attn", "mlp", "experts"]},
        "hyperparameters": {
            "max_steps": MAX_STEPS,
            "batch_size": 4,
            "grad_accum": 2,
            "seq_len": 64,
            "learning_rate": 5e-3,
            "warmup_steps": 1,
            "checkpoint_every": 2,
            "eval_fraction": 0.1,
            "eval_every": 2,
        },
    }


def losses(client, job_id: str, kind: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every `kind` event of the job, attempts in order."""
    events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [(e["data"]["step"], e["data"][key]) for e in events if e["type"] == kind]


def adapter_tensors(client, name: str) -> dict[str, torch.Tensor]:
    files = client.get(f"/v1/adapters/{name}/versions/1/download", params={"layout": "sglang"}).json()["files"]
    tensors = {}
    for f in files:
        if f["path"].endswith(".safetensors"):
            tensors.update(load_safetensors(client.get(f["download_path"]).content))
    assert tensors, files
    return tensors


def finished(client, job_id: str):
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job["state"] in ("succeeded", "failed") and job


@pytest.mark.skipif(os.name != "posix", reason="kill -9")
def test_worker_resumed_job_matches_an_uninterrupted_run_at_every_step(sqlite_service, tmp_path):
    service = sqlite_service
    _, key = service.new_tenant()
    with service.client(key) as client:
        ds = upload(client, jsonl(EXAMPLES)).json()["id"]
        steady = client.post("/v1/jobs", json=job_body(ds, "steady")).json()["id"]
        killed = client.post("/v1/jobs", json=job_body(ds, "killed")).json()["id"]
        with two_workers(service, tmp_path) as (workers, log):
            url = f"/v1/jobs/{killed}"
            wait_for(lambda: client.get(url).json()["last_checkpoint_step"], 240, "a first checkpoint", log)
            victim = holder(service, killed, workers)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            at_kill = client.get(url).json()
            results = [wait_for(lambda j=j: finished(client, j), 300, f"{j} to finish", log) for j in (steady, killed)]
        assert [r["state"] for r in results] == ["succeeded", "succeeded"], results
        assert results[0]["attempts"] == 1 and results[1]["attempts"] == 2, results
        assert at_kill["state"] == "running", at_kill
        claims = [e for e in client.get(f"{url}/events", params={"limit": 1000}).json()["data"] if e["type"] == "state"]
        resumed_at = [e["data"]["resume_step"] for e in claims if e["state"] == "running"][1]
        assert 2 <= resumed_at < MAX_STEPS, claims

        reference = dict(losses(client, steady, "progress", "loss"))
        assert sorted(reference) == list(range(1, MAX_STEPS + 1))
        attempts = losses(client, killed, "progress", "loss")
        first_resumed = max(i for i, (step, _) in enumerate(attempts) if step == resumed_at + 1)
        after = attempts[first_resumed:]
        assert [step for step, _ in after] == list(range(resumed_at + 1, MAX_STEPS + 1))
        assert after == [(step, reference[step]) for step, _ in after]
        ref_eval = dict(losses(client, steady, "eval", "eval_loss"))
        resumed_eval = [(s, v) for s, v in losses(client, killed, "eval", "eval_loss") if s > resumed_at]
        assert resumed_eval and resumed_eval == [(s, ref_eval[s]) for s, _ in resumed_eval]

        a, b = adapter_tensors(client, "steady"), adapter_tensors(client, "killed")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
