"""Service configuration from the environment (prefix INKWELL_), with embedded defaults.

Unset `s3_endpoint` means "start SeaweedFS ourselves"; unset `database_url` means a SQLite file
under `data_dir`. One laptop therefore needs no configuration at all.
"""

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INKWELL_", extra="ignore")

    data_dir: Path = Field(Path(".inkwell"), description="SQLite file, SeaweedFS data, base models, worker scratch")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<data_dir>/inkwell.db")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL; unset starts an embedded SeaweedFS")
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    bucket: str = "inkwell"
    max_upload_bytes: int = Field(256 * 1024 * 1024, ge=1, description="largest dataset or adapter file accepted")
    lease_seconds: float = Field(30.0, gt=0, description="a job whose worker misses heartbeats this long is re-run")
    worker_poll_seconds: float = Field(1.0, gt=0)
    orphan_grace_seconds: float = Field(3600.0, ge=0, description="objects without a row older than this are removed")
    presign_seconds: int = Field(3600, ge=1)
    base_models: list[str] = Field(["inkling-tiny"], description="presets registered (and created) on first start")
    train_device: str = Field("cpu", description="cpu | cuda")
    train_dtype: str = Field("float32", description="float32 | bfloat16")
    train_nproc: int = Field(1, ge=1, description="processes per job (torchrun when > 1)")
    train_tp: int = Field(1, ge=1, description="tensor-parallel size")
    train_ep: int = Field(1, ge=1, description="expert-parallel size")
    train_threads: int = Field(2, ge=1, description="torch threads a job worker trains with")
    shutdown_grace_seconds: float = Field(
        10.0, gt=0, description="`inkwell serve`: requests still open this long after SIGTERM are cancelled"
    )
    min_job_workers: int = Field(
        0, ge=0, description="/healthz is degraded while fewer job workers are alive (`inkwell serve` with workers: 1)"
    )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'inkwell.db').resolve()}"

    @property
    def heartbeat_seconds(self) -> float:
        return max(self.lease_seconds / 3.0, 0.05)
