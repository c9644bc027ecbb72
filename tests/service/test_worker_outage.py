"""An S3 outage while a job is queued delays the job and never fails it: every claim that cannot download the
dataset hands the job back to `queued` without counting an attempt, the worker backs off between claims, and
once SeaweedFS is back the job trains and publishes. On SQLite and on PostgreSQL (the hand-back is a write).
A worker's graceful stop (SIGTERM) hands its job back the same way."""

import contextlib
import threading
import time

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from inkwell.service.db import repo
from inkwell.service.errors import outage_line
from inkwell.service.settings import Settings
from inkwell.service.storage.seaweed import EmbeddedSeaweed
from inkwell.service.workers.job_worker import MAX_ATTEMPTS, JobWorker
from tests.service.helpers import (
    make_settings,
    own_pg_database,
    pg_allow_connections,
    scratch_pg_database,
    start_service,
)
from tests.service.test_jobs_e2e import submit

CLAIMS = MAX_ATTEMPTS + 2  # more claims than a job has attempts
LEASE = 2.0  # the workers' lease (seconds); S3 stays down at least 3 leases while the job is queued


@pytest.fixture(params=["sqlite", "postgres"])
def outage(request, tmp_path):
    """The API on its own SeaweedFS (to stop and restart) and its own database (so the worker claims only
    this test's job)."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_pg_database("inkwell_outage")) if request.param == "postgres" else None
        weed = EmbeddedSeaweed(tmp_path / "weed")
        weed.start()
        stack.callback(weed.stop, grace=0)  # a throwaway store: no graceful shutdown (2 s of weed's own) to wait for
        svc = start_service(make_settings(tmp_path / "svc", url, weed))
        stack.callback(svc.stop)
        yield weed, svc


class RecordedWaits(threading.Event):
    """A worker's stop flag that records how long the worker waited each time (its backoff)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def claims_of(svc, job_id: str) -> int:
    with svc.sm() as s:
        return sum(e.message.startswith("claimed by") for e in repo.list_events(s, job_id, 0, 1000))


def run_until_finished(client, worker: JobWorker, job: dict, timeout: float = 180.0) -> dict:
    """Run `worker` in a thread until the job is terminal; the job's final view."""
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            view = client.get(f"/v1/jobs/{job['id']}").json()
            if view["state"] in ("succeeded", "failed", "cancelled"):
                return view
            time.sleep(0.2)
        raise AssertionError(f"job {job['id']} did not finish: {view}")
    finally:
        worker.stopping.set()
        thread.join(120)


def worker_settings(svc, tmp_path, worker: str) -> Settings:
    return Settings(
        data_dir=tmp_path / worker,
        database_url=svc.settings.resolved_database_url,
        s3_endpoint=svc.app.state.s3_endpoint,
        s3_access_key=svc.settings.s3_access_key,
        s3_secret_key=svc.settings.s3_secret_key,
        bucket=svc.settings.bucket,
        lease_seconds=LEASE,
        worker_poll_seconds=0.05,
    )


def test_storage_outage_requeues_without_using_attempts_then_the_job_succeeds(outage, tmp_path):
    weed, svc = outage
    _, key = svc.new_tenant()
    with svc.client(key) as client:
        _, job = submit(client, "outage", max_steps=2, checkpoint_every=1)
        weed.stop(grace=0.5)  # S3 goes away while the job is queued
        down = time.monotonic()

        stopping = RecordedWaits()
        worker = JobWorker(worker_settings(svc, tmp_path, "w-down"), worker_id="w-down", stopping=stopping)
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        deadline = time.monotonic() + 90
        try:
            while (claims_of(svc, job["id"]) < CLAIMS or time.monotonic() - down < 3 * LEASE) and (
                time.monotonic() < deadline
            ):
                if client.get(f"/v1/jobs/{job['id']}").json()["state"] == "failed":
                    break
                time.sleep(0.1)
        finally:
            stopping.set()
            thread.join(60)
        during = client.get(f"/v1/jobs/{job['id']}").json()
        assert claims_of(svc, job["id"]) >= CLAIMS, during
        assert during["state"] == "queued" and during["attempts"] == 0 and during["error"] is None, during
        events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
        requeued = [e for e in events if e["type"] == "state" and e["state"] == "queued"][1:]
        assert len(requeued) >= CLAIMS and all("storage unavailable" in e["message"] for e in requeued)
        # Between claims the worker backed off, doubling: not one claim per poll.
        backoff = stopping.waits[: CLAIMS - 1]
        assert backoff == [worker.backoff_seconds(n) for n in range(1, CLAIMS)], stopping.waits
        assert backoff[1] == 2 * backoff[0]

        assert time.monotonic() - down >= 3 * LEASE
        weed.start()  # S3 is back (a restarted SeaweedFS may still refuse a read or two): the job trains
        done = run_until_finished(client, JobWorker(worker_settings(svc, tmp_path, "w-up"), worker_id="w-up"), job)
        assert done["state"] == "succeeded" and done["adapter_version"] == 1, done
        assert done["attempts"] == 1 and done["error"] is None
        assert client.get("/v1/adapters/outage").json()["latest_version"] == 1


