"""`/v1/adapters` and `/v1/audit`: the registry's read, download, import, delete and alias routes."""

import logging

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, Response, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inkwell.service.auth import Principal, current_principal
from inkwell.service.db import repo
from inkwell.service.db.models import MAX_VERSION, AdapterRow, AdapterVersionRow, utcnow
from inkwell.service.deps import Paging, get_session, get_settings, get_store
from inkwell.service.errors import APIError, not_found
from inkwell.service.importer import import_adapter
from inkwell.service.registry import VersionExists, check_base, check_name, object_key, resolve
from inkwell.service.routers.datasets import read_limited
from inkwell.service.routers.models import require_base_model
from inkwell.service.schemas import (
    Adapter,
    AdapterFile,
    AdapterVersion,
    Alias,
    AliasSet,
    AuditEntry,
    Download,
    DownloadFile,
    Layout,
    Lineage,
    Page,
)
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore

router = APIRouter(tags=["adapters"])
log = logging.getLogger("inkwell.service.adapters")
# A file up to this size is read and hashed whole before its 200 is sent; a bigger one streams with its last
# chunk held back until the hash matched (a damaged one is cut short of its Content-Length).
VERIFY_IN_MEMORY_BYTES = 32 << 20
ALIAS_ATTEMPTS = 3


