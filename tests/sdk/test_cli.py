"""`inkwell jobs`, `inkwell adapters` and `inkwell sessions` through the real CLI app against the real service."""

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from inkwell import sdk
from inkwell.cli import app

CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def run(env: dict, *args: str, code: int = 0):
    result = CliRunner().invoke(app, list(args), env={**env, "COLUMNS": "200"})
    assert result.exit_code == code, result.output
    return result


def test_jobs_commands(api, sqlite_service, tmp_path):
    _, key = api
    env = {"INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    created = run(
        env,
        "jobs",
        "create",
        "--base-model",
        "inkling-tiny",
        "--dataset",
        str(data),
        "--adapter-name",
        "cli-a",
        "--rank",
        "4",
        "--targets",
        "attn,mlp",
        "--set",
        "max_steps=2",
        "--set",
        "learning_rate=0.01",
    )
    job_id = created.output.split()[1]
    assert job_id.startswith("job_") and "queued" in created.output
    got = json.loads(run(env, "jobs", "get", job_id, "--json").output)
    assert got["lora"]["rank"] == 4 and got["lora"]["targets"] == ["attn", "mlp"]
    assert got["hyperparameters"]["max_steps"] == 2 and got["hyperparameters"]["learning_rate"] == 0.01
    listed = json.loads(run(env, "jobs", "list", "--state", "queued", "--json").output)
    assert [j["id"] for j in listed] == [job_id]
    assert job_id in run(env, "jobs", "list").output
    refused = run(env, "jobs", "list", "--limit", "0", code=2).output  # it listed nothing and said "no jobs yet"
    assert "--limit" in refused and "greater than or equal to 1" in refused
    waited = run(env, "jobs", "wait", job_id, "--timeout", "1", code=1)  # no worker serves this service
    assert "wait_timeout" in waited.output
    assert "cancelled" in run(env, "jobs", "cancel", job_id).output
    events = run(env, "jobs", "events", job_id, "--json").output.splitlines()
    assert [json.loads(e)["state"] for e in events] == ["queued", "cancelled"]
    assert "[cancelled]" in run(env, "jobs", "events", job_id, "--no-follow").output
    assert "job queued" in run(env, "jobs", "logs", job_id).output
    assert "job_cancelled" in run(env, "jobs", "wait", job_id, code=1).output

    uploads = httpx.get(f"{sqlite_service.url}/v1/datasets", headers={"Authorization": f"Bearer {key}"}).json()
    bad = run(env, "jobs", "create", "--base-model", "gpt-9", "--dataset", str(data), code=1)
    assert "unknown_base_model" in bad.output and "inkling-tiny" in bad.output
    typo = run(env, "jobs", "create", "--base-model", "inkling-tiny", "--dataset", str(data), "--set", "lr=1", code=1)
    assert "unknown hyperparameter 'lr'" in typo.output
    # both refused before their dataset was uploaded: nothing was left behind
    assert httpx.get(f"{sqlite_service.url}/v1/datasets", headers={"Authorization": f"Bearer {key}"}).json() == uploads
    missing = run({"INKWELL_URL": sqlite_service.url}, "jobs", "list", code=1)
    assert "INKWELL_API_KEY" in missing.output
    wrong = run({**env, "INKWELL_API_KEY": "ink_wrong"}, "jobs", "list", code=1)
    assert "unauthorized" in wrong.output
    assert "not_found" in run(env, "jobs", "get", "job_" + "0" * 24, code=1).output


def test_adapters_commands(api, sqlite_service, adapter_dir, tmp_path):
    _, key = api
    env = {"INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    for _ in range(2):
        run(
            env,
            "adapters",
            "import",
            str(adapter_dir),
            "--name",
            "cli-ad",
            "--base-model",
            "inkling-tiny",
            "--layout",
            "sglang",
        )
    listed = json.loads(run(env, "adapters", "list", "--json").output)
    assert [(a["name"], a["latest_version"]) for a in listed] == [("cli-ad", 2)]
    assert "cli-ad" in run(env, "adapters", "list").output
    assert "prod" in run(env, "adapters", "alias", "cli-ad", "prod", "1").output
    assert json.loads(run(env, "adapters", "get", "cli-ad", "--json").output)["aliases"] == {"prod": 1}

    dest = tmp_path / "dl"
    done = run(env, "adapters", "download", "cli-ad", "prod", "--layout", "peft", "--dest", str(dest))
    assert "cli-ad@1" in done.output and "sha256 verified" in done.output
    versions = json.loads(run(env, "adapters", "versions", "cli-ad", "--json").output)
    v1 = next(v for v in versions if v["version"] == 1)
    expected = {f["path"]: f["sha256"] for f in v1["files"] if f["layout"] == "peft"}
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.iterdir()} == expected

    refused = run(env, "adapters", "delete", "cli-ad", "1", code=1)
    assert "version_aliased" in refused.output and "prod" in refused.output
    run(env, "adapters", "alias", "cli-ad", "prod", "--delete")
    assert "deleted cli-ad@1" in run(env, "adapters", "delete", "cli-ad", "1").output
    table = run(env, "adapters", "versions", "cli-ad", "--include-deleted").output
    assert "yes" in table  # the deleted column
    assert (
        "version_deleted"
        in run(env, "adapters", "download", "cli-ad", "1", "--dest", str(tmp_path / "x"), code=1).output
    )
    run(env, "adapters", "alias", "cli-ad", "prod", code=2)  # neither VERSION nor --delete
    where = run(env, "adapters", "download", "cli-ad", str(tmp_path / "y"), code=2)  # a path where REF goes
    said = " ".join(where.output.replace("│", " ").split())  # the error's panel wraps its lines
    assert f"pass --dest {tmp_path / 'y'}" in said and not (tmp_path / "y").exists()


