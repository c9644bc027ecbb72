"""The service's side of model resolution: base models and adapter versions from its registry.

The serving tier asks a `ModelResolver` (`inkwell.serving.resolve`) where a base model lives and which adapter
version a request names; this one answers from the service's database, and points the worker's loader at the
version's objects in the service's S3 store.
"""

from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from inkwell.service import registry
from inkwell.service.db import repo
from inkwell.service.errors import APIError
from inkwell.service.storage import ObjectStore
from inkwell.serving.resolve import SERVING_LAYOUT, ModelMismatchError, ModelName, ModelNotFoundError, ResolvedModel
from inkwell.serving.router import AdapterRef
from inkwell.serving.sources import S3Source


def adapter_key(tenant_id: str, name: str, version: int) -> str:
    """A version's key on the serving workers: unique per tenant, adapter and version (a new version, a new key)."""
    return f"{tenant_id}/{name}@{version}"


def owned_adapter(key: str, tenant_id: str) -> tuple[str, int] | None:
    """(name, version) of a worker's adapter key when `tenant_id` owns it, else None (another tenant's stays hidden)."""
    owner, _, rest = key.partition("/")
    name, _, version = rest.rpartition("@")
    if owner != tenant_id or not name or not version.isdigit():
        return None
    return name, int(version)


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
        return ResolvedModel(
            name.base, model_dir, AdapterRef(adapter_key(tenant_id, name.adapter, row.version), source)
        )