def adapter_view(row: AdapterRow, live: list[int], aliases: dict[str, int]) -> Adapter:
    return Adapter(
        name=row.name,
        base_model=row.base_model,
        latest_version=live[-1] if live else None,
        num_versions=len(live),
        aliases=aliases,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def version_view(row: AdapterVersionRow, aliases: dict[str, int]) -> AdapterVersion:
    return AdapterVersion(
        name=row.name,
        version=row.version,
        base_model=row.base_model,
        lora=row.lora,
        files=[AdapterFile(**f) for f in row.files],
        size_bytes=row.size_bytes,
        metrics=row.metrics,
        lineage=Lineage(
            source=row.source,
            job_id=row.job_id,
            dataset_id=row.dataset_id,
            base_model=row.base_model,
            base_config_sha256=row.base_config_sha256,
        ),
        aliases=sorted(a for a, v in aliases.items() if v == row.version),
        created_at=row.created_at,
        deleted=row.deleted_at is not None,
        deleted_at=row.deleted_at,
    )


def _own_adapter(s: Session, who: Principal, name: str, lock: bool = False) -> AdapterRow:
    """The caller's adapter or a 404; `lock` holds its row until commit, as every alias or version change does,
    so what the change checked (the version is live, no alias points at it) still holds when it commits."""
    row = repo.lock_adapter(s, who.tenant_id, name) if lock else repo.get_adapter(s, who.tenant_id, name)
    if row is None:
        raise not_found("adapter", name)
    return row


def _live(row: AdapterVersionRow) -> AdapterVersionRow:
    if row.deleted_at is not None:
        raise APIError(
            409, "version_deleted", f"{row.name}@{row.version} was deleted; use another version", version=row.version
        )
    return row


@router.get("/v1/adapters", response_model=Page[Adapter])
def list_adapters(
    base_model: str | None = Query(None),
    paging: Paging = Depends(),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> Page[Adapter]:
    rows, cursor = repo.list_adapters(s, who.tenant_id, paging.limit, paging.cursor, base_model)
    info = repo.summaries(s, who.tenant_id, [r.name for r in rows])
    return Page[Adapter](data=[adapter_view(r, *info[r.name]) for r in rows], next_cursor=cursor)


@router.post("/v1/adapters/import", status_code=201, response_model=AdapterVersion)
def import_route(
    request: Request,
    name: str = Form(...),
    base_model: str = Form(...),
    layout: str = Form(..., description="sglang | peft"),
    version: int | None = Form(None, ge=1, le=MAX_VERSION),
    files: list[UploadFile] = File(..., description="adapter_config.json, adapter_model.safetensors, manifest.json"),
    who: Principal = Depends(current_principal),
    store: ObjectStore = Depends(get_store),
    settings: Settings = Depends(get_settings),
) -> AdapterVersion:
    check_name(name)
    sm, read_sm = request.app.state.sessionmaker, request.app.state.read_sessionmaker
    # The checks read through the read-only sessionmaker: on SQLite a write-intent session takes the database's
    # write lock at its first statement, so an import refused here would wait for any writer first.
    with read_sm() as s:
        base = require_base_model(s, base_model)
        # Refused before the upload is read if the name is another base's already; the publish checks again,
        # under the adapter's lock.
        check_base(repo.get_adapter(s, who.tenant_id, name), name, base_model)
    budget, payload = settings.max_upload_bytes, []
    for upload in files:
        filename = (upload.filename or "").rsplit("/", 1)[-1]
        payload.append((filename, read_limited(upload, budget)))  # a list: the importer refuses a name twice
        budget -= len(payload[-1][1])
    try:
        row = import_adapter(
            sm, store, settings.data_dir / "tmp", who.tenant_id, who.key_id, name, base, layout, payload, version
        )
    except VersionExists as exc:
        message = f"{name}@{version} is already published; versions are immutable" if version else str(exc)
        raise APIError(409, "version_exists", message, version=version) from exc
    return version_view(row, {})


@router.get("/v1/adapters/{name}", response_model=Adapter)
def get_adapter(name: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> Adapter:
    row = _own_adapter(s, who, name)
    return adapter_view(row, *repo.summaries(s, who.tenant_id, [name])[name])


@router.get("/v1/adapters/{name}/versions", response_model=Page[AdapterVersion])
def list_versions(
    name: str,
    include_deleted: bool = Query(False),
    paging: Paging = Depends(),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> Page[AdapterVersion]:
    _own_adapter(s, who, name)
    rows, cursor = repo.list_versions(s, who.tenant_id, name, paging.limit, paging.cursor, include_deleted)
    aliases = repo.aliases_of(s, who.tenant_id, name)
    return Page[AdapterVersion](data=[version_view(r, aliases) for r in rows], next_cursor=cursor)


@router.get("/v1/adapters/{name}/versions/{ref}", response_model=AdapterVersion)
def get_version(
    name: str, ref: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)
) -> AdapterVersion:
    row = resolve(s, who.tenant_id, name, ref)
    return version_view(row, repo.aliases_of(s, who.tenant_id, name))


@router.get("/v1/adapters/{name}/versions/{ref}/download", response_model=Download)
def download(
    name: str,
    ref: str,
    request: Request,
    layout: Layout = Query("sglang"),
    who: Principal = Depends(current_principal),
    store: ObjectStore = Depends(get_store),
    settings: Settings = Depends(get_settings),
) -> Download:
    with request.app.state.read_sessionmaker() as s:
        row = _live(resolve(s, who.tenant_id, name, ref))
    files = []
    for f in row.files:
        if f["layout"] != layout:
            continue
        key = object_key(row.tenant_id, row.name, row.version, layout, f["path"])
        files.append(
            DownloadFile(
                **f,
                url=store.presign_get(key, settings.presign_seconds),
                download_path=f"/v1/adapters/{row.name}/versions/{row.version}/files/{layout}/{f['path']}",
            )
        )
    return Download(name=row.name, version=row.version, layout=layout, expires_in=settings.presign_seconds, files=files)


@router.get("/v1/adapters/{name}/versions/{ref}/files/{layout}/{path}", response_class=StreamingResponse)
def download_file(
    name: str,
    ref: str,
    layout: Layout,
    path: str,
    request: Request,
    who: Principal = Depends(current_principal),
    store: ObjectStore = Depends(get_store),
) -> StreamingResponse:
    with request.app.state.read_sessionmaker() as s:
        row = _live(resolve(s, who.tenant_id, name, ref))
    entry = next((f for f in row.files if f["layout"] == layout and f["path"] == path), None)
    if entry is None:
        raise not_found("file", f"{name}@{row.version}/{layout}/{path}")
    key = object_key(row.tenant_id, row.name, row.version, layout, path)
    sha256, size = entry["sha256"], entry["size"]
    # ObjectCorrupt before the status line is the app's 502 integrity_error; after it (a file streamed past the
    # in-memory bound), it cuts the stream short of its Content-Length, and the server logs it.
    if size <= VERIFY_IN_MEMORY_BYTES:  # checked whole before the status line: damage is a 502, not a 200
        data = store.get_verified(key, sha256, size)
        return Response(data, media_type="application/octet-stream", headers={"X-Inkwell-SHA256": sha256})
    chunks = store.open_verified_stream(key, sha256, size)
    headers = {"X-Inkwell-SHA256": sha256, "Content-Length": str(size)}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/v1/adapters/{name}/versions/{version}", response_model=AdapterVersion)
def delete_version(
    name: str,
    version: int = Path(ge=1, le=MAX_VERSION),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> AdapterVersion:
    _own_adapter(s, who, name, lock=True)  # an alias set meanwhile waits, then sees the version deleted
    row = repo.get_version(s, who.tenant_id, name, version)
    if row is None:
        raise not_found("adapter version", f"{name}@{version}")
    aliases = repo.aliases_of(s, who.tenant_id, name)
    pointing = sorted(a for a, v in aliases.items() if v == version)
    if pointing:
        raise APIError(
            409,
            "version_aliased",
            f"{name}@{version} is the target of alias(es) {', '.join(pointing)}; move or delete them first",
            aliases=pointing,
        )
    if row.deleted_at is None:
        row.deleted_at, row.deleted_by = utcnow(), who.key_id
        repo.audit(s, who.tenant_id, who.key_id, "adapter.version.delete", f"{name}@{version}")
        s.commit()
    return version_view(row, aliases)


@router.put("/v1/adapters/{name}/aliases/{alias}", response_model=Alias)
def set_alias(
    name: str,
    alias: str,
    body: AliasSet,
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
) -> Alias:
    check_name(alias, "alias")
    if alias.isdigit() or alias == "latest":
        raise APIError(
            422,
            "invalid_name",
            f"alias {alias!r} would be read as a version reference; use a name with a letter",
            name=alias,
            reason="reserved",
        )
    attempts = ALIAS_ATTEMPTS
    while True:
        try:
            return _set_alias(s, who, name, alias, body.version)
        except IntegrityError:
            # A writer that skipped the adapter lock (every route here takes it) created the alias between our
            # read and our insert: the row exists now, so the next attempt moves it (setting it is idempotent).
            s.rollback()
            attempts -= 1
            if not attempts:
                raise APIError(
                    409, "alias_conflict", f"alias {name}@{alias} is being changed concurrently; retry", retryable=True
                ) from None


def _set_alias(s: Session, who: Principal, name: str, alias: str, version: int) -> Alias:
    _own_adapter(s, who, name, lock=True)  # a delete of the target meanwhile waits, then sees the alias
    target = repo.get_version(s, who.tenant_id, name, version)
    if target is None:
        raise not_found("adapter version", f"{name}@{version}")
    _live(target)
    previous = repo.get_alias(s, who.tenant_id, name, alias)
    before = previous.version if previous else None
    row = repo.set_alias(s, who.tenant_id, name, alias, version)
    change = {"from": before, "to": version}
    repo.audit(s, who.tenant_id, who.key_id, "adapter.alias.set", f"{name}@{alias}", change)
    s.commit()
    return Alias(name=name, alias=alias, version=row.version, updated_at=row.updated_at)


@router.delete("/v1/adapters/{name}/aliases/{alias}", status_code=204, response_class=Response)
def delete_alias(
    name: str, alias: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)
) -> Response:
    _own_adapter(s, who, name, lock=True)  # of two deletes of one alias, the second finds it gone: 404
    row = repo.get_alias(s, who.tenant_id, name, alias)
    if row is None:
        raise not_found("alias", f"{name}@{alias}")
    repo.audit(s, who.tenant_id, who.key_id, "adapter.alias.delete", f"{name}@{alias}", {"was": row.version})
    s.delete(row)
    s.commit()
    return Response(status_code=204)


@router.get("/v1/audit", response_model=Page[AuditEntry], tags=["audit"])
def audit_log(
    paging: Paging = Depends(), who: Principal = Depends(current_principal), s: Session = Depends(get_session)
) -> Page[AuditEntry]:
    rows, cursor = repo.list_audit(s, who.tenant_id, paging.limit, paging.cursor)
    return Page[AuditEntry](data=[AuditEntry.model_validate(r) for r in rows], next_cursor=cursor)
