"""`inkwell serve` supervises what it starts, as a real subprocess on a temp data dir: a job worker killed under it
is restarted, and /healthz and /metrics count the job workers alive; a `kill -9` of it leaves no SeaweedFS or job
worker behind and a second serve on the same data dir comes up with no manual step."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.service.helpers import free_port, serve_env, start_serve, wait_healthy

WORKER = "inkwell.service.workers"


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def job_workers_of(serve: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(serve.pid), "-f", WORKER], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def pending_signals(pid: int) -> int:
    """The signals waiting for process `pid` (bit n-1 for signal n), its own and its thread group's."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def gauge(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return float(re.search(r"^inkwell_job_workers (\S+)$", text, re.M).group(1))


def stop(serve: subprocess.Popen, *pids: int) -> None:
    """End a serve this test started (its group) and any of the given processes it left behind."""
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(90)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_job_worker_is_restarted_then_a_kill_9_of_serve_leaves_no_orphans(tmp_path):
    """One serve (its start, and its job worker's, are most of this test's time) through both faults, in order.

    A job worker killed under serve is restarted, and /healthz and /metrics count it: with a 1 s lease a dead
    worker's heartbeat row stops counting within a second, long before the restarted worker (half a second of
    backoff, then importing torch) writes its own.

    Then a `kill -9` of serve leaves no orphans and the next serve starts on the same data dir. The old SeaweedFS
    is stopped as well (SIGSTOP, an injected fault), so its parent-death SIGTERM stays pending, as for a weed slow
    to exit: the next serve must find it by its pid file and kill it. The job worker left then is the restarted
    one: it dies with serve as the first did."""
    data, port, log = tmp_path / "data", free_port(), tmp_path / "first.log"
    env = serve_env(data, INKWELL_LEASE_SECONDS="1")
    first = start_serve(env, port, log, workers=1)
    weed = old = new = 0
    try:
        wait_healthy(first, port, log, until=lambda health: health["job_workers"] == 1)
        assert gauge(port) == 1
        (old,) = job_workers_of(first)
        os.kill(old, signal.SIGKILL)

        deadline = time.monotonic() + 30
        while (resp := httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "the killed worker was still counted"
            time.sleep(0.05)
        assert resp.status_code == 503 and resp.json()["job_workers"] == 0, resp.json()
        assert resp.json()["status"] == "degraded" and resp.json()["database"] == "ok"
        assert gauge(port) == 0

        health = wait_healthy(first, port, log, until=lambda health: health["job_workers"] == 1, timeout=60)
        assert health["status"] == "ok" and gauge(port) == 1
        (new,) = job_workers_of(first)
        assert new != old and not alive(old)
        text = log.read_text()
        assert re.search(rf"job worker 0 \(pid {old}\) exited with -9; restarting in \S+s", text), text[-3000:]
        assert f"job worker 0 restarted (pid {new})" in text

        weed = int((data / "s3" / "weed.pid").read_text())
        os.kill(weed, signal.SIGSTOP)
        first.kill()
        first.wait()
        deadline = time.monotonic() + 10
        while not pending_signals(weed) & (1 << (signal.SIGTERM - 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pending_signals(weed) & (1 << (signal.SIGTERM - 1)), "SeaweedFS got no parent-death signal"

        second = start_serve(env, port, tmp_path / "second.log", workers=0)  # no worker to wait for: faster
        try:
            # the old worker counts until its last heartbeat is a lease (1 s) old: its exit on its parent-death
            # signal can take seconds on a loaded host
            health = wait_healthy(
                second, port, tmp_path / "second.log", until=lambda health: health["job_workers"] == 0, timeout=60
            )
            assert health["storage"] == "ok", health
            assert not alive(weed), f"the old SeaweedFS (pid {weed}) survived"
            assert not alive(new), f"the old job worker (pid {new}) survived"
            assert int((data / "s3" / "weed.pid").read_text()) != weed
        finally:
            stop(second)
    finally:
        stop(first, weed, old, new)
