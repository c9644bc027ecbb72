"""`/healthz` and `/metrics` (Prometheus); no API key needed."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

import inkwell
from inkwell.service.schemas import Health

router = APIRouter(tags=["health"])


def _database_ok(request: Request) -> bool:
    try:
        with request.app.state.read_sessionmaker() as s:
            s.execute(text("SELECT 1"))
        return True
    except Exception:  # noqa: BLE001 - any failure means "unavailable" here
        return False


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request) -> JSONResponse:
    db_ok = _database_ok(request)
    s3_ok = request.app.state.store.ping()
    health = Health(
        status="ok" if db_ok and s3_ok else "degraded",
        database="ok" if db_ok else "unavailable",
        storage="ok" if s3_ok else "unavailable",
        version=inkwell.__version__,
    )
    return JSONResponse(health.model_dump(), status_code=200 if health.status == "ok" else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
