"""`create_app(settings) -> FastAPI`: the job service and adapter registry.

The lifespan owns what the process starts: the database (migrated to head), the object store
(an embedded SeaweedFS when no endpoint is configured), base-model registration and the
periodic orphan cleanup. `app.state` holds settings, engine, sessionmaker (writes),
read_sessionmaker (reads; on SQLite it never waits for the writer), store, s3_endpoint, metrics.

Extensions: every module named in EXTENSION_MODULES that can be imported contributes its
`router` (an APIRouter) and, optionally, `lifespan(app)` (an async context manager entered
after the core is up). The serving tier plugs in this way (`inkwell.service.routers.openai`).
"""

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

from fastapi import APIRouter, Depends, FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import inkwell
from inkwell.service import console
from inkwell.service.bootstrap import ensure_preset_models
from inkwell.service.db.migrate import upgrade_database
from inkwell.service.db.session import make_db_engine, make_sessionmaker
from inkwell.service.deps import refuse_nul
from inkwell.service.errors import error_response, install_error_handlers
from inkwell.service.metrics import Metrics, MetricsMiddleware
from inkwell.service.registry import cleanup_orphans
from inkwell.service.routers import adapters, datasets, health, jobs, models
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore, StorageUnavailable
from inkwell.service.storage.seaweed import start_embedded

log = logging.getLogger("inkwell.service")
CORE_ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    models.router,
    datasets.router,
    jobs.router,
    adapters.router,
    console.router,
)
EXTENSION_MODULES: tuple[str, ...] = (
    "inkwell.service.routers.openai",
    "inkwell.service.routers.sessions",
    "inkwell.service.routers.tinker",
)
CLEANUP_INTERVAL_SECONDS = 600.0
# Multipart framing on top of the file itself.
UPLOAD_OVERHEAD_BYTES = 64 * 1024


def _extensions(names: Sequence[str]) -> list:
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return found


class BodyLimitMiddleware:
    """413 before parsing when Content-Length already exceeds the upload limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length and length.isdigit() and int(length) > self.limit:
                response = error_response(
                    413,
                    "payload_too_large",
                    f"request body of {int(length)} bytes is over the {self.limit}-byte limit; "
                    "split the upload or raise INKWELL_MAX_UPLOAD_BYTES",
                    {"retryable": False, "limit_bytes": self.limit - UPLOAD_OVERHEAD_BYTES},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _cleanup_loop(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    while True:
        try:
            await asyncio.to_thread(
                cleanup_orphans, app.state.sessionmaker, app.state.store, settings.orphan_grace_seconds
            )
        except StorageUnavailable as exc:
            log.warning("orphan cleanup skipped: %s", exc)
        await asyncio.sleep(CLEANUP_INTERVAL_SECONDS)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    await asyncio.to_thread(upgrade_database, url)
    db_engine = make_db_engine(url)
    read_db_engine = make_db_engine(url, write_intent=False) if url.startswith("sqlite") else db_engine
    sm, read_sm = make_sessionmaker(db_engine), make_sessionmaker(read_db_engine)
    seaweed = None
    endpoint = settings.s3_endpoint
    if not endpoint:
        # Started in the loop's thread, not a pool thread: weed's parent-death signal follows the starting thread.
        seaweed, settings = start_embedded(settings)
        endpoint = settings.s3_endpoint
        app.state.settings = settings  # the serving tier reads the store's keys from here
        log.info("embedded SeaweedFS serving S3 at %s", endpoint)
    store = ObjectStore(endpoint, settings.bucket, settings.s3_region, settings.s3_access_key, settings.s3_secret_key)
    app.state.sessionmaker, app.state.read_sessionmaker = sm, read_sm
    app.state.store, app.state.s3_endpoint = store, endpoint
    app.state.metrics = Metrics(read_sm, timedelta(seconds=settings.lease_seconds))
    cleanup = None
    try:
        await asyncio.to_thread(store.ensure_bucket)
        await asyncio.to_thread(ensure_preset_models, sm, settings.base_models, settings.data_dir / "models")
        cleanup = asyncio.create_task(_cleanup_loop(app))
        async with contextlib.AsyncExitStack() as stack:
            for ext in app.state.extensions:
                if hasattr(ext, "lifespan"):
                    await stack.enter_async_context(ext.lifespan(app))
            yield
    finally:
        if cleanup is not None:
            cleanup.cancel()
        if seaweed is not None:
            await asyncio.to_thread(seaweed.stop)
        db_engine.dispose()
        read_db_engine.dispose()


def create_app(settings: Settings | None = None, extension_modules: Sequence[str] = EXTENSION_MODULES) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(
        title="inkwell",
        version=inkwell.__version__,
        description="LoRA fine-tuning jobs and an adapter registry for Inkling models. See docs/api.md.",
        lifespan=_lifespan,
        dependencies=[Depends(refuse_nul)],  # every route, extensions included: no NUL reaches SQL from a URL
    )
    app.state.settings = settings
    app.state.extensions = _extensions(extension_modules)
    install_error_handlers(app)
    for router in CORE_ROUTERS:
        app.include_router(router)
    for ext in app.state.extensions:
        if hasattr(ext, "router"):
            app.include_router(ext.router)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_upload_bytes + UPLOAD_OVERHEAD_BYTES)
    app.add_middleware(MetricsMiddleware)
    return app
