"""`inkwell jobs`, `datasets`, `adapters` and `sessions ...`: the SDK on the command line.

Every command takes `--url` / `--api-key` (or INKWELL_URL / INKWELL_API_KEY) and `--json` where
it prints objects. Errors print the service's code and message and exit with status 1.
"""

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from inkwell import terminal
from inkwell.sdk.client import API_KEY_ENV, URL_ENV, Client
from inkwell.sdk.errors import InkwellError
from inkwell.sdk.jobs import Job
from inkwell.service.sessions.schemas import Session

jobs_app = typer.Typer(help="Fine-tuning jobs: create, list, follow, wait for, cancel.", no_args_is_help=True)
adapters_app = typer.Typer(help="The adapter registry: list, download, import, alias, delete.", no_args_is_help=True)
sessions_app = typer.Typer(help="Training sessions: list, show, close.", no_args_is_help=True)
datasets_app = typer.Typer(help="Uploaded datasets: list, upload, delete.", no_args_is_help=True)
out = terminal.console()
err = terminal.console(stderr=True)

Url = Annotated[str | None, typer.Option("--url", envvar=URL_ENV, help="service URL", show_default=False)]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar=API_KEY_ENV, help="API key", show_default=False)]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _reports_errors[**P, R](command: Callable[P, R]) -> Callable[P, R]:
    """Turn SDK errors into one red line (code, message, details) and exit status 1; Ctrl+C into its notes and 130."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except InkwellError as exc:
            details = {k: v for k, v in exc.details.items() if k != "retryable"}
            err.print(f"[red]error[/] [bold]{escape(exc.code)}[/]: {escape(exc.message)}", highlight=False)
            if details:
                terminal.print_plain(err, json.dumps(details, default=str))
            raise typer.Exit(1) from exc
        except (FileNotFoundError, TypeError) as exc:
            err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            raise typer.Exit(1) from exc
        except KeyboardInterrupt as exc:  # Ctrl+C: what it left behind, if anything (a job still running)
            for note in getattr(exc, "__notes__", ()):
                terminal.print_plain(err, note)
            raise typer.Exit(130) from exc

    return wrapper


def _print_json(value: Any) -> None:
    def plain(v: Any) -> Any:
        if isinstance(v, Job):
            return v.info.model_dump(mode="json")
        if isinstance(v, BaseModel):
            return v.model_dump(mode="json")
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    out.print_json(json.dumps(plain(value), default=str))


KEY_COLUMNS = ("id", "name", "source", "adapter")  # what users copy into the next command: never cut
PIPE_WIDTH = 1_000  # wider than any table: a table printed into a pipe takes the width it needs


def _table(columns: list[str], rows: list[list[Any]]) -> None:
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    table = Table(box=None, header_style="bold")
    for i, column in enumerate(columns):
        if column in KEY_COLUMNS:
            width = max([len(column)] + [len(row[i]) for row in cells])
            table.add_column(column, no_wrap=True, min_width=width)
        else:
            table.add_column(column)
    for row in cells:
        table.add_row(*(Text(c) for c in row))  # plain text: server strings are not rich markup
    # into a pipe or a file at its own width: fitted to rich's 80 columns there, a cell was cut ("c…" for closed)
    # and a `grep` or a script read the cut text
    (out if out.is_terminal else Console(file=out.file, width=PIPE_WIDTH)).print(table)


def _listing(columns: list[str], rows: list[list[Any]], empty: str) -> None:
    """A list command's table; with no rows, `empty` on stderr (what to do next) instead of a bare header."""
    if rows:
        _table(columns, rows)
    else:
        terminal.print_plain(err, empty)


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else ""


def _job_row(job: Job) -> list[Any]:
    p = job.progress
    loss = f"{p.loss:.4f}" if p.loss is not None else ""
    version = job.info.adapter_version
    adapter = f"{job.adapter_name}@{version}" if version else job.adapter_name
    return [
        job.id,
        job.state,
        job.info.base_model,
        adapter,
        f"{p.step}/{p.max_steps}",
        loss,
        _when(job.info.created_at),
    ]


JOB_COLUMNS = ["id", "state", "base", "adapter", "step", "loss", "created"]


def _show_job(job: Job) -> None:
    _table(JOB_COLUMNS, [_job_row(job)])
    if job.error:
        err.print(f"[red]{escape(job.error.code)}[/]: {escape(job.error.message)}", highlight=False)


# ---- jobs -------------------------------------------------------------------------------------


