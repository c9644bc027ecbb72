"""`/v1/datasets`: JSONL uploads, validated line by line, stored in S3, then recorded; deletes."""

import hashlib
import logging

from fastapi import APIRouter, Depends, File, Form, Response, UploadFile
from sqlalchemy.orm import Session

from inkwell.service.auth import Principal, current_principal
from inkwell.service.datasets import validate_jsonl
from inkwell.service.db import repo
from inkwell.service.db.models import utcnow
from inkwell.service.deps import Paging, get_session, get_settings, get_store
from inkwell.service.errors import APIError, not_found
from inkwell.service.registry import check_name
from inkwell.service.schemas import Dataset, ErrorResponse, Page
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectStore, StorageUnavailable
from inkwell.trainer.records import JsonlError

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])
log = logging.getLogger(__name__)


def read_limited(upload: UploadFile, limit: int) -> bytes:
    """The upload's bytes, or 413 once it passes `limit`."""
    chunks, total = [], 0
    while chunk := upload.file.read(1 << 20):
        total += len(chunk)
        if total > limit:
            raise APIError(
                413,
                "payload_too_large",
                f"{upload.filename or 'upload'} is over the {limit}-byte limit; "
                "split it or raise INKWELL_MAX_UPLOAD_BYTES",
                limit_bytes=limit,
            )
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("", status_code=201, response_model=Dataset, responses={413: {"model": ErrorResponse}})
def upload_dataset(
    file: UploadFile = File(..., description="JSONL: chat `messages` or `prompt`/`completion` per line"),
    name: str | None = Form(None),
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
    settings: Settings = Depends(get_settings),
) -> Dataset:
    name = name or (file.filename or "dataset.jsonl")
    check_name(name, "dataset name")
    data = read_limited(file, settings.max_upload_bytes)
    try:
        summary = validate_jsonl(data)
    except JsonlError as exc:
        raise APIError(422, "invalid_dataset", f"{name}: {exc}", line=exc.line, reason=exc.reason) from exc
    dataset_id = repo.new_id("ds")
    key = f"datasets/{who.tenant_id}/{dataset_id}.jsonl"
    store.put_bytes(key, data)
    row = repo.insert_dataset(
        s,
        id=dataset_id,
        tenant_id=who.tenant_id,
        name=name,
        format=summary.format,
        num_examples=summary.num_examples,
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        s3_key=key,
    )
    s.commit()
    return Dataset.model_validate(row)


@router.get("", response_model=Page[Dataset])
def list_datasets(
    paging: Paging = Depends(), who: Principal = Depends(current_principal), s: Session = Depends(get_session)
) -> Page[Dataset]:
    rows, cursor = repo.list_datasets(s, who.tenant_id, paging.limit, paging.cursor)
    return Page[Dataset](data=[Dataset.model_validate(r) for r in rows], next_cursor=cursor)


@router.get("/{dataset_id}", response_model=Dataset)
def get_dataset(
    dataset_id: str, who: Principal = Depends(current_principal), s: Session = Depends(get_session)
) -> Dataset:
    row = repo.get_dataset(s, who.tenant_id, dataset_id)
    if row is None:
        raise not_found("dataset", dataset_id)
    return Dataset.model_validate(row)


@router.delete("/{dataset_id}", status_code=204, response_class=Response, responses={409: {"model": ErrorResponse}})
def delete_dataset(
    dataset_id: str,
    who: Principal = Depends(current_principal),
    s: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
) -> Response:
    """Delete a dataset: its data leaves the object store, and the jobs that trained on it keep naming it. Refused
    (409) while a queued or running job uses it."""
    row = repo.get_dataset(s, who.tenant_id, dataset_id, lock=True)  # a job created on it meanwhile waits
    if row is None:
        raise not_found("dataset", dataset_id)
    if jobs := repo.jobs_using_dataset(s, who.tenant_id, dataset_id):
        raise APIError(
            409,
            "dataset_in_use",
            f"dataset {dataset_id} is used by the {'job' if len(jobs) == 1 else 'jobs'} {', '.join(jobs)}, "
            "not yet ended: cancel them or wait for them to end",
            jobs=jobs,
        )
    row.deleted_at = utcnow()
    repo.audit(s, who.tenant_id, who.key_id, "dataset.delete", dataset_id, {"name": row.name, "sha256": row.sha256})
    s.commit()
    try:
        store.delete([row.s3_key])
    except StorageUnavailable:  # the row says deleted; the orphan sweep removes the object later
        log.warning("dataset %s: its object %s stays until the orphan sweep", dataset_id, row.s3_key)
    return Response(status_code=204)
