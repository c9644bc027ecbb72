"""`/healthz` and `/metrics` (Prometheus); no API key needed."""

from datetime import timedelta

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import inkwell
from inkwell.service.db import repo
from inkwell.service.schemas import Health
from inkwell.service.settings import Settings

router = APIRouter(tags=["health"])


def _live_job_workers(request: Request) -> int | None:
    """Job workers whose heartbeat is within the lease, on any host; None when the database does not answer."""
    settings: Settings = request.app.state.settings
    try:
        with request.app.state.read_sessionmaker() as s:
            return repo.count_live_workers(s, timedelta(seconds=settings.lease_seconds))
    except Exception:  # noqa: BLE001 - any failure means "unavailable" here
        return None


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request) -> JSONResponse:
    workers = _live_job_workers(request)
    db_ok = workers is not None
    s3_ok = request.app.state.store.ping()
    enough_workers = db_ok and workers >= request.app.state.settings.min_job_workers
    health = Health(
        status="ok" if db_ok and s3_ok and enough_workers else "degraded",
        database="ok" if db_ok else "unavailable",
        storage="ok" if s3_ok else "unavailable",
        job_workers=workers,
        version=inkwell.__version__,
    )
    return JSONResponse(health.model_dump(), status_code=200 if health.status == "ok" else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
