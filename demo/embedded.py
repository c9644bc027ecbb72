"""`inkwell serve`, the embedded default, as a child of a script: the demo's service, and the one
benchmarks/bench_startup.py times. It runs in its own process group and dies with its parent."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inkwell.service.processes import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedService:
    """`inkwell serve` in its own process group; stop() ends it and everything it started, and so does the demo's
    own death."""

    def __init__(self, data_dir: Path, port: int, log_path: Path) -> None:
        self.data_dir, self.port, self.log_path = data_dir, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0, env: dict[str, str] | None = None) -> str:
        """Start the service and return the local API key it printed."""
        cli = Path(sys.executable).with_name("inkwell")
        log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [str(cli), "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # a demo killed outright (kill -9) leaves no service behind
            env={**os.environ, "COLUMNS": "200", **(env or {})},
        )
        deadline = time.monotonic() + timeout
        key = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with code {self.proc.returncode}; see {self.log_path}")
            match = re.search(r"INKWELL_API_KEY=(\S+)", self.log_path.read_text())
            key = key or (match.group(1) if match else None)
            try:
                if key and httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return key
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the service did not become healthy in {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
