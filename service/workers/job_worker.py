"""The job worker: claim a job under a lease, train it, checkpoint to S3, publish the adapter.

SFT jobs train with `inkwell.trainer.train`, RL jobs (method `grpo`) with `inkwell.recipes.job.run_grpo`: the same
callbacks, the same result, the same publication.

A claim is a lease (`lease_seconds`) renewed by a heartbeat thread. Every write about a running
job is fenced on `worker_id`, so a worker that lost its lease (paused, partitioned) can no
longer touch the job; the worker that re-claimed it downloads the last checkpoint from S3 and
resumes there. Cancel is read by the heartbeat and stops training at the next step.

An outage of S3 or the database (`StorageUnavailable`, `OperationalError`) is no fault of the job: the worker
hands the job back to `queued` without counting the claim as an attempt, and backs off before claiming again,
so an outage of any length delays jobs but never fails them with `too_many_attempts`. A worker that is stopped
(SIGTERM) hands its job back the same way: restarts of workers do not use up a job's attempts either.
"""

import contextlib
import logging
import math
import os
import shutil
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from inkwell.recipes.job import GrpoCallbacks, run_grpo, step_data
from inkwell.recipes.rl import StepReport
from inkwell.service.db import repo
from inkwell.service.db.models import JobRow, utcnow
from inkwell.service.db.session import make_db_engine, make_sessionmaker
from inkwell.service.errors import outage_line
from inkwell.service.jobs import train_config
from inkwell.service.registry import BaseMismatch, Publication, publish
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore, StorageUnavailable
from inkwell.trainer import (
    TrainConfigError,
    TrainEvent,
    TrainingCancelled,
    TrainJobConfig,
    TrainResult,
    train,
)
from inkwell.trainer.config import GrpoJobConfig

log = logging.getLogger("inkwell.worker")
MAX_ATTEMPTS = 5
# After an outage, a worker waits poll * 2**n seconds before its next claim (n failures in a row), at most this.
MAX_BACKOFF_SECONDS = 60.0


