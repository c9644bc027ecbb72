"""Training runs and their checkpoints as Tinker's REST client sees them.

A run is one training session. Its record (`tinker/<tenant>/runs/<run id>.json` in the object store, written
when the session is created) keeps what the session forgets when it ends: the base model, the LoRA spec, the
registry adapter its sampler weights are published under and the user's metadata. Its checkpoints are read from
where they live: saved states and external weights under the session's prefix (`SessionManager.save_state`,
`save_external`), sampler weights as the registry versions its `tinker-<name>` aliases point at. External weights
are downloaded through presigned URLs of the object store, one per file, which need no key.
"""

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from inkwell.adapters.manifest import MANIFEST
from inkwell.adapters.spec import LoraSpec
from inkwell.service.db import repo
from inkwell.service.db.models import utcnow
from inkwell.service.errors import APIError, not_found
from inkwell.service.sessions.manager import STATE_META, external_prefix, state_prefix
from inkwell.service.storage import ObjectInfo, ObjectMissing, ObjectStore
from inkwell.service.tinker.paths import CHECKPOINT_TYPES, TinkerPath, sampler_name


def _runs_prefix(tenant_id: str) -> str:
    return f"tinker/{tenant_id}/runs/"


# Where a run's saved states and external weights live, by path kind (a folder per checkpoint), and the file each
# save writes last: a folder without it is a save still being written.
PREFIXES = {"weights": state_prefix, "external_weights": external_prefix}
MARKERS = {"weights": STATE_META, "external_weights": MANIFEST}


def _named_objects(store: ObjectStore, root: str, marker: str) -> dict[str, tuple[list[ObjectInfo], ObjectInfo]]:
    """The checkpoints under `root` (`<root><name>/...`) that are whole, i.e. hold their `marker` file (a save in
    progress has none yet): name -> (its objects, the marker's)."""
    named: dict[str, list[ObjectInfo]] = {}
    for obj in store.list_objects(root):
        named.setdefault(obj.key[len(root) :].split("/", 1)[0], []).append(obj)
    out = {}
    for name, objects in named.items():
        marked = [o for o in objects if o.key == f"{root}{name}/{marker}"]
        if marked:
            out[name] = (objects, marked[0])
    return out


def lora_flags(lora: dict[str, Any]) -> dict[str, Any]:
    """Tinker's LoRA fields of an inkwell LoRA spec (train_mlp covers the dense MLP and both kinds of experts)."""
    spec = LoraSpec.model_validate(lora)
    return {
        "lora_rank": spec.rank,
        "train_attn": "attn" in spec.targets,
        "train_mlp": "mlp" in spec.targets,
        "train_unembed": "lm_head" in spec.targets,
    }


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    model_id: str
    base_model: str
    lora: dict[str, Any]
    adapter_name: str
    user_metadata: dict[str, str] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: utcnow().isoformat())


