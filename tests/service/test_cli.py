"""`inkwell serve` (embedded default in one command) in a subprocess; `inkwell admin` in-process."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
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


def _session_processes(sid: int) -> dict[int, tuple[int, str]]:
    """The live processes of session `sid` (what a `start_serve` started, and what they started): pid -> (parent,
    command line)."""
    out = subprocess.run(["ps", "-ww", "-s", str(sid), "-o", "pid=,ppid=,stat=,args="], capture_output=True, text=True)
    found = {}
    for line in out.stdout.splitlines():
        pid, ppid, stat, args = line.split(None, 3)
        if not stat.startswith("Z"):
            found[int(pid)] = (int(ppid), args)
    return found


def _forked_worker(serve: subprocess.Popen, log: Path) -> int:
    """The first child of the fork server (which `serve` starts with itself): a starting worker."""
    deadline = time.monotonic() + 120
    while True:
        found = _session_processes(serve.pid)
        assert time.monotonic() < deadline and serve.poll() is None, (found, log.read_text()[-2000:])
        servers = {pid for pid, (ppid, args) in found.items() if ppid == serve.pid and "forkserver" in args}
        children = [pid for pid, (ppid, _) in found.items() if ppid in servers]
        if children:
            return children[0]
        time.sleep(0.05)


@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm-to-serve", "sigterm-to-its-group"])
def test_sigterm_while_the_first_request_starts_its_serving_worker(tmp_path, to_group):
    """SIGTERM while the first request for a base model waits for its serving worker to start: the request is
    cancelled after the grace, and the worker is stopped with the rest, whether it got the signal too (Ctrl+C
    reaches the whole group) and died, or not (a `kill` of the service, a container's stop) and went on starting.
    `inkwell serve` waited 300 s for the dead one's start; the other, once started, was kept by no one, and the
    service's exit waited on it forever."""
    port, grace, log = free_port(), 1, tmp_path / "serve.log"
    proc = start_serve(serve_env(tmp_path / "data", INKWELL_SHUTDOWN_GRACE_SECONDS=str(grace)), port, log, workers=0)
    try:
        wait_healthy(proc, port, log)
        key = re.search(r"(ink_[A-Za-z0-9_-]{20,})", log.read_text()).group(1)

        def first_request() -> None:
            body = {"model": "inkling-tiny", "prompt": "hi", "max_tokens": 2}
            headers = {"Authorization": f"Bearer {key}"}
            with contextlib.suppress(httpx.HTTPError):  # cut off by the shutdown
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)

        threading.Thread(target=first_request, daemon=True).start()
        worker = _forked_worker(proc, log)
        os.kill(worker, signal.SIGSTOP)  # injected: the worker is still starting when the SIGTERM comes
        (os.killpg if to_group else os.kill)(proc.pid, signal.SIGTERM)
        time.sleep(grace + 2)  # the request is cancelled, the service's lifespan has ended
        with contextlib.suppress(ProcessLookupError):  # the group's SIGTERM, fatal even to a stopped process
            os.kill(worker, signal.SIGCONT)
        stopping = time.monotonic()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"inkwell serve did not exit; its processes: {_session_processes(proc.pid)}")
        assert time.monotonic() - stopping < 20
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log.read_text()[-2000:]
    deadline = time.monotonic() + 10  # the fork server and its children end on the service's exit, not before it
    while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == {}