def _finite(data: dict) -> dict:
    """NaN/inf become None: JSON columns (PostgreSQL's above all) refuse them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in data.items()}


class LeaseLost(RuntimeError):
    """Another worker owns the job now; stop without writing anything."""


class _Job:
    """One claimed job: its lease heartbeat, cancel/stop flags and fenced writes."""

    def __init__(self, worker: "JobWorker", row: JobRow) -> None:
        self.worker, self.row = worker, row
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self._stop_beat = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{row.id}", daemon=True)

    @property
    def id(self) -> str:
        return self.row.id

    def __enter__(self) -> "_Job":
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_beat.set()
        self._beat.join()

    def _heartbeat(self) -> None:
        w = self.worker
        while not self._stop_beat.wait(w.settings.heartbeat_seconds):
            try:
                with w.sm() as s:
                    row = repo.renew_lease(s, self.id, w.worker_id, w.lease)
                    s.commit()
            except OperationalError as exc:
                log.warning("heartbeat for %s failed (will retry): %s", self.id, outage_line(exc))
                continue
            if row is None:
                log.warning("lost the lease on %s; stopping", self.id)
                self.lost.set()
                return
            if row.cancel_requested:
                self.cancel.set()

    def write(self, event: tuple[str, str, dict] | None = None, state: str | None = None, **values) -> None:
        """Update the job row and add an event, only while this worker still holds the job.

        Every write goes through the fenced UPDATE (an event-only write renews the lease), which
        also makes the job row the lock that orders this worker's events before a successor's.
        """
        if state:
            values["state"] = state
        values = values or {"lease_expires_at": utcnow() + self.worker.lease}
        with self.worker.sm() as s:
            if not repo.update_held_job(s, self.id, self.worker.worker_id, **values):
                self.lost.set()
                raise LeaseLost(self.id)
            if event:
                type_, message, data = event
                repo.add_event(s, self.id, type_, message, data, state=state)
            s.commit()


class _Callbacks(GrpoCallbacks):
    def __init__(self, job: _Job, stopping: threading.Event) -> None:
        self.job, self.stopping = job, stopping

    def on_event(self, event: TrainEvent) -> None:
        progress = _finite(
            {"step": event.step, "max_steps": event.total_steps, "loss": event.loss, "tokens_per_s": event.tokens_per_s}
        )
        data = _finite(event.model_dump(mode="json"))
        self.job.write(
            ("progress", f"step {event.step}/{event.total_steps} loss {event.loss:.4f}", data), progress=progress
        )
        if event.eval_loss is not None:
            data = _finite({"step": event.step, "eval_loss": event.eval_loss})
            self.job.write(("eval", f"eval loss {event.eval_loss:.4f}", data))

    def on_step(self, report: StepReport, total_steps: int) -> None:
        data = _finite(step_data(report, total_steps))
        progress = {k: data[k] for k in ("step", "loss", "reward")} | {"max_steps": total_steps}
        message = f"step {data['step']}/{total_steps} reward {report.reward:.3f} kl k3 {report.kl_k3:.1e}"
        self.job.write(("progress", message, data), progress=progress)

    def on_checkpoint(self, step: int, path: Path) -> None:
        w, job = self.job.worker, self.job
        prefix = f"checkpoints/{job.row.tenant_id}/{job.id}/{path.name}/"
        w.store.put_tree(prefix, path)
        job.write(
            ("checkpoint", f"checkpoint at step {step} uploaded", {"step": step, "key": prefix}),
            last_checkpoint_step=step,
            last_checkpoint_key=prefix,
        )

    def should_stop(self) -> bool:
        return self.job.cancel.is_set() or self.job.lost.is_set() or self.stopping.is_set()


class JobWorker:
    """Claims and runs jobs until `stopping` is set."""

    def __init__(self, settings: Settings, worker_id: str | None = None, stopping: threading.Event | None = None):
        if not settings.s3_endpoint:
            raise ValueError("a job worker needs INKWELL_S3_ENDPOINT (the service's S3 store)")
        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = stopping or threading.Event()
        self.db_engine = make_db_engine(settings.resolved_database_url)
        self.sm: sessionmaker[Session] = make_sessionmaker(self.db_engine)
        self.store = ObjectStore(
            settings.s3_endpoint, settings.bucket, settings.s3_region, settings.s3_access_key, settings.s3_secret_key
        )
        self.lease = timedelta(seconds=settings.lease_seconds)
        self.scratch = settings.data_dir / "work" / self.worker_id.replace(":", "-").replace("/", "-")

    def run_forever(self) -> None:
        log.info("worker %s polling for jobs", self.worker_id)
        done = threading.Event()
        presence = threading.Thread(target=self._beat, args=(done,), name="worker-heartbeat", daemon=True)
        presence.start()
        outages = 0  # infrastructure failures in a row
        try:
            while not self.stopping.is_set():
                try:
                    ran = self.run_once()
                    outages = 0
                except (OperationalError, StorageUnavailable) as exc:
                    outages += 1
                    delay = self.backoff_seconds(outages)
                    log.warning("worker %s: %s; next claim in %.1fs", self.worker_id, outage_line(exc), delay)
                    self.stopping.wait(delay)
                    continue
                if not ran:
                    self.stopping.wait(self.settings.worker_poll_seconds)
        finally:
            done.set()
            presence.join()
            with contextlib.suppress(OperationalError), self.sm() as s:
                repo.remove_worker(s, self.worker_id)
                s.commit()
            self.db_engine.dispose()

    def _beat(self, done: threading.Event) -> None:
        """Renew this worker's row in `job_workers` every heartbeat until `done`, job or no job: the service
        counts live workers by these rows, which workers on any host write to the one database."""
        while True:
            try:
                with self.sm() as s:
                    repo.beat_worker(s, self.worker_id)
                    s.commit()
            except OperationalError as exc:
                log.warning("worker %s: heartbeat failed (will retry): %s", self.worker_id, outage_line(exc))
            if done.wait(self.settings.heartbeat_seconds):
                return

    def backoff_seconds(self, outages: int) -> float:
        """The wait before the next claim after `outages` failures in a row: doubling, so that a long outage
        costs few claims, and capped, so that a worker resumes soon after it ends."""
        poll = self.settings.worker_poll_seconds
        return min(poll * 2 ** min(outages, 32), max(MAX_BACKOFF_SECONDS, poll))

    def claim(self) -> JobRow | None:
        with self.sm() as s:
            row = repo.claim_job(s, self.worker_id, self.lease)
            if row is not None:
                resumed = row.last_checkpoint_step
                message = f"claimed by {self.worker_id} (attempt {row.attempts})"
                if resumed:
                    message += f", resuming from checkpoint step {resumed}"
                repo.add_event(
                    s,
                    row.id,
                    "state",
                    message,
                    {"worker": self.worker_id, "attempt": row.attempts, "resume_step": resumed},
                    state="running",
                )
            s.commit()
            return row

    def run_once(self) -> bool:
        """Claim and run one job; False when there was none."""
        row = self.claim()
        if row is None:
            return False
        with _Job(self, row) as job:
            try:
                self._run(job)
            except LeaseLost:
                log.warning("job %s: lease lost; left to the worker that holds it", row.id)
            except (StorageUnavailable, OperationalError) as exc:
                self._hand_back(job, exc)
                raise
        return True

    def _run(self, job: _Job) -> None:
        row = job.row
        with self.sm() as s:
            published = repo.version_for_job(s, row.id)
        if published is not None:  # a previous attempt died between publishing and finishing
            job.write(
                ("state", "job succeeded", {"version": published.version}),
                state="succeeded",
                adapter_version=published.version,
                finished_at=utcnow(),
                lease_expires_at=None,
            )
            return
        if row.attempts > MAX_ATTEMPTS:
            self._fail(job, "too_many_attempts", f"the job was started {MAX_ATTEMPTS} times without finishing")
            return
        work = self.scratch / row.id
        shutil.rmtree(work, ignore_errors=True)
        try:
            try:
                config = self._prepare(job, work)
                run = run_grpo if config.method == "grpo" else train
                result = run(config, _Callbacks(job, self.stopping))
            except TrainingCancelled as exc:
                self._stopped(job, exc.step)
                return
            except TrainConfigError as exc:
                self._fail(job, "invalid_job", str(exc))
                return
            except (StorageUnavailable, OperationalError, LeaseLost):
                raise
            except Exception as exc:  # noqa: BLE001 - any trainer crash fails the job with its reason
                log.error("job %s crashed:\n%s", row.id, traceback.format_exc())
                self._fail(job, "training_error", f"{type(exc).__name__}: {exc}")
                return
            self._publish(job, result)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _prepare(self, job: _Job, work: Path) -> TrainJobConfig | GrpoJobConfig:
        """The job's trainer config, with its datasets (and its last checkpoint, to resume) downloaded into `work`."""
        row = job.row
        with self.sm() as s:
            base = repo.get_base_model(s, row.base_model)
            dataset = repo.get_dataset(s, row.tenant_id, row.dataset_id)
            eval_ds = repo.get_dataset(s, row.tenant_id, row.eval_dataset_id) if row.eval_dataset_id else None
        if dataset is None or (row.eval_dataset_id and eval_ds is None):
            gone = row.dataset_id if dataset is None else row.eval_dataset_id
            raise TrainConfigError(f"dataset {gone} was deleted before the job started")
        checkpoint = row.last_checkpoint_key
        resume_from = work / "resume" / checkpoint.rstrip("/").rsplit("/", 1)[-1] if checkpoint else None
        config = train_config(row, Path(base.path), work, self.settings, resume_from)
        self.store.download_file(dataset.s3_key, config.dataset_path)
        if eval_ds is not None:
            self.store.download_file(eval_ds.s3_key, config.eval_dataset_path)
        if resume_from is not None:
            self.store.download_tree(checkpoint, resume_from)
        return config

    def _publish(self, job: _Job, result: TrainResult) -> None:
        row = job.row
        with self.sm() as s:
            base = repo.get_base_model(s, row.base_model)
        metrics = _finite(
            {
                "steps": result.steps,
                "tokens": result.tokens,
                "first_loss": result.first_loss,
                "final_loss": result.final_loss,
                "initial_eval_loss": result.initial_eval_loss,
                "final_eval_loss": result.final_eval_loss,
                "seconds": result.seconds,
                **result.metrics,
            }
        )
        pub = Publication(
            tenant_id=row.tenant_id,
            name=row.adapter_name,
            base_model=row.base_model,
            base_config_sha256=base.config_sha256,
            layout_dirs={k: Path(v) for k, v in result.adapter_dirs.items()},
            lora=row.lora,
            source="job",
            actor=None,
            job_id=row.id,
            dataset_id=row.dataset_id,
            metrics=metrics,
        )
        if job.lost.is_set():
            raise LeaseLost(row.id)
        try:
            version = publish(self.sm, self.store, pub)
        except BaseMismatch as exc:  # the name went to another base model after the job's check at submission
            self._fail(job, exc.code, exc.message)
            return
        job.write(("published", f"published {row.adapter_name}@{version.version}", {"version": version.version}))
        job.write(
            ("state", "job succeeded", {"version": version.version, **metrics}),
            state="succeeded",
            adapter_version=version.version,
            finished_at=utcnow(),
            lease_expires_at=None,
            progress=_finite(
                {
                    "step": result.metrics.get("resumed_from_step", 0) + result.steps,
                    "max_steps": row.hyperparameters.get("max_steps"),
                    "loss": result.final_loss,
                    "tokens_per_s": result.metrics.get("tokens_per_s"),
                    "reward": result.metrics.get("final_reward"),
                }
            ),
        )

    def _fail(self, job: _Job, code: str, message: str) -> None:
        job.write(
            ("state", f"job failed: {message}", {"code": code}),
            state="failed",
            error_code=code,
            error_message=message,
            finished_at=utcnow(),
            lease_expires_at=None,
        )

    def _hand_back(self, job: _Job, exc: Exception) -> None:
        """Re-queue the job after an infrastructure failure, its claim not counted as an attempt (`_requeue`).

        While the database is down too the write is retried, the lease still held (the heartbeat renews it
        once the database answers), for up to one lease period; after that the lease expires and the next
        claim counts, as for a worker that died.
        """
        # The tenant's event names the kind of outage only; the exception's text (endpoints, SQL) is for the log.
        what = "storage" if isinstance(exc, StorageUnavailable) else "database"
        deadline = time.monotonic() + self.settings.lease_seconds
        while True:
            try:
                if job.cancel.is_set():
                    self._cancelled(job, f"job cancelled ({what} unavailable)", {})
                    return
                self._requeue(job, f"{what} unavailable; job re-queued, attempt not counted", {"reason": what})
                log.warning("job %s re-queued: %s unavailable: %s", job.id, what, outage_line(exc))
                return
            except LeaseLost:
                return
            except OperationalError as again:
                if time.monotonic() >= deadline or self.stopping.wait(min(1.0, self.settings.heartbeat_seconds)):
                    log.warning("job %s: could not re-queue it (%s); its lease will expire", job.id, outage_line(again))
                    return

    def _cancelled(self, job: _Job, message: str, data: dict) -> None:
        job.write(("state", message, data), state="cancelled", finished_at=utcnow(), lease_expires_at=None)

    def _stopped(self, job: _Job, step: int) -> None:
        if job.lost.is_set():
            raise LeaseLost(job.id)
        if job.cancel.is_set():
            self._cancelled(job, f"job cancelled at step {step}", {"step": step})
            return
        # The worker is shutting down: hand the job back so another worker resumes it now.
        self._requeue(
            job, f"worker {self.worker_id} stopped at step {step}; job re-queued, attempt not counted", {"step": step}
        )

    def _requeue(self, job: _Job, message: str, data: dict) -> None:
        """Hand the job back to `queued`, its claim not counted as an attempt (the claim counted one): attempts
        count tries the job itself may have ended, and an outage or a worker's shutdown is neither."""
        job.write(
            ("state", message, data),
            state="queued",
            worker_id=None,
            lease_expires_at=None,
            attempts=JobRow.attempts - 1,
        )