class Runs:
    """Runs' records in the object store; their sampler checkpoints in the registry, read through `read_sm` (on
    SQLite a read never waits for the database's writer) and deleted through `sm`."""

    def __init__(self, sm: sessionmaker[Session], read_sm: sessionmaker[Session], store: ObjectStore) -> None:
        self.sm, self.read_sm, self.store = sm, read_sm, store

    def write(self, tenant_id: str, record: RunRecord) -> None:
        self.store.put_bytes(_runs_prefix(tenant_id) + f"{record.run_id}.json", json.dumps(asdict(record)).encode())

    def read(self, tenant_id: str, run_id: str) -> RunRecord:
        if "/" in run_id:
            raise not_found("training run", run_id)
        try:
            raw = self.store.get_bytes(_runs_prefix(tenant_id) + f"{run_id}.json")
        except ObjectMissing:
            raise not_found("training run", run_id) from None
        return RunRecord(**json.loads(raw))

    def records(self, tenant_id: str) -> list[RunRecord]:
        """The tenant's runs, newest first."""
        objects = sorted(self.store.list_objects(_runs_prefix(tenant_id)), key=lambda o: o.last_modified, reverse=True)
        return [RunRecord(**json.loads(self.store.get_bytes(o.key))) for o in objects]

    # ---- checkpoints -------------------------------------------------------------------------------------

    def checkpoints(self, tenant_id: str, record: RunRecord) -> list[dict[str, Any]]:
        """The run's saved states, external weights and named sampler weights as Tinker `Checkpoint`s, oldest
        first."""
        out = []
        for kind, prefix in PREFIXES.items():
            root = prefix(tenant_id, record.run_id, "").removesuffix("/")  # "sessions/<tenant>/<run>/states/", ...
            for name, (objects, marked) in _named_objects(self.store, root, MARKERS[kind]).items():
                path = TinkerPath(record.run_id, kind, name)
                out.append(_checkpoint(path, marked.last_modified, sum(o.size for o in objects)))
        with self.read_sm() as s:
            for alias, version in repo.aliases_of(s, tenant_id, record.adapter_name).items():
                row = repo.get_version(s, tenant_id, record.adapter_name, version)
                name = sampler_name(alias)
                if name is not None and row is not None and row.deleted_at is None:
                    path = TinkerPath(record.run_id, "sampler_weights", name)
                    out.append(_checkpoint(path, row.created_at, row.size_bytes))
        return sorted(out, key=lambda c: c["time"])

    def delete_checkpoint(self, tenant_id: str, record: RunRecord, path: TinkerPath, actor: str) -> None:
        """A saved state's or external weights' objects go; a sampler checkpoint's alias goes and its version is
        soft-deleted (audited, as DELETE /v1/adapters/{name}/versions/{version} does)."""
        if path.kind != "sampler_weights":
            keys = [o.key for o in self.store.list_objects(self._prefix(tenant_id, path))]
            if not keys:
                raise not_found("checkpoint", str(path))
            self.store.delete(keys)
            return
        name = record.adapter_name
        with self.sm() as s:
            repo.lock_adapter(s, tenant_id, name)
            alias = repo.get_alias(s, tenant_id, name, path.alias)
            if alias is None:
                raise not_found("checkpoint", str(path))
            version = repo.get_version(s, tenant_id, name, alias.version)
            repo.audit(s, tenant_id, actor, "adapter.alias.delete", f"{name}@{path.alias}", {"was": alias.version})
            s.delete(alias)
            if version is not None and version.deleted_at is None:
                version.deleted_at, version.deleted_by = utcnow(), actor
                repo.audit(s, tenant_id, actor, "adapter.version.delete", f"{name}@{version.version}")
            s.commit()

    def _prefix(self, tenant_id: str, path: TinkerPath) -> str:
        """Where a saved state's or external weights' objects live."""
        return PREFIXES[path.kind](tenant_id, path.run_id, path.name)

    def external_urls(self, tenant_id: str, path: TinkerPath, seconds: int) -> dict[str, Any]:
        """Tinker's ExternalWeightsUrlsResponse: a presigned GET URL per file of the external weights at `path`
        (keyed by the file's path in the export), valid for `seconds`."""
        self.read(tenant_id, path.run_id)
        if path.kind != "external_weights":
            raise APIError(
                400,
                "invalid_path",
                f"{path} is not external weights; download tinker://<run>/external_weights/<name> "
                "(save_weights_external)",
                field="checkpoint_id",
            )
        prefix, expires = self._prefix(tenant_id, path), utcnow() + timedelta(seconds=seconds)
        urls = {o.key[len(prefix) :]: self.store.presign_get(o.key, seconds) for o in self._whole(tenant_id, path)}
        return {"urls": urls, "expires": expires.isoformat()}

    def _whole(self, tenant_id: str, path: TinkerPath) -> list[ObjectInfo]:
        """The objects of the saved state or external weights at `path`; 404 unless it is there and whole (the file
        its save writes last is there)."""
        prefix = self._prefix(tenant_id, path)
        objects = self.store.list_objects(prefix)
        if not any(o.key == prefix + MARKERS[path.kind] for o in objects):
            raise not_found("checkpoint", str(path))
        return objects

    def require(self, tenant_id: str, path: TinkerPath) -> None:
        """404 unless the checkpoint at `path` exists (whole) for the tenant."""
        record = self.read(tenant_id, path.run_id)
        if path.kind != "sampler_weights":
            self._whole(tenant_id, path)
        elif not any(c["tinker_path"] == str(path) for c in self.checkpoints(tenant_id, record)):
            raise not_found("checkpoint", str(path))

    def weights_info(self, tenant_id: str, path: TinkerPath) -> dict[str, Any]:
        """The base model and LoRA fields of the checkpoint at `path` (Tinker's WeightsInfoResponse)."""
        record = self.read(tenant_id, path.run_id)
        if path.kind == "external_weights":
            self.require(tenant_id, path)
            base, lora = record.base_model, record.lora
        elif path.kind == "weights":
            try:
                meta = json.loads(self.store.get_bytes(state_prefix(tenant_id, path.run_id, path.name) + STATE_META))
            except ObjectMissing:
                raise not_found("checkpoint", str(path)) from None
            base, lora = meta["base_model"], meta["lora"]
        else:
            with self.read_sm() as s:
                alias = repo.get_alias(s, tenant_id, record.adapter_name, path.alias)
                if alias is None:
                    raise not_found("checkpoint", str(path))
                row = repo.get_version(s, tenant_id, record.adapter_name, alias.version)
            base, lora = row.base_model, row.lora
        return {"base_model": base, "is_lora": True, **lora_flags(lora)}

    def sampler_model(self, tenant_id: str, path: TinkerPath) -> tuple[str, str]:
        """(base model, serving model name) of sampler weights: `<base>:<adapter>@tinker-<name>`."""
        if path.kind != "sampler_weights":
            raise APIError(
                400,
                "invalid_path",
                f"{path} is not sampler weights; sample from tinker://<run>/sampler_weights/<name> "
                "(save_weights_for_sampler)",
                field="model_path",
            )
        record = self.read(tenant_id, path.run_id)
        return record.base_model, f"{record.base_model}:{record.adapter_name}@{path.alias}"

    def view(self, tenant_id: str, record: RunRecord, last_request: datetime | None) -> dict[str, Any]:
        """Tinker's `TrainingRun` of a record."""
        checkpoints = self.checkpoints(tenant_id, record)
        latest = {kind: [c for c in checkpoints if c["checkpoint_type"] == kind] for kind in ("training", "sampler")}
        return {
            "training_run_id": record.run_id,
            "base_model": record.base_model,
            "model_owner": tenant_id,
            "is_lora": True,
            "lora_rank": LoraSpec.model_validate(record.lora).rank,
            "last_request_time": (last_request or datetime.fromisoformat(record.created_at)).isoformat(),
            "last_checkpoint": latest["training"][-1] if latest["training"] else None,
            "last_sampler_checkpoint": latest["sampler"][-1] if latest["sampler"] else None,
            "user_metadata": {k: str(v) for k, v in record.user_metadata.items()},
        }


def _checkpoint(path: TinkerPath, when: datetime, size: int) -> dict[str, Any]:
    return {
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": CHECKPOINT_TYPES[path.kind],
        "time": when.isoformat(),
        "tinker_path": str(path),
        "size_bytes": size,
        "public": False,
        "expires_at": None,
    }
