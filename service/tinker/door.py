"""The Tinker door: Tinker's sessions, training models and sampling sessions, each a handle on what inkwell
already has.

A Tinker session (one `ServiceClient`) holds training models and samplers. A training model is one inkwell
training session (`SessionManager`), named `<tinker session>:train:<n>` as the client derives it; its requests
pass its `SeqGate` in seq_id order and become the manager's operations, each answered by the manager's futures.
A sampler names a serving model (`<base>` or `<base>:<adapter>@<version|alias>`) and samples through the
sessions' `sampling.sample`. How each future's result leaves (protobuf or JSON) is kept beside its id until it
expires.
"""

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from tinker import types

from inkwell.adapters.spec import LoraSpec
from inkwell.models import load_base_config
from inkwell.service.errors import APIError, not_found
from inkwell.service.sessions import messages, sampling
from inkwell.service.sessions import schemas as session_schemas
from inkwell.service.sessions.futures import Future, FutureError, FutureStore
from inkwell.service.sessions.manager import STATE_META, LiveSession, SessionManager, state_prefix
from inkwell.service.storage import ObjectMissing
from inkwell.service.tinker import codec
from inkwell.service.tinker.errors import future_failure
from inkwell.service.tinker.ordering import Admitted, SeqGate
from inkwell.service.tinker.paths import TinkerPath, check_name
from inkwell.service.tinker.runs import RunRecord, Runs
from inkwell.serving.resolve import ModelMismatchError, ModelNotFoundError
from inkwell.serving.rules import context_limit
from inkwell.serving.tier import ServingTier
from inkwell.trainer.core import AdamParams
from inkwell.trainer.datums import DatumError, check_request
from inkwell.trainer.losses import LOSSES
from inkwell.validation import first_error

LORA_ALPHA = 32.0  # Tinker's fixed LoRA alpha: the learning rate does not depend on the rank
SEQ_WAIT_SECONDS = 50.0  # under the client's 60 s timeout; it sends the request again on the 408
LONG_POLL_SECONDS = 30.0  # under retrieve_future's 45 s timeout
# The client beats every 10 s and warns after 2 min without an answer that its session will be ended: one silent
# this long has gone (killed, or its machine asleep), and its training models give their slots back.
HEARTBEAT_LOST_SECONDS = 120.0
FORGET_FINISHED_SECONDS = 3600.0  # a finished session still answers 410 to its client this long
PRUNE_EVERY = 512
SUPPORTED_LOSSES = ", ".join(LOSSES)
RL_LOSSES = [name for name, loss in LOSSES.items() if "advantages" in loss.inputs]

log = logging.getLogger("inkwell.tinker")

type Render = Callable[[Any], Response]
type JsonRequest = (
    types.OptimStepRequest | types.SaveWeightsRequest | types.LoadWeightsRequest | types.SaveWeightsForSamplerRequest
)

# The future kind of a training model's JSON request, by its body's type (forward_backward, protobuf, makes
# "forward" or "forward_backward" futures); /v1 and the console list a session's futures by kind.
REQUEST_KINDS: dict[type[JsonRequest], str] = {
    types.OptimStepRequest: "optim_step",
    types.SaveWeightsRequest: "save_state",
    types.LoadWeightsRequest: "load_state",
    types.SaveWeightsForSamplerRequest: "save_weights_for_sampler",
    types.SaveWeightsExternalRequest: "save_weights_external",
}


def lora_spec(config: types.LoraConfig | None) -> LoraSpec:
    """Tinker's LoRA config as inkwell's: train_mlp covers the dense MLP and both kinds of experts."""
    config = config or types.LoraConfig(rank=32)
    targets = ["attn"] if config.train_attn else []
    targets += ["mlp", "experts", "shared_experts"] if config.train_mlp else []
    targets += ["lm_head"] if config.train_unembed else []
    if not targets:
        raise APIError(
            400,
            "validation_error",
            "lora_config: train_attn, train_mlp and train_unembed are all false; set at least one",
            field="lora_config",
        )
    try:
        return LoraSpec(rank=config.rank, alpha=LORA_ALPHA, targets=tuple(targets))
    except ValidationError as exc:
        field, why = first_error(exc, "lora_config")
        raise APIError(400, "validation_error", f"{field}: {why}", field=field) from exc


