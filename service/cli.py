"""`inkwell serve`, `inkwell worker` and `inkwell admin ...`: run the service and manage tenants.

`inkwell serve` with no configuration is the embedded default: a SQLite file and a SeaweedFS
under `.inkwell/`, one job worker process, and a local API key printed on first start. It supervises what
it starts: its children die with it (even on `kill -9`), and a job worker that dies is restarted.
"""

import logging
import os
import signal
import socket
import sys
from pathlib import Path

import typer
import uvicorn

from inkwell import terminal
from inkwell.service.db import repo
from inkwell.service.db.migrate import upgrade_database
from inkwell.service.db.session import make_db_engine, make_sessionmaker
from inkwell.service.processes import Supervisor
from inkwell.service.registry import cleanup_orphans
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore
from inkwell.service.storage.seaweed import start_embedded
from inkwell.service.tinker.auth import tinker_key

console = terminal.console()
admin_app = typer.Typer(
    help="Manage tenants, API keys and base models (talks to the database directly).", no_args_is_help=True
)


def _settings(data_dir: Path | None) -> Settings:
    settings = Settings()
    if data_dir is not None:
        settings = settings.model_copy(update={"data_dir": data_dir})
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings


def _sessionmaker(settings: Settings):
    url = settings.resolved_database_url
    upgrade_database(url)
    return make_sessionmaker(make_db_engine(url))


def _worker_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        INKWELL_DATA_DIR=str(settings.data_dir.resolve()),
        INKWELL_DATABASE_URL=settings.resolved_database_url,
        INKWELL_S3_ENDPOINT=settings.s3_endpoint or "",
        INKWELL_S3_ACCESS_KEY=settings.s3_access_key or "",
        INKWELL_S3_SECRET_KEY=settings.s3_secret_key or "",
        INKWELL_BUCKET=settings.bucket,
    )
    return env