def test_a_stopped_worker_requeues_its_job_without_using_an_attempt(tmp_path, seaweed):
    """SIGTERM sets a worker's stop flag: the job goes back to `queued` at the next step, its claim not counted
    (like an outage's hand-back), so restarting workers never uses up a job's attempts; the next worker resumes it."""
    svc = start_service(make_settings(tmp_path / "svc", None, seaweed))  # its own database: only this job to claim
    try:
        _, key = svc.new_tenant()
        with svc.client(key) as client:
            _, job = submit(client, "stopped", max_steps=3, checkpoint_every=1)
            stopping = threading.Event()
            worker = JobWorker(worker_settings(svc, tmp_path, "w-stop"), worker_id="w-stop", stopping=stopping)
            put_tree = worker.store.put_tree

            def checkpoint_then_sigterm(*args, **kwargs) -> list[str]:
                keys = put_tree(*args, **kwargs)
                stopping.set()  # what the worker's SIGTERM handler does
                return keys

            worker.store.put_tree = checkpoint_then_sigterm
            try:
                assert worker.run_once() is True
            finally:
                worker.db_engine.dispose()
            stopped = client.get(f"/v1/jobs/{job['id']}").json()
            assert stopped["state"] == "queued" and stopped["attempts"] == 0, stopped
            assert stopped["last_checkpoint_step"] == 1 and stopped["error"] is None, stopped
            last = client.get(f"/v1/jobs/{job['id']}/events").json()["data"][-1]
            assert last["state"] == "queued" and "attempt not counted" in last["message"], last
            after = JobWorker(worker_settings(svc, tmp_path, "w-next"), worker_id="w-next")
            done = run_until_finished(client, after, job)
            assert done["state"] == "succeeded" and done["attempts"] == 1, done
    finally:
        svc.stop()


class BackOnWait(threading.Event):
    """A worker's stop flag that lets the database back in the first time the worker waits on it."""

    def __init__(self, back) -> None:
        super().__init__()
        self.back, self.waited = back, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waited += 1
        if self.waited == 1:
            self.back()
        return super().wait(timeout)


def test_database_outage_mid_job_requeues_without_using_an_attempt(tmp_path, seaweed):
    """PostgreSQL refuses connections once the dataset is downloaded: the worker's next write fails inside
    training, the worker keeps trying to hand the job back, and does once the database answers again."""
    with own_pg_database("inkwell_dbout") as (conn, name, url):
        svc = start_service(make_settings(tmp_path / "svc", url, seaweed))
        try:
            _, key = svc.new_tenant()
            with svc.client(key) as client:
                _, job = submit(client, "db-outage", max_steps=2, checkpoint_every=1)
                settings = worker_settings(svc, tmp_path, "w-db").model_copy(update={"lease_seconds": 6.0})
                stopping = BackOnWait(lambda: pg_allow_connections(conn, name, True))
                worker = JobWorker(settings, worker_id="w-db", stopping=stopping)
                download = worker.store.download_file

                def download_then_database_goes(key: str, path):
                    download(key, path)
                    pg_allow_connections(conn, name, False)

                worker.store.download_file = download_then_database_goes
                try:
                    with pytest.raises(OperationalError):
                        worker.run_once()
                    assert stopping.waited >= 1  # the first hand-back found the database down and was retried
                finally:
                    pg_allow_connections(conn, name, True)
                    worker.db_engine.dispose()
                during = client.get(f"/v1/jobs/{job['id']}").json()
                assert during["state"] == "queued" and during["attempts"] == 0, during
                events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
                assert "database unavailable" in events[-1]["message"], events[-1]

                after = JobWorker(worker_settings(svc, tmp_path, "w-db2"), worker_id="w-db2")
                try:
                    assert after.run_once() is True
                finally:
                    after.db_engine.dispose()
                done = client.get(f"/v1/jobs/{job['id']}").json()
                assert done["state"] == "succeeded" and done["attempts"] == 1, done
        finally:
            svc.stop()


def test_an_outage_is_logged_as_one_line():
    """A worker logs every retry through an outage: the driver's hint and SQLAlchemy's link stay out of it."""
    with pytest.raises(OperationalError) as info:
        create_engine("postgresql+psycopg2://nobody@127.0.0.1:1/none").connect()  # nothing listens on port 1
    assert "\n" in str(info.value)
    line = outage_line(info.value)
    assert "\n" not in line and line.startswith("OperationalError: connection to server") and "refused" in line
