"""Tinker's wire protocol under `/api/v1` (the `tinker` 0.38 client and tinker-cookbook run unmodified against it):
client config, sessions and heartbeats, training models, sampling, futures and the checkpoint REST routes.

JSON bodies are validated with the client's own request types (`tinker.types`); forward_backward comes as
protobuf (zstd when the client compresses it) and its results, like samples, leave as protobuf. Every call is
authenticated by `X-API-Key: tml-<inkwell key>` and lands on the same sessions, registry and serving tier as
`/v1` (service/tinker/door.py). docs/tinker.md lists each route and how inkwell differs from Tinker.

The service mounts this module as an extension after the sessions: `lifespan(app)` puts the `TinkerDoor` on
`app.state.tinker`.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from tinker import types

from inkwell.service.auth import Principal
from inkwell.service.db import repo
from inkwell.service.deps import get_settings
from inkwell.service.errors import APIError, validation_summary
from inkwell.service.openapi_body import json_body
from inkwell.service.sessions.futures import Future
from inkwell.service.settings import Settings
from inkwell.service.tinker import codec
from inkwell.service.tinker.auth import tinker_principal
from inkwell.service.tinker.door import JsonRequest, TinkerDoor
from inkwell.service.tinker.errors import TinkerRoute
from inkwell.service.tinker.paths import TinkerPath
from inkwell.service.tinker.runs import Runs

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=TinkerRoute)
TTL_SECONDS = (3600, 10 * 365 * 24 * 3600)  # the range Tinker's client documents for a checkpoint's TTL

# What the client may do (ClientConfigResponse): uncompressed protobuf forward_backward bodies (zstd is read when
# sent anyway), chunks sent at once (the seq_id gate orders them), httpx rather than pyqwest (plain HTTP/1.1 here).
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    runs = Runs(state.sessionmaker, state.read_sessionmaker, state.store)
    state.tinker = TinkerDoor(state.sessions, runs, getattr(state, "serving", None))
    reaper = asyncio.ensure_future(state.tinker.reap(state.sessions.settings.reap_interval))
    try:
        yield
    finally:
        reaper.cancel()


def _door(request: Request) -> TinkerDoor:
    return request.app.state.tinker


def _future(future: Future, **extra: Any) -> dict[str, Any]:
    """What every training or sampling call answers at once (UntypedAPIFuture)."""
    return {"request_id": future.id, **extra}


# ---- configuration and health ------------------------------------------------------------------------


@router.post("/client/config")
def client_config() -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    """The client's telemetry is accepted and dropped: nothing leaves the service, nothing is stored."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
def server_capabilities(request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    door = _door(request)
    with request.app.state.read_sessionmaker() as s:
        rows = repo.list_base_models(s)
    sampleable = door.tier is not None
    return {
        "supported_models": [
            {
                "model_name": row.name,
                "max_context_length": door.context_of(row.path) if sampleable else None,
                "trainable": True,
                "sampleable": sampleable,
            }
            for row in rows
        ]
    }


# ---- sessions ----------------------------------------------------------------------------------------


@router.post("/create_session")
def create_session(
    body: types.CreateSessionRequest, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    return {"type": "create_session", "session_id": _door(request).create_session(who.tenant_id)}


@router.post("/session_heartbeat")
def session_heartbeat(
    body: types.SessionHeartbeatRequest, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    _door(request).heartbeat(who.tenant_id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, who: Principal = Depends(tinker_principal)) -> dict:
    await _door(request).finish(who.tenant_id, session_id)
    return {}


# ---- training ----------------------------------------------------------------------------------------


@router.post("/create_model")
async def create_model(
    body: types.CreateModelRequest, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    future = await _door(request).create_model(who.tenant_id, body)
    return _future(future, model_id=f"{body.session_id}:train:{body.model_seq_id}")


@router.post("/get_info")
def get_info(body: types.GetInfoRequest, request: Request, who: Principal = Depends(tinker_principal)) -> dict:
    door = _door(request)
    return door.info(door.model(who.tenant_id, body.model_id))


@router.post("/forward_backward")
async def forward_backward(request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    """The body is a ForwardBackwardRequest protobuf (`forward_only` for TrainingClient.forward); its datums are
    decoded by the door, so one that cannot be is refused in the request's turn."""
    raw = await request.body()
    try:
        msg = await asyncio.to_thread(
            lambda: codec.read_forward_backward(codec.decompress(raw, request.headers.get("content-encoding")))
        )
    except codec.CodecError as exc:
        raise APIError(400, "invalid_body", str(exc)) from exc
    return _future(await _door(request).forward_backward(who.tenant_id, msg), model_id=msg.model_id)


type JsonObject = Annotated[dict[str, Any], Body()]


def _validated[B: JsonRequest](raw: dict[str, Any], schema: type[B]) -> B:
    """`raw` as `schema`, or the RequestValidationError FastAPI raises for a body that does not validate."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()], body=raw) from exc


async def _training_request[B: JsonRequest](
    request: Request, who: Principal, raw: dict[str, Any], schema: type[B], run: Callable[[str, B], Awaitable[Future]]
) -> dict[str, Any]:
    """A training model's JSON request, validated here rather than before the route: one that does not validate
    but names its model and seq_id is refused through its future, in its turn (refused at the POST, its seq_id
    never reached the model, whose later requests then waited for it)."""
    model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
    try:
        body = _validated(raw, schema)
    except RequestValidationError as invalid:
        if not isinstance(model_id, str) or type(seq_id) is not int:
            raise
        message, errors = validation_summary(invalid)
        refusal = APIError(400, "validation_error", message, errors=errors)
        return _future(await _door(request).refuse(who.tenant_id, model_id, seq_id, schema, refusal), model_id=model_id)
    return _future(await run(who.tenant_id, body), model_id=model_id)


@router.post("/optim_step", openapi_extra=json_body(types.OptimStepRequest))
async def optim_step(raw: JsonObject, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    return await _training_request(request, who, raw, types.OptimStepRequest, _door(request).optim_step)


@router.post("/save_weights", openapi_extra=json_body(types.SaveWeightsRequest))
async def save_weights(raw: JsonObject, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    return await _training_request(request, who, raw, types.SaveWeightsRequest, _door(request).save_state)


@router.post("/load_weights", openapi_extra=json_body(types.LoadWeightsRequest))
async def load_weights(raw: JsonObject, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    """With session_id and model_seq_id: a new model from the state (create_training_client_from_state*); with
    model_id and seq_id: the deprecated load_state into that model."""
    door = _door(request)
    if raw.get("session_id") is None or raw.get("model_seq_id") is None:
        if raw.get("model_id") is None:
            raise APIError(400, "validation_error", "load_weights: give session_id and model_seq_id, or model_id")
        return await _training_request(request, who, raw, types.LoadWeightsRequest, door.load_state)
    body = _validated(raw, types.LoadWeightsRequest)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    return _future(await door.create_from_state(who.tenant_id, body), model_id=model_id)


@router.post("/save_weights_for_sampler", openapi_extra=json_body(types.SaveWeightsForSamplerRequest))
async def save_weights_for_sampler(
    raw: JsonObject, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    door = _door(request)
    return await _training_request(request, who, raw, types.SaveWeightsForSamplerRequest, door.save_for_sampler)


@router.post("/save_weights_external", openapi_extra=json_body(types.SaveWeightsExternalRequest))
async def save_weights_external(
    raw: JsonObject, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    door = _door(request)
    return await _training_request(request, who, raw, types.SaveWeightsExternalRequest, door.save_external)


# ---- sampling ----------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: types.CreateSamplingSessionRequest, request: Request, who: Principal = Depends(tinker_principal)
) -> dict[str, Any]:
    sampler_id = await _door(request).create_sampler(who.tenant_id, body)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    sampler = _door(request).sampler(who.tenant_id, sampler_id)
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
async def asample(body: types.SampleRequest, request: Request, who: Principal = Depends(tinker_principal)) -> dict:
    future = await _door(request).sample(who.tenant_id, body)
    return _future(future, sample_sequence_ids=[f"{future.id}:{i}" for i in range(body.num_samples)])


# ---- futures -----------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(
    body: types.FutureRetrieveRequest, request: Request, who: Principal = Depends(tinker_principal)
) -> Response:
    return await _door(request).retrieve(who.tenant_id, body.request_id)


# ---- training runs and checkpoints (RestClient) ------------------------------------------------------


def _run_view(door: TinkerDoor, tenant_id: str, run_id: str) -> dict[str, Any]:
    record = door.runs.read(tenant_id, run_id)
    live = door.manager.sessions.get(run_id)
    return door.runs.view(tenant_id, record, live.last_active_at if live is not None else None)


@router.get("/training_runs")
def list_training_runs(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    who: Principal = Depends(tinker_principal),
) -> dict[str, Any]:
    door = _door(request)
    records = door.runs.records(who.tenant_id)
    page = records[offset : offset + limit]
    return {
        "training_runs": [_run_view(door, who.tenant_id, r.run_id) for r in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(records)},
    }


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    return _run_view(_door(request), who.tenant_id, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
def list_checkpoints(run_id: str, request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    runs = _door(request).runs
    return {"checkpoints": runs.checkpoints(who.tenant_id, runs.read(who.tenant_id, run_id))}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(
    run_id: str, checkpoint_id: str, request: Request, who: Principal = Depends(tinker_principal)
) -> dict:
    runs = _door(request).runs
    path = TinkerPath.of_checkpoint(run_id, checkpoint_id)
    runs.delete_checkpoint(who.tenant_id, runs.read(who.tenant_id, run_id), path, who.key_id)
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(
    run_id: str,
    checkpoint_id: str,
    request: Request,
    who: Principal = Depends(tinker_principal),
    settings: Settings = Depends(get_settings),
) -> dict[str, Any]:
    path = TinkerPath.of_checkpoint(run_id, checkpoint_id)
    return _door(request).runs.external_urls(who.tenant_id, path, settings.presign_seconds)


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_checkpoint_ttl(
    run_id: str,
    checkpoint_id: str,
    request: Request,
    body: dict[str, int | None] = Body(...),
    who: Principal = Depends(tinker_principal),
) -> dict:
    """Accepted for an existing checkpoint and ignored: inkwell's checkpoints do not expire."""
    ttl = body.get("ttl_seconds")
    if ttl is not None and not TTL_SECONDS[0] <= ttl <= TTL_SECONDS[1]:
        raise APIError(
            400,
            "validation_error",
            f"ttl_seconds: {ttl} is not between {TTL_SECONDS[0]} (1 hour) and {TTL_SECONDS[1]} (10 years)",
            field="ttl_seconds",
        )
    _door(request).runs.require(who.tenant_id, TinkerPath.of_checkpoint(run_id, checkpoint_id))
    return {}


@router.get("/checkpoints")
def list_user_checkpoints(request: Request, who: Principal = Depends(tinker_principal)) -> dict[str, Any]:
    runs = _door(request).runs
    checkpoints = [c for record in runs.records(who.tenant_id) for c in runs.checkpoints(who.tenant_id, record)]
    return {
        "checkpoints": checkpoints,
        "cursor": {"offset": 0, "limit": len(checkpoints), "total_count": len(checkpoints)},
    }


@router.post("/weights_info")
def weights_info(body: dict[str, str], request: Request, who: Principal = Depends(tinker_principal)) -> dict:
    path = TinkerPath.parse(body.get("tinker_path", ""), "tinker_path")
    return _door(request).runs.weights_info(who.tenant_id, path)