@dataclass
class TinkerSession:
    id: str
    tenant_id: str
    models: list[str] = field(default_factory=list)
    finished: bool = False
    # monotonic time of its creation or its client's last heartbeat; once finished, of its finish (the reaper
    # forgets it an hour later)
    last_beat: float = field(default_factory=time.monotonic)


@dataclass
class TinkerModel:
    id: str
    session: TinkerSession
    live: LiveSession
    created: Future  # settles when the session worker is up; a repeated create answers with it again
    gate: SeqGate = field(default_factory=SeqGate)


@dataclass(frozen=True)
class Sampler:
    id: str
    tenant_id: str
    base_model: str
    model: str  # the serving tier's model name
    model_path: str | None
    max_context: int


def _json(value: Any) -> Response:
    return JSONResponse(value)


class TinkerDoor:
    def __init__(self, manager: SessionManager, runs: Runs, tier: ServingTier | None) -> None:
        self.manager, self.runs, self.tier = manager, runs, tier
        self.sessions: dict[str, TinkerSession] = {}
        self.models: dict[str, TinkerModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._renders: dict[str, tuple[str, Render]] = {}

    # ---- futures -----------------------------------------------------------------------------------------

    def _answer(self, tenant_id: str, future: Future, render: Render) -> Future:
        if len(self._renders) % PRUNE_EVERY == 0:
            gone = [fid for fid, (tenant, _) in self._renders.items() if self.manager.futures.get(tenant, fid) is None]
            for fid in gone:
                del self._renders[fid]
        self._renders[future.id] = (tenant_id, render)
        return future

    async def retrieve(self, tenant_id: str, request_id: str) -> Response:
        """The future's result once settled (long-polled), else `try_again`; a failure as `{error, category}`,
        or 410 for a sample that may work when sent again (the client resubmits it)."""
        future = self.manager.futures.get(tenant_id, request_id)
        if future is None:
            raise not_found("request", request_id)
        if not await future.wait(LONG_POLL_SECONDS):
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if future.error is not None:
            body = future_failure(future.error)
            return JSONResponse(body, status_code=410 if future.kind == "sample" and future.error.retryable else 200)
        _, render = self._renders.get(request_id, (tenant_id, _json))
        return await asyncio.to_thread(render, future.result)

    # ---- sessions ----------------------------------------------------------------------------------------

    def create_session(self, tenant_id: str) -> str:
        session = TinkerSession(f"ts_{secrets.token_hex(12)}", tenant_id)
        self.sessions[session.id] = session
        return session.id

    def session(self, tenant_id: str, session_id: str) -> TinkerSession:
        session = self.sessions.get(session_id)
        if session is None or session.tenant_id != tenant_id:
            raise not_found("session", session_id)
        if session.finished:
            raise APIError(410, "session_finished", f"session {session_id} has finished; create a new ServiceClient")
        return session

    def heartbeat(self, tenant_id: str, session_id: str) -> None:
        """Keep the session's training models open (an idle model is closed after the sessions' idle timeout)."""
        session = self.session(tenant_id, session_id)
        session.last_beat = time.monotonic()
        for model_id in session.models:
            live = self.models[model_id].live
            if live.state != "closed":
                live.touch()

    async def finish(self, tenant_id: str, session_id: str) -> None:
        """Close the session's training models (their devices and session slots are released) and forget its models
        and samplers; their checkpoints stay."""
        await self._finish(self.session(tenant_id, session_id), "closed_by_owner", "finished")

    async def _finish(self, session: TinkerSession, reason: str, why: str) -> None:
        session.finished, session.last_beat = True, time.monotonic()
        for model_id in session.models:
            model = self.models.pop(model_id)
            await self.manager.close(model.live, reason, f"Tinker session {session.id} {why}")
        for sampler_id in [sid for sid in self.samplers if sid.startswith(f"{session.id}:")]:
            del self.samplers[sampler_id]

    async def reap(self, interval: float) -> None:
        """Every `interval` s: finish the sessions whose client stopped beating (a killed script left its training
        models holding session slots until the sessions' idle timeout, ten minutes, and a new run waited on 429s
        as long), and forget those finished an hour ago."""
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                silent = now - session.last_beat
                if session.finished and silent > FORGET_FINISHED_SECONDS:
                    del self.sessions[session.id]
                elif not session.finished and silent > HEARTBEAT_LOST_SECONDS:
                    log.info("Tinker session %s: no heartbeat for %.0f s; its models close", session.id, silent)
                    await self._finish(session, "session_heartbeat_lost", f"had no heartbeat for {silent:.0f} s")

    # ---- training models ---------------------------------------------------------------------------------

    async def _open(
        self,
        tenant_id: str,
        session_id: str,
        model_seq_id: int,
        open_session: Callable[[], Any],
        result: dict[str, Any],
        user_metadata: dict[str, Any] | None,
    ) -> Future:
        """The training model `<session>:train:<n>` on a new inkwell session (`open_session()`); its future
        settles with `result` once the session worker is up."""
        session = self.session(tenant_id, session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:  # the client sent its create again
            return self.models[model_id].created
        live: LiveSession = await open_session()
        record = RunRecord(
            run_id=live.id,
            model_id=model_id,
            base_model=live.base_model,
            lora=live.lora.model_dump(mode="json"),
            adapter_name=live.adapter_name,
            user_metadata={k: str(v) for k, v in (user_metadata or {}).items()},
        )
        await asyncio.to_thread(self.runs.write, tenant_id, record)
        created = self.manager.futures.create(tenant_id, "create_model", live.id)
        self.models[model_id] = TinkerModel(model_id, session, live, created)
        session.models.append(model_id)
        asyncio.ensure_future(self._settle_when_up(live, created, {**result, "model_id": model_id}))
        return self._answer(tenant_id, created, _json)

    async def _settle_when_up(self, live: LiveSession, future: Future, result: dict[str, Any]) -> None:
        while live.state == "starting":
            await asyncio.sleep(0.1)
        if live.state == "active":
            self.manager.futures.succeed(future, result)
        else:
            code = live.closed_code or "session_start_failed"
            self.manager.futures.fail(future, FutureError(code, live.closed_reason or "the session did not start"))

    async def create_model(self, tenant_id: str, req: types.CreateModelRequest) -> Future:
        _check_optimizer(req.optimizer_config)
        lora = lora_spec(req.lora_config)
        seed = req.lora_config.seed if req.lora_config and req.lora_config.seed is not None else 0

        def open_session():
            return self.manager.create(tenant_id, req.base_model, lora, seed, None, None, True)

        return await self._open(tenant_id, req.session_id, req.model_seq_id, open_session, {}, req.user_metadata)

    async def create_from_state(self, tenant_id: str, req: types.LoadWeightsRequest) -> Future:
        """create_training_client_from_state[_with_optimizer]: a new model from a saved state (its base model and
        LoRA spec; the optimizer's moments and step too when `optimizer`)."""
        _check_optimizer(req.optimizer_config)
        path = _training_state(req.path)
        base = (await asyncio.to_thread(self._state_meta, tenant_id, path))["base_model"]
        if req.base_model is not None and req.base_model != base:
            raise APIError(
                400, "validation_error", f"base_model: {path} was trained on {base!r}, not {req.base_model!r}"
            )

        def open_session():
            return self.manager.create(tenant_id, base, LoraSpec(), 0, None, path.state_ref, req.optimizer)

        return await self._open(
            tenant_id, req.session_id, req.model_seq_id, open_session, {"path": str(path)}, req.user_metadata
        )

    def _state_meta(self, tenant_id: str, path: TinkerPath) -> dict[str, Any]:
        try:
            return json.loads(
                self.manager.store.get_bytes(state_prefix(tenant_id, path.run_id, path.name) + STATE_META)
            )
        except ObjectMissing:
            raise not_found("checkpoint", str(path)) from None

    def model(self, tenant_id: str, model_id: str | None) -> TinkerModel:
        model = self.models.get(model_id or "")
        if model is None or model.session.tenant_id != tenant_id:
            raise not_found("model", str(model_id))
        return model

    def info(self, model: TinkerModel) -> dict[str, Any]:
        """get_info: the tokenizer is the base model's directory on this host (AutoTokenizer loads it offline)."""
        live = model.live
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_data": {
                "arch": "inkling",
                "model_name": live.base_model,
                "tokenizer_id": str(Path(live.base_dir).resolve()),
            },
            "is_lora": True,
            "lora_rank": live.lora.rank,
        }

    async def _in_order[P](
        self,
        tenant_id: str,
        model_id: str | None,
        seq_id: int | None,
        kind: str,
        check: Callable[[LiveSession], Awaitable[P]],
        submit: Callable[[LiveSession, P], Awaitable[tuple[Future, Render]]],
    ) -> Future:
        """A training request: `check(live)` on arrival, then, in the model's seq_id order, `submit(live, checked)`
        queues it on the session. The client gets a future at once, which settles as the session's future does, or
        fails with what `check` or `submit` raised (a bad datum, a closed session). Refusals go through the future,
        not the POST: a forward_backward whose later chunk's POST failed would never send its first chunk."""
        model = self.model(tenant_id, model_id)
        if seq_id is None:
            raise APIError(400, "validation_error", "seq_id: required for a training model's requests", field="seq_id")
        futures = self.manager.futures

        async def accept() -> Admitted[Future]:
            try:
                checked = await check(model.live)
            except APIError as exc:  # refused through its future: the client sends every chunk before it looks
                return self._refused(tenant_id, model, kind, exc)
            answer = futures.create(tenant_id, kind, model.live.id)

            async def start() -> None:
                try:
                    inner, render = await submit(self.manager.use(tenant_id, model.live.id), checked)
                except Exception as exc:  # noqa: BLE001 - the future says why the request did not run
                    futures.fail(answer, _as_failure(exc))
                    return
                self._answer(tenant_id, answer, render)
                asyncio.ensure_future(_mirror(inner, answer, futures))

            def abandon(reason: str) -> None:
                futures.fail(answer, FutureError("request_timeout", reason))

            return Admitted(answer, start, abandon)

        return await model.gate.admit(seq_id, accept, SEQ_WAIT_SECONDS)

    async def refuse(
        self, tenant_id: str, model_id: str, seq_id: int, schema: type[JsonRequest], error: APIError
    ) -> Future:
        """A training request whose body does not validate as `schema` but names its model and seq_id: refused
        through its future, in its turn. Refused at the POST, its seq_id never reached the gate, and the model's
        later requests waited for it."""
        model = self.model(tenant_id, model_id)
        kind = REQUEST_KINDS[schema]

        async def accept() -> Admitted[Future]:
            return self._refused(tenant_id, model, kind, error)

        return await model.gate.admit(seq_id, accept, SEQ_WAIT_SECONDS)

    def _refused(self, tenant_id: str, model: TinkerModel, kind: str, error: APIError) -> Admitted[Future]:
        """A request taken in only to fail: its future says why, and it has nothing to start in its turn."""
        answer = self.manager.futures.create(tenant_id, kind, model.live.id)
        self.manager.futures.fail(answer, _as_failure(error))
        return Admitted(answer, _nothing, _settled)

    async def forward_backward(self, tenant_id: str, msg: codec.pb.ForwardBackwardRequest) -> Future:
        """Datums are decoded and checked on arrival; one that cannot be fails the request through its future."""

        async def check(live: LiveSession) -> codec.ForwardBackwardBody:
            try:
                body = await asyncio.to_thread(codec.decode_forward_backward, msg)
            except codec.CodecError as exc:
                raise APIError(400, "invalid_body", str(exc)) from exc
            if body.loss_fn not in LOSSES:
                raise APIError(
                    400,
                    "unsupported_loss",
                    f"loss_fn {body.loss_fn!r} is not supported by inkwell; use one of {SUPPORTED_LOSSES} "
                    "(forward_backward_custom works: the client computes its loss from forward's logprobs)",
                    field="loss_fn",
                )
            try:
                await asyncio.to_thread(
                    check_request, body.data, body.loss_fn, body.loss_fn_config, live.vocab_size, live.max_context
                )
            except DatumError as exc:
                raise APIError(400, "invalid_datum", str(exc), field=exc.field, index=exc.index) from exc
            return body

        kind = "forward" if msg.forward_only else "forward_backward"

        async def submit(live: LiveSession, body: codec.ForwardBackwardBody) -> tuple[Future, Render]:
            config = {k: float(v) for k, v in body.loss_fn_config.items()}

            def op(fid: str) -> messages.ForwardBackward:
                return messages.ForwardBackward(fid, body.data, body.loss_fn, config, not body.forward_only)

            return self.manager.submit(live, kind, op), _proto(codec.encode_forward_backward)

        return await self._in_order(tenant_id, msg.model_id, msg.seq_id, kind, check, submit)

    async def optim_step(self, tenant_id: str, req: types.OptimStepRequest) -> Future:
        async def check(live: LiveSession) -> AdamParams:
            if not isinstance(req.optim_params, types.AdamParams):
                raise APIError(400, "unsupported_optimizer", "inkwell's optimizer is AdamW: send AdamParams")
            try:
                adam = session_schemas.AdamParams.model_validate(req.optim_params.model_dump())
            except ValidationError as exc:
                field, why = first_error(exc, "adam_params")
                raise APIError(400, "validation_error", f"{field}: {why}", field=field) from exc
            return AdamParams(**adam.model_dump())

        async def submit(live: LiveSession, adam: AdamParams) -> tuple[Future, Render]:
            return self.manager.optim_step(live, adam), lambda result: _json({"metrics": result["metrics"]})

        return await self._in_order(tenant_id, req.model_id, req.seq_id, REQUEST_KINDS[type(req)], check, submit)

    async def save_state(self, tenant_id: str, req: types.SaveWeightsRequest) -> Future:
        async def check(live: LiveSession) -> TinkerPath:
            return TinkerPath(live.id, "weights", check_name(req.path, "path"))

        async def submit(live: LiveSession, path: TinkerPath) -> tuple[Future, Render]:
            if req.overwrite:
                await asyncio.to_thread(self._delete_state, tenant_id, path)
            future = await asyncio.to_thread(self.manager.save_state, live, path.name)
            return future, lambda result: _json({"path": str(path)})

        return await self._in_order(tenant_id, req.model_id, req.seq_id, REQUEST_KINDS[type(req)], check, submit)

    async def save_external(self, tenant_id: str, req: types.SaveWeightsExternalRequest) -> Future:
        """The adapter in the `peft` layout as external weights (`tinker://<run>/external_weights/<name>`), for
        get_external_weights_urls and `tinker checkpoint download`. Never encrypted; `ttl_seconds` is ignored."""

        async def check(live: LiveSession) -> TinkerPath:
            if req.age_encryption_recipients:
                raise APIError(
                    400,
                    "unsupported_parameter",
                    "age_encryption_recipients: inkwell does not encrypt exports; save without them (the download "
                    "URLs are presigned, each valid for the service's INKWELL_PRESIGN_SECONDS)",
                    field="age_encryption_recipients",
                )
            return TinkerPath(live.id, "external_weights", check_name(req.path, "path"))

        async def submit(live: LiveSession, path: TinkerPath) -> tuple[Future, Render]:
            future = await asyncio.to_thread(self.manager.save_external, live, path.name)
            render = {"path": str(path), "type": "save_weights_external"}
            return future, lambda result: _json({**render, "size_bytes": result["size_bytes"]})

        return await self._in_order(tenant_id, req.model_id, req.seq_id, REQUEST_KINDS[type(req)], check, submit)

    def _delete_state(self, tenant_id: str, path: TinkerPath) -> None:
        keys = [o.key for o in self.manager.store.list_objects(state_prefix(tenant_id, path.run_id, path.name))]
        if keys:
            self.manager.store.delete(keys)

    async def load_state(self, tenant_id: str, req: types.LoadWeightsRequest) -> Future:
        """The deprecated TrainingClient.load_state*: the saved state into this model (same base and LoRA)."""

        async def check(live: LiveSession) -> TinkerPath:
            return _training_state(req.path)

        async def submit(live: LiveSession, path: TinkerPath) -> tuple[Future, Render]:
            future = await asyncio.to_thread(self.manager.load_state, live, path.state_ref, req.optimizer)
            return future, lambda result: _json({"path": str(path)})

        return await self._in_order(tenant_id, req.model_id, req.seq_id, REQUEST_KINDS[type(req)], check, submit)

    async def save_for_sampler(self, tenant_id: str, req: types.SaveWeightsForSamplerRequest) -> Future:
        """Publish the adapter as a registry version (and push it to the serving workers). Named: the alias
        `tinker-<name>` points at it and the answer is its path; unnamed: a sampler of that version."""
        model = self.model(tenant_id, req.model_id)

        async def check(live: LiveSession) -> str | None:
            if req.kind != "snapshot":
                raise APIError(400, "unsupported_kind", f"kind {req.kind!r}: inkwell publishes snapshots only")
            if req.path is None and req.sampling_session_seq_id is None:
                raise APIError(400, "validation_error", "sampling_session_seq_id: required without a path")
            return None if req.path is None else check_name(req.path, "path")

        async def submit(live: LiveSession, name: str | None) -> tuple[Future, Render]:
            if name is not None:
                path = TinkerPath(live.id, "sampler_weights", name)
                future = self.manager.save_weights_for_sampler(live, path.alias)
                return future, lambda result: _json({"path": str(path)})
            sampler_id = f"{model.session.id}:sample:{req.sampling_session_seq_id}"

            def render(result: dict[str, Any]) -> Response:
                # the sampler exists before its id reaches the client, which samples from it next
                context = self.context_of(live.base_dir)
                sampler = Sampler(sampler_id, tenant_id, live.base_model, result["model"], None, context)
                self.samplers.setdefault(sampler_id, sampler)
                return _json({"sampling_session_id": sampler_id})

            return self.manager.save_weights_for_sampler(live, None), render

        return await self._in_order(tenant_id, req.model_id, req.seq_id, REQUEST_KINDS[type(req)], check, submit)

    # ---- sampling ----------------------------------------------------------------------------------------

    def _tier(self) -> ServingTier:
        if self.tier is None:
            raise APIError(503, "serving_unavailable", "this service runs no serving tier")
        return self.tier

    def context_of(self, base_dir: str | Path) -> int:
        """The context a serving worker gives a request on this base (prompt and generated tokens)."""
        return context_limit(load_base_config(base_dir), self._tier().settings.max_context)

    async def _sampler(
        self, tenant_id: str, sampler_id: str, model_path: str | None, base_model: str | None
    ) -> Sampler:
        """A sampler of `model_path` (sampler weights) or else `base_model`, checked to exist for the tenant."""
        if model_path is not None:
            base, model = await asyncio.to_thread(
                self.runs.sampler_model, tenant_id, TinkerPath.parse(model_path, "model_path")
            )
        elif base_model is not None:
            base = model = base_model
        else:
            raise APIError(400, "validation_error", "model_path or base_model: give one to sample from")
        try:
            resolved = await self._tier().resolve(tenant_id, model)
        except ModelNotFoundError as exc:
            if model_path is not None:
                raise _weights_gone(model_path, str(exc)) from exc
            raise APIError(404, "model_not_found", str(exc), field="base_model") from exc
        except ModelMismatchError as exc:
            raise APIError(400, "model_mismatch", str(exc), field="model_path") from exc
        max_context = await asyncio.to_thread(self.context_of, resolved.model_dir)
        return Sampler(sampler_id, tenant_id, base, model, model_path, max_context)

    async def create_sampler(self, tenant_id: str, req: types.CreateSamplingSessionRequest) -> str:
        session = self.session(tenant_id, req.session_id)
        sampler_id = f"{session.id}:sample:{req.sampling_session_seq_id}"
        self.samplers[sampler_id] = await self._sampler(tenant_id, sampler_id, req.model_path, req.base_model)
        return sampler_id

    def sampler(self, tenant_id: str, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant_id != tenant_id:
            raise not_found("sampler", sampler_id)
        return sampler

    async def sample(self, tenant_id: str, req: types.SampleRequest) -> Future:
        """sample / compute_logprobs through the serving tier; the answer is a SampleResponse protobuf."""
        if req.sampling_session_id is not None:
            sampler = self.sampler(tenant_id, req.sampling_session_id)
        else:
            sampler = await self._sampler(tenant_id, "", req.model_path, req.base_model)
        unsupported = [
            name
            for name, given in (
                ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                ("record_stability_info", bool(req.record_stability_info)),
            )
            if given
        ]
        if unsupported:
            why = f"{', '.join(unsupported)}: not supported by inkwell"
            if req.record_stability_info:  # what tinker-cookbook's RL loops ask for by default
                why += (
                    "; it records what loss_fn stable_reinforce trains on, which inkwell does not implement: train "
                    f"with another RL loss ({', '.join(RL_LOSSES)}; tinker-cookbook: loss_fn=...) and sample without it"
                )
            raise APIError(400, "unsupported_parameter", why)
        tokens = _prompt_tokens(req.prompt)
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(tokens) - 1:
            raise APIError(400, "validation_error", f"prompt_logprobs_last_n: {last_n} is not in 1..{len(tokens) - 1}")
        params = req.sampling_params
        stop = [params.stop] if isinstance(params.stop, str) else (list(params.stop) if params.stop else None)
        max_tokens = params.max_tokens if params.max_tokens is not None else sampler.max_context - len(tokens)
        try:
            body = session_schemas.SampleRequest(
                model=sampler.model,
                prompt_tokens=tokens,
                num_samples=req.num_samples,
                max_tokens=max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                stop=stop,
                prompt_logprobs=bool(req.prompt_logprobs),
                topk_prompt_logprobs=req.topk_prompt_logprobs,
                topk_logprobs=req.topk_sample_logprobs,
            )
        except ValidationError as exc:
            field, why = first_error(exc)
            raise APIError(400, "validation_error", f"{field}: {why}", field=field) from exc
        try:
            future = await sampling.sample(self._tier(), self.manager.futures, tenant_id, body)
        except APIError as exc:
            if exc.code == "model_not_found" and sampler.model_path:
                raise _weights_gone(sampler.model_path, exc.message) from exc
            raise

        def render(result: dict[str, Any]) -> Response:
            return _proto(codec.encode_sample)(result, last_n, req.topk_prompt_logprobs, req.topk_sample_logprobs)

        return self._answer(tenant_id, future, render)


def _weights_gone(model_path: str, reason: str) -> APIError:
    """Sampler weights that no longer resolve, named by their tinker:// path rather than the registry's names."""
    message = f"{model_path}: these sampler weights were deleted or never saved ({reason})"
    return APIError(404, "model_not_found", message, field="model_path")


def _training_state(tinker_path: str) -> TinkerPath:
    path = TinkerPath.parse(tinker_path)
    if path.kind != "weights":
        raise APIError(400, "invalid_path", f"{path} is not a training state; load tinker://<run>/weights/<name>")
    return path


async def _nothing() -> None:
    pass


def _settled(reason: str) -> None:
    """Nothing to give up: the request's future has already failed."""


async def _mirror(inner: Future, outer: Future, futures: FutureStore) -> None:
    """Settle `outer` as `inner` settles."""
    while not await inner.wait(3600.0):
        pass
    if inner.error is not None:
        futures.fail(outer, inner.error)
    else:
        futures.succeed(outer, inner.result)


def _as_failure(exc: Exception) -> FutureError:
    if isinstance(exc, APIError):
        details = {k: v for k, v in exc.details.items() if k != "retryable"}
        return FutureError(exc.code, exc.message, bool(exc.details.get("retryable")), details)
    return FutureError("session_error", f"{type(exc).__name__}: {exc}")


def _check_optimizer(config: types.OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise APIError(400, "unsupported_optimizer", f"optimizer {config.type!r}: inkwell trains with AdamW only")


def _prompt_tokens(prompt: types.ModelInput) -> list[int]:
    try:
        return prompt.to_ints()
    except ValueError as exc:
        raise APIError(
            400, "validation_error", "prompt: only encoded_text chunks are supported", field="prompt"
        ) from exc


def _proto(encode: Callable[..., bytes]) -> Callable[..., Response]:
    def render(*args: Any) -> Response:
        return Response(encode(*args), media_type="application/x-protobuf")

    return render
