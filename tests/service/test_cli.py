"""`inkwell serve` (embedded default in one command) in a subprocess; `inkwell admin` in-process."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import time

import httpx
from typer.testing import CliRunner

from inkwell import cli, sdk
from inkwell.service.tinker.auth import tinker_key
from tests.service.helpers import free_port, serve_env, start_serve, wait_healthy


def test_serve_embedded_default_prints_a_working_key_and_admin_adds_tenants(tmp_path):
    port = free_port()
    grace = 2  # INKWELL_SHUTDOWN_GRACE_SECONDS: open requests are cancelled this long after SIGTERM (default 10)
    env = serve_env(tmp_path / "data", INKWELL_SHUTDOWN_GRACE_SECONDS=str(grace))
    log = tmp_path / "serve.log"
    proc = start_serve(env, port, log, workers=0)
    held = contextlib.ExitStack()  # the event stream a client holds through the SIGTERM
    try:
        wait_healthy(proc, port, log)
        printed = log.read_text()
        for noise in ("Transformer Engine", "absl.logging", "No CUDA runtime", "Megatron-FSDP"):
            assert noise not in printed, printed  # megatron-core's and torch's import-time notes are kept quiet
        key = re.search(r"(ink_[A-Za-z0-9_-]{20,})", printed).group(1)
        # The printed exports paste into a shell as they are (one line each, however narrow the console).
        exports = "\n".join(re.findall(r"^\s*(export .*)$", printed, re.MULTILINE))
        shell = subprocess.run(["bash", "-c", f"{exports}\nenv"], capture_output=True, text=True, env={}, check=True)
        url = f"http://127.0.0.1:{port}"
        exported = shell.stdout.splitlines()
        for pair in (f"INKWELL_URL={url}", f"INKWELL_API_KEY={key}", f"TINKER_BASE_URL={url}"):
            assert pair in exported, (pair, printed)
        assert f"TINKER_API_KEY={tinker_key(key)}" in exported, printed
        headers = {"Authorization": f"Bearer {key}"}
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["inkling-tiny"]

        runner = CliRunner()
        admin = runner.invoke(cli.app, ["admin", "create-tenant", "acme"], env=env)
        assert admin.exit_code == 0, admin.output
        acme_key = re.search(r"(ink_[A-Za-z0-9_-]{20,})", admin.output).group(1)
        acme = httpx.get(f"http://127.0.0.1:{port}/v1/datasets", headers={"Authorization": f"Bearer {acme_key}"})
        assert acme.status_code == 200 and acme.json()["data"] == []
        again = runner.invoke(cli.app, ["admin", "create-tenant", "acme"], env=env)
        assert again.exit_code == 1 and "already exists" in again.output
        missing = runner.invoke(cli.app, ["admin", "create-key", "nobody"], env=env)
        assert missing.exit_code == 1 and "create-tenant" in missing.output
        # names are printed as given, not read as rich markup
        odd = runner.invoke(cli.app, ["admin", "create-tenant", "[bold]lab"], env=env)
        assert odd.exit_code == 0 and odd.output.startswith("tenant [bold]lab ("), odd.output
        odd_again = runner.invoke(cli.app, ["admin", "create-tenant", "[bold]lab"], env=env)
        assert "tenant '[bold]lab' already exists" in odd_again.output, odd_again.output

        # a queued job's event stream (no job worker: it stays open) held by a client through the SIGTERM
        with sdk.Client(url=f"http://127.0.0.1:{port}", api_key=key) as client:
            job = client.train("inkling-tiny", [{"prompt": "a", "completion": "b"}], wait=False, max_steps=1)
        stream_url = f"http://127.0.0.1:{port}/v1/jobs/{job.id}/events/stream"
        response = held.enter_context(httpx.stream("GET", stream_url, headers=headers, timeout=None))
        assert response.status_code == 200
    finally:
        stopping = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        held.close()
    assert time.monotonic() - stopping < grace + 20, "an open event stream held the shutdown"
    assert proc.returncode == 0, log.read_text()[-2000:]
    # The SeaweedFS it started (its own session, so it outlives no one by accident) is stopped too.
    leftover = subprocess.run(["pgrep", "-f", f"-dir={tmp_path / 'data' / 's3'}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_serve_on_a_taken_port_exits_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "serve.log"
        proc = start_serve(serve_env(tmp_path / "data"), port, log, workers=1)
        assert proc.wait(60) == 1, log.read_text()[-2000:]
    said = log.read_text()
    assert f"cannot listen on 127.0.0.1:{port}" in said and "pass another --port" in said, said[-2000:]
    assert not (tmp_path / "data").exists()  # no database, object store, job worker or key was made
