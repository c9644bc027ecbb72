"""The adapter registry: immutable versions in S3 with their rows in SQL.

Publishing writes, in order: a `_publish.json` marker (create-only, so of two publishers of one
version exactly one gets past it), every file of both layouts (create-only, sha256 checked by
the store), then the `adapter_versions` row (unique per tenant, name, version). Readers only
see versions through rows, so a crash before the row leaves nothing visible; `cleanup_orphans`
later removes the objects of versions that never got a row. Everything a publication's input can
fail on (name, version range) is checked before the first object, and a publish that fails for
sure before its row commits removes its own objects at once. The adapter's base model is checked under its
lock, as the row is written: a name is never shared by two base models, however their publishes race.
"""

import json
import logging
import secrets
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from inkwell.adapters.layouts import LAYOUTS
from inkwell.service.db import repo
from inkwell.service.db.models import MAX_VERSION, AdapterRow, AdapterVersionRow, utcnow
from inkwell.service.errors import APIError, not_found
from inkwell.service.storage import ObjectExists, ObjectStore
from inkwell.trainer.config import name_problem

log = logging.getLogger("inkwell.service.registry")
MARKER = "_publish.json"


class VersionExists(Exception):
    """The version is already published (or being published) by someone else."""


class BaseMismatch(APIError):
    """The adapter name belongs to another base model: a 409 for the API, a failed job for the job worker."""

    def __init__(self, name: str, owner: str, base: str) -> None:
        super().__init__(
            409,
            "adapter_base_mismatch",
            f"adapter {name!r} belongs to base model {owner!r}, not {base!r}; choose another adapter name",
        )


def check_base(adapter: AdapterRow | None, name: str, base: str) -> None:
    """BaseMismatch unless `adapter` (the row of `name`, if any) is of base model `base`."""
    if adapter is not None and adapter.base_model != base:
        raise BaseMismatch(name, adapter.base_model, base)


def version_prefix(tenant_id: str, name: str, version: int) -> str:
    return f"adapters/{tenant_id}/{name}/{version}/"


def object_key(tenant_id: str, name: str, version: int, layout: str, path: str) -> str:
    return f"{version_prefix(tenant_id, name, version)}{layout}/{path}"


def check_name(name: str, what: str = "adapter name") -> None:
    problem = name_problem(name)
    if problem:
        raise APIError(422, "invalid_name", f"{what} {name!r} is not allowed: {problem}", name=name, reason=problem)


@dataclass
class Publication:
    """What to publish: one directory per layout, plus the row's metadata."""

    tenant_id: str
    name: str
    base_model: str
    base_config_sha256: str
    layout_dirs: dict[str, Path]
    lora: dict
    source: str
    actor: str | None = None
    job_id: str | None = None
    dataset_id: str | None = None
    metrics: dict = field(default_factory=dict)
    version: int | None = None  # None: the next free number


def _files(layout_dirs: dict[str, Path]) -> list[tuple[str, str, Path]]:
    out = []
    for layout in sorted(layout_dirs):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}")
        for path in sorted(p for p in layout_dirs[layout].iterdir() if p.is_file()):
            out.append((layout, path.name, path))
    return out


def publish(sm: sessionmaker[Session], store: ObjectStore, pub: Publication) -> AdapterVersionRow:
    """Write a new immutable version; VersionExists if `pub.version` is taken (or no number is left),
    BaseMismatch if the name belongs to another base model, ValueError for a version outside 1..MAX_VERSION
    (before anything is written)."""
    check_name(pub.name)
    if pub.version is not None and not 1 <= pub.version <= MAX_VERSION:
        raise ValueError(f"version {pub.version} is outside 1..{MAX_VERSION}")
    files = _files(pub.layout_dirs)
    with sm() as s:
        version = pub.version or repo.max_version(s, pub.tenant_id, pub.name) + 1
    for _ in range(100):
        if version > MAX_VERSION:
            raise VersionExists(f"{pub.name} has no version number left after {MAX_VERSION}")
        try:
            return _publish_version(sm, store, pub, files, version)
        except VersionExists:
            if pub.version is not None:
                raise
            version += 1
    raise RuntimeError(f"could not find a free version for {pub.name!r} after 100 tries")


