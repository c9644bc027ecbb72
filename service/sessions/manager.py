"""The training sessions of one API process: open them (one worker process each, at most `max_sessions`), queue
their requests in submission order, keep them alive on heartbeats, close idle ones, and remember why each ended.

A session's saved states live in the object store under `sessions/<tenant>/<session>/states/<name>/` (the
trainer's checkpoint plus `session.json`: the base model and LoRA spec a new session starts from), and its adapter
exported to run elsewhere under `sessions/<tenant>/<session>/external/<name>/` (the `peft` layout). Sampler weights
are published as immutable registry versions and handed to the serving workers of the base model in shared
memory (the adapter only; the base stays resident; no disk or S3 on the way).
"""

import asyncio
import json
import logging
import math
import secrets
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from inkwell.adapters.manifest import MANIFEST
from inkwell.adapters.spec import LoraSpec
from inkwell.models import load_base_config
from inkwell.models.routing import RoutingShape
from inkwell.service.db import repo
from inkwell.service.db.models import BaseModelRow, utcnow
from inkwell.service.errors import APIError, not_found
from inkwell.service.model_resolver import adapter_key
from inkwell.service.registry import Publication, publish
from inkwell.service.sessions import messages
from inkwell.service.sessions.futures import Future, FutureStore
from inkwell.service.sessions.handle import Finish, FinishError, SessionHandle, SessionStartError
from inkwell.service.sessions.schemas import SessionPoint
from inkwell.service.sessions.settings import SessionSettings
from inkwell.service.settings import Settings
from inkwell.service.storage import ObjectMissing, ObjectStore
from inkwell.serving.router import AdapterRef
from inkwell.serving.sources import MemorySource
from inkwell.serving.tier import ServingTier

log = logging.getLogger("inkwell.sessions")
STATE_META = "session.json"
CLOSED_KEPT = 1000  # closed sessions remembered, so an owner coming back learns why
HISTORY_KEPT = 2000  # training requests' metrics remembered per session (the console draws them)
RECORDED_KINDS = ("forward_backward", "forward", "optim_step")


def state_prefix(tenant_id: str, session_id: str, name: str) -> str:
    return f"sessions/{tenant_id}/{session_id}/states/{name}/"


def external_prefix(tenant_id: str, session_id: str, name: str) -> str:
    return f"sessions/{tenant_id}/{session_id}/external/{name}/"


@dataclass
class LiveSession:
    id: str
    tenant_id: str
    base_model: str
    base_dir: str
    base_config_sha256: str
    lora: LoraSpec
    seed: int
    adapter_name: str
    vocab_size: int
    max_context: int
    routing: RoutingShape  # the routing traces its datums may carry
    created_at: datetime = field(default_factory=utcnow)
    last_active: float = field(default_factory=time.monotonic)
    last_active_at: datetime = field(default_factory=utcnow)
    state: str = "starting"
    step: int = 0
    closed_code: str | None = None
    closed_reason: str | None = None
    handle: SessionHandle | None = None
    saving: set[str] = field(default_factory=set)  # state names whose save is queued or running
    exporting: set[str] = field(default_factory=set)  # external weights' names whose export is queued or running
    history: deque[SessionPoint] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))

    def touch(self) -> None:
        self.last_active, self.last_active_at = time.monotonic(), utcnow()

    def record(self, kind: str, metrics: dict[str, float]) -> None:
        """Remember a finished training request's metrics at the session's step (non-finite values as null)."""
        finite = {k: float(v) if math.isfinite(v) else None for k, v in metrics.items()}
        self.history.append(SessionPoint(kind=kind, step=self.step, metrics=finite, finished_at=utcnow()))