def test_the_command_line_starts_without_torch():
    """Every `inkwell` command loads every sub-app's module: none may import torch (seconds) until a command that
    needs it runs, so `inkwell jobs list` answers at once."""
    code = "import sys, inkwell.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sessions_commands(api, sqlite_service):
    """A session a program left open (no heartbeats here) is listed, shown and closed from the command line."""
    _, key = api
    env = {"INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    body = {"base_model": "inkling-tiny", "lora": {"rank": 2}}
    headers = {"Authorization": f"Bearer {key}"}
    opened = httpx.post(f"{sqlite_service.url}/v1/sessions", json=body, headers=headers, timeout=60).json()
    listed = json.loads(run(env, "sessions", "list", "--json").output)
    assert [(s["id"], s["state"]) for s in listed] == [(opened["id"], opened["state"])]
    assert opened["id"] in run(env, "sessions", "list").output
    assert f"{opened['id']}: closed at step 0" in run(env, "sessions", "close", opened["id"]).output
    shown = run(env, "sessions", "get", opened["id"]).output
    narrow = CliRunner().invoke(app, ["sessions", "list"], env={**env, "COLUMNS": "80"}).output  # as in a pipe
    assert max(map(len, narrow.splitlines())) > 80 and "closed_by_owner" in narrow and " closed " in narrow, narrow
    assert "closed_by_owner" in shown and "closed by its owner" in shown
    assert json.loads(run(env, "sessions", "get", opened["id"], "--json").output)["state"] == "closed"
    assert "not_found" in run(env, "sessions", "close", "sess_" + "0" * 24, code=1).output


def test_datasets_commands(api, sqlite_service, tmp_path):
    _, key = api
    env = {"INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 3))
    uploaded = run(env, "datasets", "upload", str(data), "--name", "greetings").output
    dataset_id = uploaded.split()[0]
    assert dataset_id.startswith("ds_") and "greetings: 3 chat examples" in uploaded
    listed = json.loads(run(env, "datasets", "list", "--json").output)
    assert [d["id"] for d in listed if d["name"] == "greetings"] == [dataset_id]
    assert dataset_id in run(env, "datasets", "list").output
    assert f"deleted {dataset_id}" in run(env, "datasets", "delete", dataset_id).output
    assert dataset_id not in run(env, "datasets", "list").output
    assert "not_found" in run(env, "datasets", "delete", dataset_id, code=1).output
    assert "does not exist" in run(env, "datasets", "upload", str(tmp_path / "nope.jsonl"), code=1).output


def test_empty_lists_say_so_on_stderr(api, sqlite_service):
    """A fresh tenant's lists print no table (a bare header said nothing) but a line on stderr: what to do next,
    or that the filters matched nothing; stdout stays empty for a script reading it."""
    _, key = api
    env = {"INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    expected = {
        ("datasets", "list"): "no datasets yet: upload one with `inkwell datasets upload",
        ("jobs", "list"): "no jobs yet: start one with `inkwell jobs create`",
        ("jobs", "list", "--state", "failed"): "no job matches these filters",
        ("sessions", "list"): "no training sessions",
        ("adapters", "list", "--base-model", "inkling-none"): "no adapters of inkling-none: a job publishes one",
    }
    for args, said in expected.items():
        result = run(env, *args)
        assert result.stdout == "" and said in result.stderr, (args, result.stdout, result.stderr)


def test_ctrl_c_in_jobs_wait_says_the_job_goes_on(api, sqlite_service, tmp_path):
    """Ctrl+C while `inkwell jobs wait` follows a job stops the wait, not the job, and says so (it said nothing)."""
    _, key = api
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    with sdk.Client(sqlite_service.url, key) as client:
        job = client.train("inkling-tiny", data, adapter_name="ctrl-c", wait=False)  # no job worker: it stays queued
    env = {**os.environ, "INKWELL_URL": sqlite_service.url, "INKWELL_API_KEY": key}
    waiting = subprocess.Popen(
        [sys.executable, "-m", "inkwell.cli", "jobs", "wait", job.id],
        env=env,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground command has it
    )
    said, deadline = b"", time.monotonic() + 60
    while b"[queued]" not in said:  # its progress bar: it follows the job's events
        assert time.monotonic() < deadline and waiting.poll() is None, said
        if select.select([waiting.stderr], [], [], 1)[0]:
            said += os.read(waiting.stderr.fileno(), 4096)
    waiting.send_signal(signal.SIGINT)
    said += waiting.communicate(timeout=30)[1]
    assert waiting.returncode == 130
    assert f"job {job.id} goes on running on the service" in said.decode()
    assert f"inkwell jobs cancel {job.id}" in said.decode()
    with sdk.Client(sqlite_service.url, key) as client:
        assert client.jobs.get(job.id).info.state == "queued"