@jobs_app.command("list")
@_reports_errors
def jobs_list(
    state: Annotated[str | None, typer.Option(help="queued, running, succeeded, failed or cancelled")] = None,
    adapter_name: Annotated[str | None, typer.Option(help="only jobs publishing this adapter")] = None,
    base_model: Annotated[str | None, typer.Option(help="only jobs on this base model")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs, newest first")] = 20,
    as_json: AsJson = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """List jobs, newest first."""
    jobs_iter = Client(url, api_key).jobs.iter(
        state=state, adapter_name=adapter_name, base_model=base_model, page_size=min(limit, 200)
    )
    jobs = [job for _, job in zip(range(limit), jobs_iter, strict=False)]
    if as_json:
        _print_json(jobs)
    else:
        filtered = state or adapter_name or base_model
        empty = "no job matches these filters" if filtered else "no jobs yet: start one with `inkwell jobs create`"
        _listing(JOB_COLUMNS, [_job_row(j) for j in jobs], empty)


@jobs_app.command("get")
@_reports_errors
def jobs_get(job_id: str, as_json: AsJson = False, url: Url = None, api_key: ApiKey = None) -> None:
    """Show one job."""
    job = Client(url, api_key).jobs.get(job_id)
    if as_json:
        return _print_json(job)
    _show_job(job)


@jobs_app.command("cancel")
@_reports_errors
def jobs_cancel(job_id: str, url: Url = None, api_key: ApiKey = None) -> None:
    """Cancel a job (a running one stops within a worker heartbeat)."""
    job = Client(url, api_key).jobs.cancel(job_id)
    pending = " (cancel requested; the worker stops at its next step)" if job.state == "running" else ""
    out.print(f"{job.id}: {job.state}{pending}", highlight=False)


@jobs_app.command("events")
@_reports_errors
def jobs_events(
    job_id: str,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="stream until the job ends")] = True,
    after: Annotated[int | None, typer.Option(help="only events after this event id")] = None,
    as_json: AsJson = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Print a job's events (state changes, progress, checkpoints), live by default."""
    jobs = Client(url, api_key).jobs
    events = jobs.events(job_id, after=after) if follow else jobs.history(job_id, after=after)
    for event in events:
        if as_json:
            out.print(json.dumps(event.model_dump(mode="json")), highlight=False)
            continue
        data = " ".join(f"{k}={_value(v)}" for k, v in event.data.items() if v is not None)
        state = f"[{event.state}] " if event.state else ""
        line = f"{event.id:>6} {_when(event.created_at)} {event.type:<10} {state}{event.message} {data}"
        terminal.print_plain(out, line.rstrip())


@jobs_app.command("wait")
@_reports_errors
def jobs_wait(
    job_id: str,
    timeout: Annotated[
        float | None, typer.Option(help="stop waiting after this many seconds (the job goes on)", show_default=False)
    ] = None,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Follow a job with a progress bar until it ends; exit status 1 if it failed, was cancelled or outlasted
    --timeout."""
    _published(Client(url, api_key).jobs.get(job_id).wait(timeout=timeout))


def _published(job: Job) -> None:
    out.print(f"{job.id} succeeded: published {job.adapter_name}@{job.info.adapter_version}", highlight=False)


@jobs_app.command("logs")
@_reports_errors
def jobs_logs(job_id: str, url: Url = None, api_key: ApiKey = None) -> None:
    """Print a job's log (one line per event)."""
    out.print(Client(url, api_key).jobs.logs(job_id), end="", highlight=False, markup=False)


def _hyperparameter(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise typer.BadParameter(f"{text!r} is not KEY=VALUE (e.g. --set max_steps=50)")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


@jobs_app.command("create")
@_reports_errors
def jobs_create(
    base_model: Annotated[str, typer.Option(help="a base model from `GET /v1/models`")],
    dataset: Annotated[str, typer.Option(help="a JSONL file to upload, or a 'ds_...' id")],
    adapter_name: Annotated[str | None, typer.Option(help="registry name to publish under")] = None,
    rank: Annotated[int | None, typer.Option(help="LoRA rank")] = None,
    alpha: Annotated[float | None, typer.Option(help="LoRA alpha (scaling = alpha / rank)")] = None,
    targets: Annotated[
        str | None, typer.Option(help="comma-separated: attn,mlp,experts,shared_experts,lm_head")
    ] = None,
    eval_dataset: Annotated[str | None, typer.Option(help="JSONL file or 'ds_...' id to evaluate on")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="hyperparameter KEY=VALUE, repeatable")] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="follow the job with a progress bar")] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Create a fine-tuning job (uploading the dataset if it is a file)."""
    lora: dict[str, Any] = {}
    if rank is not None:
        lora["rank"] = rank
    if alpha is not None:
        lora["alpha"] = alpha
    if targets:
        lora["targets"] = [t.strip() for t in targets.split(",") if t.strip()]
    hyperparameters = dict(_hyperparameter(s) for s in set_ or [])
    client = Client(url, api_key)
    job = client.train(
        base_model,
        dataset,
        lora=lora,
        adapter_name=adapter_name,
        eval_dataset=eval_dataset,
        wait=False,
        **hyperparameters,
    )
    out.print(f"created {job.id} ({job.adapter_name}, {job.state})", highlight=False)
    if wait:
        _published(job.wait())


# ---- adapters ---------------------------------------------------------------------------------


@adapters_app.command("list")
@_reports_errors
def adapters_list(
    base_model: Annotated[str | None, typer.Option(help="only adapters of this base model")] = None,
    as_json: AsJson = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """List adapters."""
    adapters = list(Client(url, api_key).adapters.iter(base_model=base_model))
    if as_json:
        return _print_json(adapters)
    rows = [
        [a.name, a.base_model, a.latest_version, a.num_versions, _aliases(a.aliases), _when(a.updated_at)]
        for a in adapters
    ]
    empty = f"no adapters of {base_model}" if base_model else "no adapters yet"
    empty += ": a job publishes one, or `inkwell adapters import` brings one in"
    _listing(["name", "base", "latest", "versions", "aliases", "updated"], rows, empty)


def _aliases(aliases: dict[str, int]) -> str:
    return ", ".join(f"{k}->{v}" for k, v in sorted(aliases.items()))


@adapters_app.command("get")
@_reports_errors
def adapters_get(name: str, as_json: AsJson = False, url: Url = None, api_key: ApiKey = None) -> None:
    """Show one adapter."""
    a = Client(url, api_key).adapters.get(name)
    if as_json:
        return _print_json(a)
    _table(
        ["name", "base", "latest", "versions", "aliases", "created"],
        [[a.name, a.base_model, a.latest_version, a.num_versions, _aliases(a.aliases), _when(a.created_at)]],
    )


@adapters_app.command("versions")
@_reports_errors
def adapters_versions(
    name: str,
    include_deleted: Annotated[bool, typer.Option(help="also list soft-deleted versions")] = False,
    as_json: AsJson = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """List an adapter's versions, newest first."""
    versions = Client(url, api_key).adapters.versions(name, include_deleted=include_deleted, limit=200).data
    if as_json:
        return _print_json(versions)
    rows = []
    for v in versions:
        source = v.lineage.job_id or v.lineage.source
        mib = f"{v.size_bytes / 2**20:.2f}"
        rows.append([v.version, ", ".join(v.aliases), source, mib, _when(v.created_at), "yes" if v.deleted else ""])
    _table(["version", "aliases", "source", "MiB", "created", "deleted"], rows)


@adapters_app.command("download")
@_reports_errors
def adapters_download(
    name: str,
    ref: Annotated[str, typer.Argument(help="version number, alias or 'latest'")] = "latest",
    dest: Annotated[
        Path | None, typer.Option(help="directory to write to (default ./<name>-<version>-<layout>)")
    ] = None,
    layout: Annotated[str, typer.Option(help="sglang or peft")] = "sglang",
    presigned: Annotated[bool, typer.Option(help="fetch straight from S3 via presigned URLs")] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Download a version, verifying every file's sha256."""
    if "/" in ref or os.sep in ref:  # a destination given where the version goes
        message = f"{ref!r} is not a version number, an alias or 'latest'; to choose where to write, pass --dest {ref}"
        raise typer.BadParameter(message, param_hint="ref")
    adapters = Client(url, api_key).adapters
    if dest is None:
        version = adapters.version(name, ref).version
        ref, dest = version, Path(f"{name}-{version}-{layout}")
    got = adapters.download(name, ref, layout=layout, dest=dest, presigned=presigned)
    size = sum(f.size for f in got.files)
    out.print(
        f"{got.name}@{got.version} ({got.layout}, {len(got.files)} files, {size} bytes, sha256 verified) -> {dest}"
    )


@adapters_app.command("import")
@_reports_errors
def adapters_import(
    path: Annotated[Path, typer.Argument(help="adapter directory (adapter_config.json, adapter_model.safetensors)")],
    name: Annotated[str, typer.Option(help="registry name")],
    base_model: Annotated[str, typer.Option(help="base model the adapter belongs to")],
    layout: Annotated[str, typer.Option(help="layout of the directory: sglang or peft")],
    version: Annotated[int | None, typer.Option(help="explicit version number (default: next free)")] = None,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Import an adapter directory as a new version."""
    v = Client(url, api_key).adapters.import_(path, name=name, base_model=base_model, layout=layout, version=version)
    out.print(f"published {v.name}@{v.version} ({v.size_bytes} bytes, layouts sglang + peft)", highlight=False)


@adapters_app.command("alias")
@_reports_errors
def adapters_alias(
    name: str,
    alias: str,
    version: Annotated[int | None, typer.Argument(help="version to point at (omit with --delete)")] = None,
    delete: Annotated[bool, typer.Option("--delete", help="remove the alias")] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Point ALIAS (e.g. prod) at VERSION, or remove it with --delete."""
    if delete == (version is not None):
        raise typer.BadParameter("give either VERSION (to set the alias) or --delete")
    adapters = Client(url, api_key).adapters
    if delete:
        adapters.delete_alias(name, alias)
        out.print(f"removed {name}@{alias}", highlight=False)
    else:
        a = adapters.set_alias(name, alias, version)
        out.print(f"{a.name}@{a.alias} -> {a.version}", highlight=False)


@adapters_app.command("delete")
@_reports_errors
def adapters_delete(name: str, version: int, url: Url = None, api_key: ApiKey = None) -> None:
    """Soft-delete a version (audited; refused while an alias points at it)."""
    v = Client(url, api_key).adapters.delete_version(name, version)
    out.print(f"deleted {v.name}@{v.version}", highlight=False)


# ---- datasets ---------------------------------------------------------------------------------

DATASET_COLUMNS = ["id", "name", "format", "examples", "bytes", "created"]


@datasets_app.command("list")
@_reports_errors
def datasets_list(as_json: AsJson = False, url: Url = None, api_key: ApiKey = None) -> None:
    """List the tenant's datasets, newest first."""
    datasets = list(Client(url, api_key).datasets.iter())
    if as_json:
        return _print_json(datasets)
    rows = [[d.id, d.name, d.format, d.num_examples, d.size_bytes, _when(d.created_at)] for d in datasets]
    _listing(DATASET_COLUMNS, rows, "no datasets yet: upload one with `inkwell datasets upload FILE.jsonl`")


@datasets_app.command("upload")
@_reports_errors
def datasets_upload(
    path: Path, name: str | None = None, as_json: AsJson = False, url: Url = None, api_key: ApiKey = None
) -> None:
    """Upload a JSONL file (chat `messages` or `prompt`/`completion` lines); prints its id."""
    dataset = Client(url, api_key).datasets.upload(path, name=name)
    if as_json:
        return _print_json(dataset)
    out.print(f"{dataset.id} {dataset.name}: {dataset.num_examples} {dataset.format} examples", highlight=False)


@datasets_app.command("delete")
@_reports_errors
def datasets_delete(dataset_id: str, url: Url = None, api_key: ApiKey = None) -> None:
    """Delete a dataset's data (refused while a queued or running job uses it)."""
    Client(url, api_key).datasets.delete(dataset_id)
    out.print(f"deleted {dataset_id}", highlight=False)


# ---- sessions ---------------------------------------------------------------------------------

SESSION_COLUMNS = ["id", "state", "base", "adapter", "step", "pending", "last active", "closed"]


def _session_row(session: Session) -> list[Any]:
    return [
        session.id,
        session.state,
        session.base_model,
        session.adapter_name,
        session.step,
        session.pending,
        _when(session.last_active_at),
        session.closed_code,
    ]


@sessions_app.command("list")
@_reports_errors
def sessions_list(as_json: AsJson = False, url: Url = None, api_key: ApiKey = None) -> None:
    """List the tenant's training sessions, open and recently closed."""
    sessions = Client(url, api_key).sessions.list()
    if as_json:
        return _print_json(sessions)
    _listing(SESSION_COLUMNS, [_session_row(s) for s in sessions], "no training sessions open or recently closed")


@sessions_app.command("get")
@_reports_errors
def sessions_get(session_id: str, as_json: AsJson = False, url: Url = None, api_key: ApiKey = None) -> None:
    """Show one session (why it ended, when it has)."""
    session = Client(url, api_key).sessions.get(session_id).info
    if as_json:
        return _print_json(session)
    _table(SESSION_COLUMNS, [_session_row(session)])
    if session.closed_reason:
        terminal.print_plain(out, session.closed_reason)


@sessions_app.command("close")
@_reports_errors
def sessions_close(session_id: str, url: Url = None, api_key: ApiKey = None) -> None:
    """Close a session and free its device: one a killed program left open, without waiting for its idle
    timeout. Its pending requests fail."""
    session = Client(url, api_key).sessions.get(session_id).close().info
    out.print(f"{session.id}: {session.state} at step {session.step}", highlight=False)