class SessionManager:
    def __init__(
        self,
        sm: sessionmaker[Session],
        read_sm: sessionmaker[Session],
        store: ObjectStore,
        service: Settings,
        settings: SessionSettings,
        serving: ServingTier | None,
    ) -> None:
        """`sm` publishes sampler weights; `read_sm` reads (on SQLite it never waits for the database's writer)."""
        self.sm, self.read_sm, self.store, self.service = sm, read_sm, store, service
        self.settings, self.serving = settings, serving
        self.futures = FutureStore(asyncio.get_running_loop())
        self.sessions: dict[str, LiveSession] = {}
        self.scratch = Path(service.data_dir).resolve() / "sessions"

    # ---- lifecycle ----

    def open_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.state != "closed")

    async def create(
        self,
        tenant_id: str,
        base_model: str,
        lora: LoraSpec,
        seed: int,
        adapter_name: str | None,
        from_state: str | None,
        with_optimizer: bool,
    ) -> LiveSession:
        initial = None
        if from_state is not None:
            initial, meta = await asyncio.to_thread(self._state_meta, tenant_id, from_state)
            if base_model != meta["base_model"]:
                raise APIError(
                    422,
                    "validation_error",
                    f"from_state: state {from_state!r} was trained on {meta['base_model']!r}, not {base_model!r}",
                    field="from_state",
                )
            lora = LoraSpec.model_validate(meta["lora"])
        row = await asyncio.to_thread(self._base_model, base_model)
        if row is None:
            raise APIError(404, "not_found", f"base model {base_model!r} is not registered (see GET /v1/models)")
        hf = await asyncio.to_thread(load_base_config, row.path)
        # after the request's own checks (a bad one is told so, not to retry), and after the last await: two
        # creates that both passed the count before either took its slot would both have started
        if self.open_count() >= self.settings.max_sessions:
            raise APIError(
                429,
                "too_many_sessions",
                f"all {self.settings.max_sessions} session slots are in use; close a session or retry later",
                retryable=True,
                retry_after_seconds=10,
            )
        session_id = f"sess_{secrets.token_hex(12)}"
        live = LiveSession(
            id=session_id,
            tenant_id=tenant_id,
            base_model=base_model,
            base_dir=row.path,
            base_config_sha256=row.config_sha256,
            lora=lora,
            seed=seed,
            adapter_name=adapter_name or f"session-{session_id[5:17]}",
            vocab_size=hf.vocab_size,
            max_context=hf.max_position_embeddings,
            routing=RoutingShape.of(hf),
        )
        service = self.service
        config = messages.SessionConfig(
            session_id=session_id,
            base_model_dir=row.path,
            lora=lora,
            seed=seed,
            device=self.settings.device,
            dtype=self.settings.dtype,
            threads=self.settings.threads,
            scratch_dir=str(self.scratch / session_id),
            store=messages.StoreConfig(
                self.store.endpoint, self.store.bucket, service.s3_region, service.s3_access_key, service.s3_secret_key
            ),
            initial_state=initial,
            with_optimizer=with_optimizer,
        )
        live.handle = SessionHandle(config, self.futures, lambda reason: self._worker_exited(live, reason))
        self.sessions[session_id] = live
        asyncio.ensure_future(self._start(live))
        return live

    def _base_model(self, name: str) -> BaseModelRow | None:
        with self.read_sm() as s:
            return repo.get_base_model(s, name)

    async def _start(self, live: LiveSession) -> None:
        try:
            info = await asyncio.to_thread(live.handle.start, self.settings.start_timeout)
        except SessionStartError as exc:
            self._closed(live, exc.code, f"the session could not start: {exc}")
            return
        if live.state == "starting":
            live.state, live.step = "active", info.step

    def _worker_exited(self, live: LiveSession, reason: str) -> None:
        """From the handle's reader thread: the worker died on its own."""
        self.futures.loop.call_soon_threadsafe(
            self._closed, live, "session_worker_died", f"{reason}; create a new session, from a saved state if any"
        )

    def _closed(self, live: LiveSession, code: str, reason: str) -> None:
        if live.state == "closed":
            return
        live.state, live.closed_code, live.closed_reason = "closed", code, reason
        log.info("session %s closed: %s", live.id, reason)
        closed = [s for s in self.sessions.values() if s.state == "closed"]
        for old in closed[: max(0, len(closed) - CLOSED_KEPT)]:
            del self.sessions[old.id]

    async def close(self, live: LiveSession, code: str, reason: str) -> None:
        self._closed(live, code, reason)
        if live.handle is not None:
            await asyncio.to_thread(live.handle.close)

    async def reap(self) -> None:
        """Close sessions idle longer than `idle_seconds` (no request, no heartbeat, nothing in flight)."""
        while True:
            await asyncio.sleep(self.settings.reap_interval)
            now, limit = time.monotonic(), self.settings.idle_seconds
            for live in list(self.sessions.values()):
                idle = now - live.last_active
                if live.state != "closed" and idle > limit and not self.futures.pending(live.id):
                    reason = (
                        f"no request or heartbeat for {idle:.0f}s (idle timeout {limit:.0f}s); its device was released"
                    )
                    await self.close(live, "session_idle_timeout", reason)

    async def close_all(self) -> None:
        for live in list(self.sessions.values()):
            await self.close(live, "service_stopped", "the service stopped")

    # ---- lookup ----

    def get(self, tenant_id: str, session_id: str) -> LiveSession:
        """The tenant's session, open or closed (looking at a session does not keep it alive)."""
        live = self.sessions.get(session_id)
        if live is None or live.tenant_id != tenant_id:
            raise not_found("session", session_id)
        return live

    def use(self, tenant_id: str, session_id: str) -> LiveSession:
        """The tenant's open session, marked active now (a request or a heartbeat); 410 saying why once closed."""
        live = self.get(tenant_id, session_id)
        if live.state == "closed":
            raise APIError(
                410, live.closed_code or "session_closed", f"session {session_id} is closed: {live.closed_reason}"
            )
        live.touch()
        return live

    def list(self, tenant_id: str) -> list[LiveSession]:
        return [s for s in self.sessions.values() if s.tenant_id == tenant_id]

    def pending(self, live: LiveSession) -> int:
        return len(self.futures.pending(live.id))

    # ---- requests ----

    def submit(self, live: LiveSession, kind: str, op, finish: Finish | None = None) -> Future:
        """Queue an operation (built from the future's id) behind every earlier one of the session; a training
        request's metrics go into the session's history as it finishes."""
        future = self.futures.create(live.tenant_id, kind, live.id)
        if kind in RECORDED_KINDS:
            finish = _recording(live, kind, finish)
        live.handle.send(op(future.id), future, finish)
        return future

    def optim_step(self, live: LiveSession, adam) -> Future:
        async def finish(result: dict[str, Any]) -> dict[str, Any]:
            live.step = result["step"]
            return result

        return self.submit(live, "optim_step", lambda fid: messages.OptimStep(fid, adam), finish)

    def save_state(self, live: LiveSession, name: str) -> Future:
        prefix = state_prefix(live.tenant_id, live.id, name)
        if name in live.saving or self.store.list_objects(prefix):
            raise APIError(409, "conflict", f"session {live.id} already has a state named {name!r}; choose another")
        live.saving.add(name)
        meta = {"base_model": live.base_model, "lora": live.lora.model_dump(mode="json"), "session_id": live.id}

        async def finish(result: dict[str, Any]) -> dict[str, Any]:
            await asyncio.to_thread(
                self.store.put_bytes, prefix + STATE_META, json.dumps({**meta, "step": result["step"]}).encode()
            )
            live.saving.discard(name)
            return {"state": f"{live.id}/{name}", "step": result["step"]}

        return self.submit(live, "save_state", lambda fid: messages.SaveState(fid, prefix), finish)

    def load_state(self, live: LiveSession, ref: str, with_optimizer: bool) -> Future:
        prefix, meta = self._state_meta(live.tenant_id, ref, pending_ok=True)
        if meta is not None and (meta["base_model"], meta["lora"]) != (
            live.base_model,
            live.lora.model_dump(mode="json"),
        ):
            raise APIError(
                422,
                "validation_error",
                f"state: {ref!r} has base model {meta['base_model']!r} and LoRA {meta['lora']}; this session has "
                f"{live.base_model!r} and {live.lora.model_dump(mode='json')}: they must match",
                field="state",
            )

        async def finish(result: dict[str, Any]) -> dict[str, Any]:
            live.step = result["step"]
            return result

        return self.submit(live, "load_state", lambda fid: messages.LoadState(fid, prefix, with_optimizer), finish)

    def _state_meta(self, tenant_id: str, ref: str, pending_ok: bool = False) -> tuple[str, dict | None]:
        """The S3 prefix of saved state `ref` ('<session id>/<name>') and its session.json (None while its save is
        still queued in an open session of this tenant). 404 for anything else, another tenant's state included."""
        session_id, sep, name = ref.partition("/")
        if not sep or not session_id or not name or "/" in name:
            raise APIError(422, "validation_error", f"state: {ref!r} is not '<session id>/<state name>'", field="state")
        prefix = state_prefix(tenant_id, session_id, name)
        try:
            meta = json.loads(self.store.get_bytes(prefix + STATE_META))
        except ObjectMissing:
            owner = self.sessions.get(session_id)
            if pending_ok and owner is not None and owner.tenant_id == tenant_id and name in owner.saving:
                return prefix, None
            raise not_found("saved state", ref) from None
        return prefix, meta

    def save_external(self, live: LiveSession, name: str) -> Future:
        """Export the adapter in the `peft` layout under the session's `external/<name>/`, to be downloaded and run
        outside the service (peft onto transformers' Inkling); its manifest goes last, so an export with one is
        whole."""
        prefix = external_prefix(live.tenant_id, live.id, name)
        if name in live.exporting or self.store.list_objects(prefix):
            raise APIError(
                409, "conflict", f"session {live.id} already has external weights named {name!r}; choose another"
            )
        live.exporting.add(name)
        dest = self.scratch / live.id / f"external-{secrets.token_hex(4)}"

        async def finish(result: dict[str, Any]) -> dict[str, Any]:
            try:
                size = await asyncio.to_thread(self._put_export, prefix, Path(result["dirs"]["peft"]))
            finally:
                live.exporting.discard(name)
                await asyncio.to_thread(shutil.rmtree, dest, True)
            return {"size_bytes": size, "step": result["step"]}

        return self.submit(live, "save_external", lambda fid: messages.ExportAdapter(fid, str(dest)), finish)

    def _put_export(self, prefix: str, root: Path) -> int:
        """Store the files under `root` at `prefix`, the manifest last; returns their bytes."""
        files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: (p.name == MANIFEST, p.as_posix()))
        for file in files:
            self.store.put_file(prefix + file.relative_to(root).as_posix(), file, create_only=False)
        return sum(file.stat().st_size for file in files)

    def save_weights_for_sampler(self, live: LiveSession, alias: str | None) -> Future:
        """Export the adapter, publish it as a new registry version, and push it to the serving workers."""
        dest = self.scratch / live.id / f"export-{secrets.token_hex(4)}"

        async def finish(result: dict[str, Any]) -> dict[str, Any]:
            began = time.perf_counter()
            try:
                version = await asyncio.to_thread(self._publish, live, result, alias)
                published = time.perf_counter()
                key = adapter_key(live.tenant_id, live.adapter_name, version)
                if self.serving is not None:
                    await self.serving.preload(live.base_model, AdapterRef(key, MemorySource(result["adapter"])))
            finally:
                await asyncio.to_thread(shutil.rmtree, dest, True)
            model = f"{live.base_model}:{live.adapter_name}@{version}"
            return {
                "model": model,
                "adapter_name": live.adapter_name,
                "version": version,
                "alias": alias,
                "step": result["step"],
                "publish_seconds": published - began,
                "sync_seconds": time.perf_counter() - published,
            }

        return self.submit(live, "save_weights_for_sampler", lambda fid: messages.ExportAdapter(fid, str(dest)), finish)

    def _publish(self, live: LiveSession, result: dict[str, Any], alias: str | None) -> int:
        pub = Publication(
            tenant_id=live.tenant_id,
            name=live.adapter_name,
            base_model=live.base_model,
            base_config_sha256=live.base_config_sha256,
            layout_dirs={layout: Path(d) for layout, d in result["dirs"].items()},
            lora=live.lora.model_dump(mode="json"),
            source="session",
            metrics={"session_id": live.id, "step": result["step"]},
        )
        try:
            row = publish(self.sm, self.store, pub)
        except ValueError as exc:
            raise FinishError("publish_failed", f"the adapter could not be published: {exc}") from exc
        if alias is not None:
            with self.sm() as s:
                repo.lock_adapter(s, live.tenant_id, live.adapter_name)
                repo.set_alias(s, live.tenant_id, live.adapter_name, alias, row.version)
                s.commit()
        return row.version


def _recording(live: LiveSession, kind: str, finish: Finish | None) -> Finish:
    """`finish` (if any), then the result's metrics recorded at the step it leaves the session at."""

    async def recorded(result: dict[str, Any]) -> Any:
        value = await finish(result) if finish is not None else result
        live.record(kind, result.get("metrics", {}))
        return value

    return recorded
