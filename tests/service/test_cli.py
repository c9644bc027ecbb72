"""`inkwell serve` (embedded default in one command) in a subprocess; `inkwell admin` in-process."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from inkwell import cli
from tests.service.helpers import free_port

INKWELL = [sys.executable, "-m", "inkwell.cli"]


def test_serve_embedded_default_prints_a_working_key_and_admin_adds_tenants(tmp_path):
    port = free_port()
    env = {**os.environ, "INKWELL_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    env.pop("INKWELL_S3_ENDPOINT", None)
    env.pop("INKWELL_DATABASE_URL", None)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*INKWELL, "serve", "--port", str(port), "--workers", "0"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        key = None
        while time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"(ink_[A-Za-z0-9_-]{20,})", log.read_text())
            if match:
                key = match.group(1)
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        assert key, log.read_text()
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
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()[-2000:]
    # The SeaweedFS it started (its own session, so it outlives no one by accident) is stopped too.
    leftover = subprocess.run(["pgrep", "-f", f"-dir={tmp_path / 'data' / 's3'}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
