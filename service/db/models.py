"""The service's tables (SQLAlchemy 2). alembic/versions must produce exactly these; a test checks it."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from inkwell.trainer.config import MAX_INT64


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes on every backend (SQLite has no time zones: store naive UTC, return aware)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(UTC)")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


# Adapter versions are BIGINT: the API bounds them to 1..MAX_VERSION so a number it accepts always fits.
MAX_VERSION = MAX_INT64
VersionInt = BigInteger().with_variant(Integer(), "sqlite")  # SQLite's INTEGER is already 64-bit


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[Any]: JSON()}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class BaseModelRow(Base):
    __tablename__ = "base_models"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    config_sha256: Mapped[str] = mapped_column(String(64))
    hidden_size: Mapped[int]
    num_hidden_layers: Mapped[int]
    n_routed_experts: Mapped[int]
    vocab_size: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DatasetRow(Base):
    __tablename__ = "datasets"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    format: Mapped[str] = mapped_column(String(32))
    num_examples: Mapped[int]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    s3_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None]  # set by a delete: the row stays for the jobs that name it, the data goes


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_claim", "state", "lease_expires_at"),)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    state: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(ForeignKey("base_models.name"))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    eval_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"))
    adapter_name: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    lora: Mapped[dict[str, Any]]
    hyperparameters: Mapped[dict[str, Any]]
    progress: Mapped[dict[str, Any]]
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(default=0)
    worker_id: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None]
    last_checkpoint_step: Mapped[int | None]
    last_checkpoint_key: Mapped[str | None] = mapped_column(Text)
    adapter_version: Mapped[int | None] = mapped_column(VersionInt)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class JobEventRow(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    type: Mapped[str] = mapped_column(String(16))
    state: Mapped[str | None] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AdapterRow(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_name"),)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(64))
    base_model: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AdapterVersionRow(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "version", name="uq_adapter_versions_tenant_name_version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(VersionInt)
    base_model: Mapped[str] = mapped_column(String(64))
    base_config_sha256: Mapped[str] = mapped_column(String(64))
    lora: Mapped[dict[str, Any]]
    files: Mapped[list[Any]]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]]
    source: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(40), index=True)
    dataset_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None]
    deleted_by: Mapped[str | None] = mapped_column(String(40))


class AliasRow(Base):
    __tablename__ = "aliases"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "alias", name="uq_aliases_tenant_name_alias"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(64))
    alias: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(VersionInt)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditRow(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    actor: Mapped[str | None] = mapped_column(String(40))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobWorkerRow(Base):
    """A job worker that is alive while `seen_at` is recent: each worker renews its own row (heartbeat)."""

    __tablename__ = "job_workers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)
