"""Every query the service runs, in one place. Functions take a Session and never commit
unless their name says they finish a unit of work; callers own the transaction.
"""

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inkwell.service.db.models import (
    MAX_VERSION,
    AdapterRow,
    AdapterVersionRow,
    AliasRow,
    ApiKey,
    AuditRow,
    BaseModelRow,
    DatasetRow,
    JobEventRow,
    JobRow,
    JobWorkerRow,
    Tenant,
    utcnow,
)
from inkwell.trainer.config import MAX_INT64

KEY_PREFIX = "ink_"
# Rows of job workers unseen this long are dropped (a live worker renews its row every third of a lease).
DEAD_WORKER_ROWS_KEPT = timedelta(hours=1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def page[T](rows: list[T], limit: int, cursor_of) -> tuple[list[T], str | None]:
    """Split a `limit + 1` query result into a page and the cursor of the next one."""
    if len(rows) > limit:
        return rows[:limit], str(cursor_of(rows[limit - 1]))
    return rows, None


def parse_cursor(cursor: str | None) -> int | None:
    """The key a cursor holds; ValueError for anything no key can be (SQLite cannot even bind past BIGINT)."""
    if cursor is None or cursor == "":
        return None
    if not (cursor.isascii() and cursor.isdigit()) or int(cursor) > MAX_INT64:
        raise ValueError(f"cursor {cursor!r} is not one this API returned; pass next_cursor unchanged")
    return int(cursor)


# ---- tenants and keys -------------------------------------------------------------------------


def create_tenant(s: Session, name: str) -> Tenant:
    tenant = Tenant(id=new_id("ten"), name=name)
    s.add(tenant)
    s.flush()
    return tenant


def tenant_by_name(s: Session, name: str) -> Tenant | None:
    return s.scalar(select(Tenant).where(Tenant.name == name))


def create_api_key(s: Session, tenant_id: str, name: str = "default") -> tuple[ApiKey, str]:
    """A new key; the plaintext is returned once and only its sha256 is stored."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id=new_id("key"), tenant_id=tenant_id, name=name, key_hash=hash_key(plaintext), prefix=plaintext[:12])
    s.add(row)
    s.flush()
    return row, plaintext


def find_api_key(s: Session, plaintext: str) -> ApiKey | None:
    return s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(plaintext), ApiKey.revoked_at.is_(None)))


def revoke_api_key(s: Session, key_id: str) -> bool:
    res = s.execute(update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow()))
    return res.rowcount == 1


# ---- base models ------------------------------------------------------------------------------


def upsert_base_model(s: Session, name: str, path: str, config_sha256: str, config) -> BaseModelRow:
    row = s.get(BaseModelRow, name) or BaseModelRow(name=name)
    row.path, row.config_sha256 = path, config_sha256
    row.hidden_size, row.num_hidden_layers = config.hidden_size, config.num_hidden_layers
    row.n_routed_experts, row.vocab_size = config.n_routed_experts, config.vocab_size
    s.add(row)
    s.flush()
    return row


def list_base_models(s: Session) -> list[BaseModelRow]:
    return list(s.scalars(select(BaseModelRow).order_by(BaseModelRow.name)))


def get_base_model(s: Session, name: str) -> BaseModelRow | None:
    return s.get(BaseModelRow, name)


# ---- datasets ---------------------------------------------------------------------------------


def insert_dataset(s: Session, **fields: Any) -> DatasetRow:
    row = DatasetRow(**fields)
    s.add(row)
    s.flush()
    return row


def get_dataset(s: Session, tenant_id: str, dataset_id: str, lock: bool = False) -> DatasetRow | None:
    """The tenant's dataset, unless deleted; `lock` holds its row (PostgreSQL) until the commit, so that a delete
    and a job created on it go one after the other."""
    q = select(DatasetRow).where(
        DatasetRow.id == dataset_id, DatasetRow.tenant_id == tenant_id, DatasetRow.deleted_at.is_(None)
    )
    return s.scalar(q.with_for_update() if lock else q)


def list_datasets(s: Session, tenant_id: str, limit: int, cursor: int | None) -> tuple[list[DatasetRow], str | None]:
    q = select(DatasetRow).where(DatasetRow.tenant_id == tenant_id, DatasetRow.deleted_at.is_(None))
    if cursor is not None:
        q = q.where(DatasetRow.seq < cursor)
    rows = list(s.scalars(q.order_by(DatasetRow.seq.desc()).limit(limit + 1)))
    return page(rows, limit, lambda r: r.seq)


# ---- jobs -------------------------------------------------------------------------------------


def add_event(
    s: Session, job_id: str, type_: str, message: str, data: dict | None = None, state: str | None = None
) -> JobEventRow:
    row = JobEventRow(job_id=job_id, type=type_, state=state, message=message, data=data or {})
    s.add(row)
    s.flush()
    return row


def insert_job(s: Session, **fields: Any) -> JobRow:
    row = JobRow(id=new_id("job"), state="queued", progress={}, attempts=0, cancel_requested=False, **fields)
    s.add(row)
    s.flush()
    add_event(s, row.id, "state", "job queued", state="queued")
    return row


def get_job(s: Session, tenant_id: str | None, job_id: str) -> JobRow | None:
    q = select(JobRow).where(JobRow.id == job_id)
    if tenant_id is not None:
        q = q.where(JobRow.tenant_id == tenant_id)
    return s.scalar(q)


def list_jobs(
    s: Session, tenant_id: str, limit: int, cursor: int | None, **filters: str | None
) -> tuple[list[JobRow], str | None]:
    q = select(JobRow).where(JobRow.tenant_id == tenant_id)
    for column, value in filters.items():
        if value is not None:
            q = q.where(getattr(JobRow, column) == value)
    if cursor is not None:
        q = q.where(JobRow.seq < cursor)
    rows = list(s.scalars(q.order_by(JobRow.seq.desc()).limit(limit + 1)))
    return page(rows, limit, lambda r: r.seq)


def list_events(s: Session, job_id: str, after: int, limit: int) -> list[JobEventRow]:
    q = select(JobEventRow).where(JobEventRow.job_id == job_id, JobEventRow.id > after)
    return list(s.scalars(q.order_by(JobEventRow.id).limit(limit)))


def job_counts(s: Session) -> dict[str, int]:
    return dict(s.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all())


def claim_job(s: Session, worker_id: str, lease: timedelta) -> JobRow | None:
    """Take the oldest queued job, or a running one whose lease expired, for `worker_id`.

    PostgreSQL: `FOR UPDATE SKIP LOCKED` lets workers pass each other's candidate rows.
    SQLite: the transaction already holds the write lock (BEGIN IMMEDIATE) and the UPDATE is
    conditional on the row still being claimable, so two workers never both win a job.
    """
    now = utcnow()
    claimable = or_(JobRow.state == "queued", and_(JobRow.state == "running", JobRow.lease_expires_at < now))
    q = select(JobRow.id).where(claimable).order_by(JobRow.seq).limit(1)
    if s.bind.dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    job_id = s.scalar(q)
    if job_id is None:
        return None
    res = s.execute(
        update(JobRow)
        .where(JobRow.id == job_id, claimable)
        .values(
            state="running",
            worker_id=worker_id,
            lease_expires_at=now + lease,
            attempts=JobRow.attempts + 1,
            started_at=func.coalesce(JobRow.started_at, now),
        )
    )
    if res.rowcount != 1:
        return None
    return s.scalar(select(JobRow).where(JobRow.id == job_id).execution_options(populate_existing=True))


def renew_lease(s: Session, job_id: str, worker_id: str, lease: timedelta) -> JobRow | None:
    """Extend the lease if `worker_id` still holds the running job; None means the lease is lost."""
    res = s.execute(
        update(JobRow)
        .where(JobRow.id == job_id, JobRow.worker_id == worker_id, JobRow.state == "running")
        .values(lease_expires_at=utcnow() + lease)
    )
    if res.rowcount != 1:
        return None
    return s.scalar(select(JobRow).where(JobRow.id == job_id).execution_options(populate_existing=True))


def update_held_job(s: Session, job_id: str, holder: str, **values: Any) -> bool:
    """Change a running job only while worker `holder` holds it (fencing against a stale worker)."""
    res = s.execute(
        update(JobRow)
        .where(JobRow.id == job_id, JobRow.worker_id == holder, JobRow.state == "running")
        .values(**values)
    )
    return res.rowcount == 1


def cancel_queued_job(s: Session, job_id: str) -> bool:
    res = s.execute(
        update(JobRow)
        .where(JobRow.id == job_id, JobRow.state == "queued")
        .values(state="cancelled", cancel_requested=True, finished_at=utcnow())
    )
    return res.rowcount == 1


def request_cancel(s: Session, job_id: str) -> None:
    s.execute(update(JobRow).where(JobRow.id == job_id, JobRow.state == "running").values(cancel_requested=True))


# ---- adapters ---------------------------------------------------------------------------------


def get_adapter(s: Session, tenant_id: str, name: str) -> AdapterRow | None:
    return s.scalar(select(AdapterRow).where(AdapterRow.tenant_id == tenant_id, AdapterRow.name == name))


def list_adapters(
    s: Session, tenant_id: str, limit: int, cursor: int | None, base_model: str | None
) -> tuple[list[AdapterRow], str | None]:
    q = select(AdapterRow).where(AdapterRow.tenant_id == tenant_id)
    if base_model:
        q = q.where(AdapterRow.base_model == base_model)
    if cursor is not None:
        q = q.where(AdapterRow.seq < cursor)
    rows = list(s.scalars(q.order_by(AdapterRow.seq.desc()).limit(limit + 1)))
    return page(rows, limit, lambda r: r.seq)


def lock_adapter(s: Session, tenant_id: str, name: str) -> AdapterRow | None:
    """The adapter row, locked until the transaction ends (`FOR UPDATE` on PostgreSQL).

    Every change of an adapter's versions or aliases takes this lock first, so a check such as "no alias
    points at this version" still holds at commit. SQLite needs none: its writers are serialized by
    `BEGIN IMMEDIATE` (and SQLAlchemy leaves `FOR UPDATE` out there).
    """
    q = select(AdapterRow).where(AdapterRow.tenant_id == tenant_id, AdapterRow.name == name)
    return s.scalar(q.with_for_update().execution_options(populate_existing=True))


def ensure_adapter(s: Session, tenant_id: str, name: str, base_model: str) -> AdapterRow:
    """The adapter row, created if missing, and locked (see `lock_adapter`).

    Two first publishes of one name both find no row; the loser's INSERT fails on the unique constraint,
    which a savepoint contains, and it then locks the winner's row.
    """
    row = lock_adapter(s, tenant_id, name)
    if row is None:
        try:
            with s.begin_nested():
                row = AdapterRow(tenant_id=tenant_id, name=name, base_model=base_model)
                s.add(row)
        except IntegrityError:
            row = lock_adapter(s, tenant_id, name)
            if row is None:
                raise
    return row


def live_versions(s: Session, tenant_id: str, name: str) -> list[int]:
    q = select(AdapterVersionRow.version).where(
        AdapterVersionRow.tenant_id == tenant_id,
        AdapterVersionRow.name == name,
        AdapterVersionRow.deleted_at.is_(None),
    )
    return sorted(s.scalars(q))


def max_version(s: Session, tenant_id: str, name: str) -> int:
    q = select(func.max(AdapterVersionRow.version)).where(
        AdapterVersionRow.tenant_id == tenant_id, AdapterVersionRow.name == name
    )
    return s.scalar(q) or 0


def list_versions(
    s: Session, tenant_id: str, name: str, limit: int, cursor: int | None, include_deleted: bool
) -> tuple[list[AdapterVersionRow], str | None]:
    q = select(AdapterVersionRow).where(AdapterVersionRow.tenant_id == tenant_id, AdapterVersionRow.name == name)
    if not include_deleted:
        q = q.where(AdapterVersionRow.deleted_at.is_(None))
    if cursor is not None:
        q = q.where(AdapterVersionRow.version < cursor)
    rows = list(s.scalars(q.order_by(AdapterVersionRow.version.desc()).limit(limit + 1)))
    return page(rows, limit, lambda r: r.version)


def get_version(s: Session, tenant_id: str, name: str, version: int) -> AdapterVersionRow | None:
    if not 1 <= version <= MAX_VERSION:  # no such row, and SQLite cannot bind a number past BIGINT
        return None
    q = select(AdapterVersionRow).where(
        AdapterVersionRow.tenant_id == tenant_id,
        AdapterVersionRow.name == name,
        AdapterVersionRow.version == version,
    )
    return s.scalar(q)


def version_for_job(s: Session, job_id: str) -> AdapterVersionRow | None:
    return s.scalar(select(AdapterVersionRow).where(AdapterVersionRow.job_id == job_id))


def all_version_prefixes(s: Session) -> set[tuple[str, str, int]]:
    rows = s.execute(select(AdapterVersionRow.tenant_id, AdapterVersionRow.name, AdapterVersionRow.version))
    return {(t, n, v) for t, n, v in rows}


def summaries(s: Session, tenant_id: str, names: list[str]) -> dict[str, tuple[list[int], dict[str, int]]]:
    """Live versions and aliases of several adapters in two queries (for list pages)."""
    out: dict[str, tuple[list[int], dict[str, int]]] = {n: ([], {}) for n in names}
    versions = select(AdapterVersionRow.name, AdapterVersionRow.version).where(
        AdapterVersionRow.tenant_id == tenant_id,
        AdapterVersionRow.name.in_(names),
        AdapterVersionRow.deleted_at.is_(None),
    )
    for name, version in s.execute(versions.order_by(AdapterVersionRow.version)):
        out[name][0].append(version)
    aliases = select(AliasRow.name, AliasRow.alias, AliasRow.version).where(
        AliasRow.tenant_id == tenant_id, AliasRow.name.in_(names)
    )
    for name, alias, version in s.execute(aliases.order_by(AliasRow.alias)):
        out[name][1][alias] = version
    return out


def aliases_of(s: Session, tenant_id: str, name: str) -> dict[str, int]:
    q = select(AliasRow.alias, AliasRow.version).where(AliasRow.tenant_id == tenant_id, AliasRow.name == name)
    return dict(s.execute(q.order_by(AliasRow.alias)).all())


def get_alias(s: Session, tenant_id: str, name: str, alias: str) -> AliasRow | None:
    q = select(AliasRow).where(AliasRow.tenant_id == tenant_id, AliasRow.name == name, AliasRow.alias == alias)
    return s.scalar(q)


def set_alias(s: Session, tenant_id: str, name: str, alias: str, version: int) -> AliasRow:
    row = get_alias(s, tenant_id, name, alias) or AliasRow(tenant_id=tenant_id, name=name, alias=alias)
    row.version, row.updated_at = version, utcnow()
    s.add(row)
    s.flush()
    return row


def count_versions(s: Session) -> int:
    return s.scalar(select(func.count()).select_from(AdapterVersionRow).where(AdapterVersionRow.deleted_at.is_(None)))


# ---- job workers ------------------------------------------------------------------------------


def beat_worker(s: Session, worker_id: str) -> None:
    """Mark a job worker alive now; its first beat also drops the rows of workers long dead."""
    now = utcnow()
    if s.execute(update(JobWorkerRow).where(JobWorkerRow.id == worker_id).values(seen_at=now)).rowcount:
        return
    s.execute(delete(JobWorkerRow).where(JobWorkerRow.seen_at < now - DEAD_WORKER_ROWS_KEPT))
    s.add(JobWorkerRow(id=worker_id, seen_at=now))
    s.flush()


def remove_worker(s: Session, worker_id: str) -> None:
    s.execute(delete(JobWorkerRow).where(JobWorkerRow.id == worker_id))


def count_live_workers(s: Session, within: timedelta) -> int:
    """Job workers (on any host) whose heartbeat is at most `within` old."""
    return s.scalar(select(func.count()).select_from(JobWorkerRow).where(JobWorkerRow.seen_at >= utcnow() - within))


# ---- audit ------------------------------------------------------------------------------------


def audit(s: Session, tenant_id: str, actor: str | None, action: str, target: str, data: dict | None = None) -> None:
    s.add(AuditRow(tenant_id=tenant_id, actor=actor, action=action, target=target, data=data or {}))
    s.flush()


def list_audit(s: Session, tenant_id: str, limit: int, cursor: int | None) -> tuple[list[AuditRow], str | None]:
    q = select(AuditRow).where(AuditRow.tenant_id == tenant_id)
    if cursor is not None:
        q = q.where(AuditRow.id < cursor)
    rows = list(s.scalars(q.order_by(AuditRow.id.desc()).limit(limit + 1)))
    return page(rows, limit, lambda r: r.id)


def touch(row: AdapterRow, when: datetime | None = None) -> None:
    row.updated_at = when or utcnow()


def all_dataset_keys(s: Session) -> set[str]:
    """The objects of the datasets not deleted (a deleted one's object is an orphan, if its delete did not go)."""
    return set(s.scalars(select(DatasetRow.s3_key).where(DatasetRow.deleted_at.is_(None))))


def jobs_using_dataset(s: Session, tenant_id: str, dataset_id: str) -> list[str]:
    """The ids of the tenant's queued or running jobs that train or evaluate on the dataset."""
    q = select(JobRow.id).where(
        JobRow.tenant_id == tenant_id,
        JobRow.state.in_(("queued", "running")),
        or_(JobRow.dataset_id == dataset_id, JobRow.eval_dataset_id == dataset_id),
    )
    return list(s.scalars(q.order_by(JobRow.seq)))


def finished_job_ids(s: Session) -> set[str]:
    return set(s.scalars(select(JobRow.id).where(JobRow.state.in_(("succeeded", "failed", "cancelled")))))