def _refuse_a_busy_address(host: str, port: int) -> None:
    """Exit before anything starts when the API's address is taken: uvicorn finds out only after the object store
    and the job workers are up (and a first start's tenant and key are made)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            terminal.print_error(console, f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port")
            raise typer.Exit(1) from exc


def serve(
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    port: int = typer.Option(8000),
    data_dir: Path = typer.Option(None, help="default: INKWELL_DATA_DIR or ./.inkwell"),
    workers: int = typer.Option(1, min=0, help="job worker processes to run beside the API"),
) -> None:
    """Run the API, its object store (embedded SeaweedFS unless INKWELL_S3_ENDPOINT) and job workers."""
    _refuse_a_busy_address(host, port)
    from inkwell.service.app import create_app
    from inkwell.service.bootstrap import LOCAL_TENANT, ensure_local_key

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = _settings(data_dir)
    sm = _sessionmaker(settings)
    key = ensure_local_key(sm)
    seaweed = None
    if not settings.s3_endpoint:
        try:
            seaweed, settings = start_embedded(settings)
        except RuntimeError as exc:
            terminal.print_error(console, str(exc))
            raise typer.Exit(1) from exc
        console.print(f"embedded SeaweedFS: S3 at {settings.s3_endpoint}")
    if workers:  # what this service runs it expects to be alive: /healthz says degraded while none is
        settings = settings.model_copy(update={"min_job_workers": max(settings.min_job_workers, 1)})
    worker_args = [sys.executable, "-m", "inkwell.service.workers"]
    job_workers = Supervisor("job worker", worker_args, _worker_env(settings), workers)
    job_workers.start()
    if key:
        console.print(f"created tenant '{LOCAL_TENANT}'; its API key (shown once): [bold]{key}[/]")
        console.print(f"  export INKWELL_URL=http://{host}:{port} INKWELL_API_KEY={key}")
        tinker = f"export TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY={tinker_key(key)}"
        console.print(f"  {tinker}  # for the tinker client")
    else:
        console.print(f"tenant '{LOCAL_TENANT}' exists; make a new key with `inkwell admin create-key {LOCAL_TENANT}`")
    # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into an exit so `finally` runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(
            create_app(settings),
            host=host,
            port=port,
            log_level="info",
            # requests still open this long after SIGTERM (a job's event stream whose client is gone, which never
            # ends on its own) are cancelled: without a bound, uvicorn waits for them and the service never stops
            timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        )
    finally:
        job_workers.stop()
        if seaweed is not None:
            seaweed.stop()


def worker(data_dir: Path = typer.Option(None)) -> None:
    """Run one job worker (needs INKWELL_S3_ENDPOINT and the service's INKWELL_DATABASE_URL)."""
    settings = _settings(data_dir)
    if not settings.s3_endpoint:
        console.print("[red]set INKWELL_S3_ENDPOINT[/] to the S3 endpoint the service uses")
        raise typer.Exit(2)
    os.environ["INKWELL_DATA_DIR"] = str(settings.data_dir)
    from inkwell.service.workers.__main__ import main

    main()


@admin_app.command("create-tenant")
def create_tenant(name: str, data_dir: Path = typer.Option(None)) -> None:
    """Create a tenant and print its first API key."""
    sm = _sessionmaker(_settings(data_dir))
    with sm() as s:
        if repo.tenant_by_name(s, name):
            terminal.print_error(
                console, f"tenant {name!r} already exists; add a key with `inkwell admin create-key {name}`"
            )
            raise typer.Exit(1)
        tenant = repo.create_tenant(s, name)
        _, key = repo.create_api_key(s, tenant.id)
        s.commit()
    shown = f"tenant {name} ({tenant.id})\nAPI key (shown once): {key}\n  as a Tinker key: {tinker_key(key)}"
    terminal.print_plain(console, shown)


@admin_app.command("create-key")
def create_key(tenant: str, name: str = typer.Option("default"), data_dir: Path = typer.Option(None)) -> None:
    """Create another API key for a tenant."""
    sm = _sessionmaker(_settings(data_dir))
    with sm() as s:
        row = repo.tenant_by_name(s, tenant)
        if row is None:
            terminal.print_error(
                console, f"no tenant {tenant!r}; create it with `inkwell admin create-tenant {tenant}`"
            )
            raise typer.Exit(1)
        key_row, key = repo.create_api_key(s, row.id, name)
        s.commit()
    shown = f"key {key_row.id} for {tenant} (shown once): {key}\n  as a Tinker key: {tinker_key(key)}"
    terminal.print_plain(console, shown)


@admin_app.command("revoke-key")
def revoke_key(key_id: str, data_dir: Path = typer.Option(None)) -> None:
    """Revoke an API key by its id (key_...)."""
    sm = _sessionmaker(_settings(data_dir))
    with sm() as s:
        ok = repo.revoke_api_key(s, key_id)
        s.commit()
    if not ok:
        terminal.print_error(console, f"no active key {key_id!r}")
        raise typer.Exit(1)
    terminal.print_plain(console, f"revoked {key_id}")


@admin_app.command("add-base-model")
def add_base_model(name: str, model_dir: Path, data_dir: Path = typer.Option(None)) -> None:
    """Register an Inkling checkpoint directory as a base model: transformers' or the released names, one
    safetensors file or shards with their index, a text or multimodal config. Everything is checked first."""
    from inkwell.models import BaseModelError
    from inkwell.service.bootstrap import register_base_model

    sm = _sessionmaker(_settings(data_dir))
    try:
        with sm() as s:
            checkpoint = register_base_model(s, name, model_dir)
            s.commit()
    except BaseModelError as exc:
        terminal.print_error(console, str(exc))
        raise typer.Exit(2) from exc
    for note in checkpoint.notes:
        terminal.print_plain(console, f"note: {note}")
    terminal.print_plain(console, f"registered base model {name} -> {model_dir.resolve()}")


@admin_app.command("cleanup")
def cleanup(
    grace_seconds: float = typer.Option(3600.0, help="only objects older than this"),
    data_dir: Path = typer.Option(None),
) -> None:
    """Remove orphan registry objects and finished jobs' checkpoints from S3."""
    settings = _settings(data_dir)
    if not settings.s3_endpoint:
        console.print("[red]set INKWELL_S3_ENDPOINT[/] (or run `inkwell serve`, which cleans up periodically)")
        raise typer.Exit(2)
    store = ObjectStore(
        settings.s3_endpoint, settings.bucket, settings.s3_region, settings.s3_access_key, settings.s3_secret_key
    )
    removed = cleanup_orphans(_sessionmaker(settings), store, grace_seconds)
    console.print(f"removed {removed} objects")


def register(app: typer.Typer) -> None:
    """Mount `serve`, `worker` and `admin` on the top-level `inkwell` command."""
    app.command("serve")(serve)
    app.command("worker")(worker)
    app.add_typer(admin_app, name="admin")
