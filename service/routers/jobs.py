"""`/v1/jobs`: create, list, get, cancel, and follow a job's events (JSON, SSE, plain logs)."""

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy.orm import Session

from inkwell.service.auth import Principal, current_principal
from inkwell.service.db import repo
from inkwell.service.db.models import JobEventRow, JobRow
from inkwell.service.deps import Paging, get_session, get_settings
from inkwell.service.errors import APIError, not_found
from inkwell.service.jobs import train_config
from inkwell.service.registry import check_base, check_name
from inkwell.service.routers.models import require_base_model
from inkwell.service.schemas import (
    TERMINAL_STATES,
    Job,
    JobCreate,
    JobErrorInfo,
    JobEvent,
    JobProgress,
    JobState,
    Page,
)
from inkwell.service.settings import Settings
from inkwell.trainer.config import MAX_INT64, TrainConfigError, dataset_problem

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
KEEPALIVE_SECONDS = 15.0
POLL_SECONDS = 0.5


def job_view(row: JobRow) -> Job:
    return Job(
        id=row.id,
        state=row.state,
        base_model=row.base_model,
        dataset_id=row.dataset_id,
        eval_dataset_id=row.eval_dataset_id,
        adapter_name=row.adapter_name,
        adapter_version=row.adapter_version,
        method=row.method,
        lora=row.lora,
        hyperparameters=row.hyperparameters,
        progress=JobProgress(**{"max_steps": row.hyperparameters.get("max_steps", 0), **row.progress}),
        error=JobErrorInfo(code=row.error_code, message=row.error_message or "") if row.error_code else None,
        cancel_requested=row.cancel_requested,
        attempts=row.attempts,
        last_checkpoint_step=row.last_checkpoint_step,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def event_view(row: JobEventRow) -> JobEvent:
    return JobEvent.model_validate(row)


def check_trainable(body: JobCreate, settings: Settings) -> None:
    """Build the job's trainer config as the worker will, so a job the trainer would refuse (e.g. batch_size
    not divisible by grad_accum) fails now with 422 instead of later on a worker. Building it reads no file,
    so the base model and work directory only have to be some paths."""
    try:
        train_config(body, Path("."), Path("."), settings)
    except TrainConfigError as exc:
        where = exc.field or "hyperparameters"
        raise APIError(422, "invalid_job", f"{where}: {exc.reason}", field=where, reason=exc.reason) from exc


def _own_job(s: Session, who: Principal, job_id: str) -> JobRow:
    row = repo.get_job(s, who.tenant_id, job_id)
    if row is None:
        raise not_found("job", job_id)
    return row


@router.post("", status_code=201, response_model=Job)
def create_job(
    body: JobCreate,
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
    settings: Settings = Depends(get_settings),
) -> Job:
    check_name(body.adapter_name)
    check_trainable(body, settings)
    require_base_model(s, body.base_model)
    for field in ("dataset_id", "eval_dataset_id"):
        dataset_id = getattr(body, field)
        if not dataset_id:
            continue
        dataset = repo.get_dataset(s, who.tenant_id, dataset_id, lock=True)  # a delete of it waits for this job
        if dataset is None:
            raise not_found("dataset", dataset_id)
        # refused now, not on a worker mid-run: the method's data (completions to learn, answers to verify)
        if problem := dataset_problem(body.method, dataset.format, body.hyperparameters):
            raise APIError(422, "invalid_job", f"{field}: {problem}", field=field, reason=problem)
    # Refused now if the name is another base's already; the publish checks again, under the adapter's lock.
    check_base(repo.get_adapter(s, who.tenant_id, body.adapter_name), body.adapter_name, body.base_model)
    row = repo.insert_job(
        s,
        tenant_id=who.tenant_id,
        base_model=body.base_model,
        dataset_id=body.dataset_id,
        eval_dataset_id=body.eval_dataset_id,
        adapter_name=body.adapter_name,
        method=body.method,
        lora=body.lora.model_dump(mode="json"),
        hyperparameters=body.hyperparameters.model_dump(mode="json"),
    )
    s.commit()
    return job_view(row)


@router.get("", response_model=Page[Job])
def list_jobs(
    state: JobState | None = Query(None),
    adapter_name: str | None = Query(None),
    base_model: str | None = Query(None),
    paging: Paging = Depends(),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> Page[Job]:
    rows, cursor = repo.list_jobs(
        s, who.tenant_id, paging.limit, paging.cursor, state=state, adapter_name=adapter_name, base_model=base_model
    )
    return Page[Job](data=[job_view(r) for r in rows], next_cursor=cursor)


@router.get("/{job_id}", response_model=Job)
def get_job(job_id: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> Job:
    return job_view(_own_job(s, who, job_id))


@router.post("/{job_id}/cancel", response_model=Job)
def cancel_job(job_id: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> Job:
    row = _own_job(s, who, job_id)
    if row.state in ("succeeded", "failed"):
        raise APIError(
            409, "job_not_cancellable", f"job {job_id} already {row.state}; nothing to cancel", state=row.state
        )
    if row.state == "queued" and repo.cancel_queued_job(s, job_id):
        repo.add_event(s, job_id, "state", "job cancelled before it started", state="cancelled")
    elif row.state != "cancelled":
        # No event here: while a job runs only its worker writes events, so their ids commit in
        # order and an event stream that resumes after an id never skips one.
        repo.request_cancel(s, job_id)
    repo.audit(s, who.tenant_id, who.key_id, "job.cancel", job_id)
    s.commit()
    s.expire_all()
    return job_view(_own_job(s, who, job_id))


@router.get("/{job_id}/events", response_model=Page[JobEvent])
def list_events(
    job_id: str,
    after: int = Query(0, ge=0, le=MAX_INT64, description="return events with a larger id"),
    limit: int = Query(200, ge=1, le=1000),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> Page[JobEvent]:
    _own_job(s, who, job_id)
    return Page[JobEvent](data=[event_view(e) for e in repo.list_events(s, job_id, after, limit)], next_cursor=None)


def _resume_point(last_event_id: str | None, after: int) -> int:
    """Where a stream starts: `Last-Event-ID` when it is an event id, else `after`. Checked before the stream
    starts: an id past any event's (which SQLite cannot even bind) would otherwise fail inside the stream and
    drop the connection instead of answering 422."""
    if not (last_event_id and last_event_id.isascii() and last_event_id.isdigit()):
        return after
    if int(last_event_id) > MAX_INT64:
        reason = f"must be at most {MAX_INT64}, an event id this API sent"
        errors = [{"loc": ["header", "last-event-id"], "msg": reason, "type": "less_than_equal"}]
        raise APIError(422, "validation_error", f"header.last-event-id: {reason}", errors=errors)
    return int(last_event_id)


def _sse(event: JobEvent) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.model_dump(mode='json'))}\n\n"


@router.get("/{job_id}/events/stream", response_class=StreamingResponse)
def stream_events(
    job_id: str,
    request: Request,
    after: int = Query(0, ge=0, le=MAX_INT64),
    last_event_id: str | None = Header(None),
    who: Principal = Depends(current_principal),
) -> StreamingResponse:
    """Server-sent events until the job reaches a terminal state (no session is held while streaming)."""
    start = _resume_point(last_event_id, after)
    sm = request.app.state.read_sessionmaker
    with sm() as s:
        _own_job(s, who, job_id)

    def poll(cursor: int) -> tuple[list[JobEvent], str]:
        # State first: a terminal state is committed with its events, so reading the events after
        # it can never miss them (under READ COMMITTED the reverse order could end the stream early).
        with sm() as fresh:
            state = repo.get_job(fresh, who.tenant_id, job_id).state
            events = [event_view(e) for e in repo.list_events(fresh, job_id, cursor, 500)]
            return events, state

    async def stream() -> AsyncIterator[str]:
        cursor, idle = start, 0.0
        while not await request.is_disconnected():
            events, state = await run_in_threadpool(poll, cursor)
            for event in events:
                cursor = event.id
                yield _sse(event)
            if not events and state in TERMINAL_STATES:
                return
            if events:
                idle = 0.0
                continue
            await asyncio.sleep(POLL_SECONDS)
            idle += POLL_SECONDS
            if idle >= KEEPALIVE_SECONDS:
                idle = 0.0
                yield ": keepalive\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(job_id: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> str:
    _own_job(s, who, job_id)
    lines, cursor = [], 0
    while batch := repo.list_events(s, job_id, cursor, 1000):
        lines += [f"{e.created_at.isoformat()} {e.type} {e.message}" for e in batch]
        cursor = batch[-1].id
    return "\n".join(lines) + "\n"