def _publish_version(
    sm: sessionmaker[Session], store: ObjectStore, pub: Publication, files: list, version: int
) -> AdapterVersionRow:
    prefix = version_prefix(pub.tenant_id, pub.name, version)
    marker = {"publisher": secrets.token_hex(8), "created_at": utcnow().isoformat(), "job_id": pub.job_id}
    try:
        store.put_bytes(prefix + MARKER, json.dumps(marker).encode())
    except ObjectExists as exc:
        raise VersionExists(f"{pub.name} version {version}") from exc
    records, written = [], []
    try:
        for layout, name, path in files:
            key = object_key(pub.tenant_id, pub.name, version, layout, name)
            try:
                sha, size = store.put_file(key, path)
            except ObjectExists as exc:  # only an orphan of a crashed publish can hold it; cleanup frees it
                raise VersionExists(f"{pub.name} version {version}") from exc
            written.append(key)
            records.append({"layout": layout, "path": name, "size": size, "sha256": sha})
    except VersionExists:
        raise
    except Exception:
        _discard(store, prefix, written, marker["publisher"])
        raise
    row = AdapterVersionRow(
        tenant_id=pub.tenant_id,
        name=pub.name,
        version=version,
        base_model=pub.base_model,
        base_config_sha256=pub.base_config_sha256,
        lora=pub.lora,
        files=records,
        size_bytes=sum(r["size"] for r in records),
        metrics=pub.metrics,
        source=pub.source,
        job_id=pub.job_id,
        dataset_id=pub.dataset_id,
    )
    with sm() as s:
        try:
            adapter = repo.ensure_adapter(s, pub.tenant_id, pub.name, pub.base_model)  # locked until commit
            check_base(adapter, pub.name, pub.base_model)
            repo.touch(adapter)
            s.add(row)
            s.flush()
            repo.audit(
                s,
                pub.tenant_id,
                pub.actor,
                "adapter.version.publish",
                f"{pub.name}@{version}",
                {
                    "source": pub.source,
                    "job_id": pub.job_id,
                },
            )
        except IntegrityError as exc:  # the number has a row: whoever holds it owns the prefix, keep it
            s.rollback()
            raise VersionExists(f"{pub.name} version {version}") from exc
        except Exception:  # nothing was committed: our objects would only wait for cleanup_orphans
            s.rollback()
            _discard(store, prefix, written, marker["publisher"])
            raise
        s.commit()  # a failure here may still have committed, so its objects are left to cleanup_orphans
    return row


def _discard(store: ObjectStore, prefix: str, keys: list[str], publisher: str) -> None:
    """Best effort: remove a failed publish's objects, files first and the marker last, while the marker
    is still this publisher's (so another's objects under the prefix are never touched)."""
    try:
        if json.loads(store.get_bytes(prefix + MARKER)).get("publisher") != publisher:
            return
        store.delete(keys)
        store.delete([prefix + MARKER])
    except Exception:  # storage down, say: cleanup_orphans removes them after the grace period
        log.warning("could not remove the objects of a failed publish under %s", prefix, exc_info=True)


def resolve(s: Session, tenant_id: str, name: str, ref: str | int | None = None) -> AdapterVersionRow:
    """The version `ref` names: a number, an alias, or None for the latest live version."""
    if repo.get_adapter(s, tenant_id, name) is None:
        raise not_found("adapter", name)
    if ref is None or ref == "" or ref == "latest":
        live = repo.live_versions(s, tenant_id, name)
        if not live:
            raise not_found("adapter version of", name)
        version = live[-1]
    elif isinstance(ref, int) or (ref.isascii() and ref.isdigit()):
        version = int(ref)  # out of 1..MAX_VERSION: get_version finds no row, a 404 like any missing number
    else:
        alias = repo.get_alias(s, tenant_id, name, ref)
        if alias is None:
            raise not_found("alias", f"{name}@{ref}")
        version = alias.version
    row = repo.get_version(s, tenant_id, name, version)
    if row is None:
        raise not_found("adapter version", f"{name}@{version}")
    return row


def cleanup_orphans(sm: sessionmaker[Session], store: ObjectStore, grace_seconds: float) -> int:
    """Delete objects of versions and datasets that have no row and are older than the grace
    period (crashed or lost writes), and checkpoints of finished jobs. Returns objects removed."""
    cutoff = utcnow() - timedelta(seconds=grace_seconds)
    groups: dict[tuple[str, str, int], list] = defaultdict(list)
    for obj in store.list_objects("adapters/"):
        parts = obj.key.split("/")
        if len(parts) >= 5 and parts[3].isdigit():
            groups[(parts[1], parts[2], int(parts[3]))].append(obj)
    with sm() as s:
        published = repo.all_version_prefixes(s)
        finished_jobs = repo.finished_job_ids(s)
        dataset_keys = repo.all_dataset_keys(s)
    doomed = [
        o.key
        for version, objs in groups.items()
        if version not in published and max(o.last_modified for o in objs) < cutoff
        for o in objs
    ]
    doomed += [o.key for o in store.list_objects("datasets/") if o.key not in dataset_keys and o.last_modified < cutoff]
    for obj in store.list_objects("checkpoints/"):
        parts = obj.key.split("/")
        if len(parts) >= 3 and parts[2] in finished_jobs:
            doomed.append(obj.key)
    if doomed:
        store.delete(doomed)
        log.info("removed %d orphan objects", len(doomed))
    return len(doomed)
