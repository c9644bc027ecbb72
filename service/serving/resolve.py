"""From a request's `model` string to a base-model directory and an adapter version to load.

`model` is "<base>" (no adapter) or "<base>:<adapter>[@<version>|@<alias>]" (no ref: the latest
version). The registry resolver looks both up for the caller's tenant: another tenant's adapter
is not found, exactly like a missing one, so names never leak. An adapter is served only on
the base it was trained on.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from inkwell.service import registry
from inkwell.service.db import repo
from inkwell.service.errors import APIError
from inkwell.service.serving.router import AdapterRef
from inkwell.service.serving.sources import S3Source
from inkwell.service.storage import ObjectStore

SERVING_LAYOUT = "sglang"


class ModelNotFoundError(LookupError):
    """No such base model, or no such adapter/version/alias for this tenant (HTTP 404)."""


class ModelMismatchError(ValueError):
    """The adapter exists but was trained on another base model (HTTP 400)."""


@dataclass(frozen=True)
class ModelName:
    base: str
    adapter: str | None = None
    ref: str | None = None

    @classmethod
    def parse(cls, model: str) -> "ModelName":
        base, sep, rest = model.partition(":")
        if not base or (sep and not rest):
            raise ModelNotFoundError(f"model {model!r} is not '<base>' or '<base>:<adapter>[@<version>|@<alias>]'")
        if not sep:
            return cls(base)
        adapter, at, ref = rest.partition("@")
        if not adapter or (at and not ref):
            raise ModelNotFoundError(f"model {model!r}: the adapter name or the reference after '@' is empty")
        return cls(base, adapter, ref or None)


@dataclass(frozen=True)
class ResolvedModel:
    base: str
    model_dir: Path
    adapter: AdapterRef | None


class ModelResolver(Protocol):
    def base_dir(self, base: str) -> Path: ...

    def resolve(self, tenant_id: str, name: ModelName) -> ResolvedModel: ...


class RegistryResolver:
    """Base models and adapter versions from the service's database; adapter files from its S3 store."""

    def __init__(self, sm: sessionmaker[Session], store: ObjectStore, region: str = "us-east-1", keys=(None, None)):
        self.sm = sm
        self.store = store
        self.region = region
        self.access_key, self.secret_key = keys

    def base_dir(self, base: str) -> Path:
        with self.sm() as s:
            row = repo.get_base_model(s, base)
        if row is None:
            raise ModelNotFoundError(f"base model {base!r} is not registered (see GET /v1/models)")
        return Path(row.path)

    def resolve(self, tenant_id: str, name: ModelName) -> ResolvedModel:
        model_dir = self.base_dir(name.base)
        if name.adapter is None:
            return ResolvedModel(name.base, model_dir, None)
        with self.sm() as s:
            try:
                row = registry.resolve(s, tenant_id, name.adapter, name.ref)
            except APIError as exc:
                raise ModelNotFoundError(exc.message) from exc
        if row.deleted_at is not None:
            raise ModelNotFoundError(f"adapter version {name.adapter}@{row.version} was deleted")
        if row.base_model != name.base:
            raise ModelMismatchError(
                f"adapter {name.adapter!r} version {row.version} was trained on {row.base_model!r}, "
                f"not {name.base!r}; use model='{row.base_model}:{name.adapter}@{row.version}'"
            )
        files = tuple((f["path"], f["sha256"]) for f in row.files if f["layout"] == SERVING_LAYOUT)
        source = S3Source(
            endpoint=self.store.endpoint,
            bucket=self.store.bucket,
            prefix=registry.object_key(tenant_id, name.adapter, row.version, SERVING_LAYOUT, ""),
            files=files,
            region=self.region,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )
        return ResolvedModel(name.base, model_dir, AdapterRef(f"{tenant_id}/{name.adapter}@{row.version}", source))
