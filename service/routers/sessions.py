"""Training sessions (`/v1/sessions`, each with its history of metrics),
sampling (`/v1/sample`, `/v1/compute_logprobs`) and futures (`/v1/futures`).

Every training or sampling request is checked at once (bad input is a 4xx naming the field and the datum index,
and nothing is queued) and answers 202 with a future id; `GET /v1/futures/{id}?wait=30` long-polls its result.
A session's requests run in the order they were submitted.

The service mounts this module as an extension after the OpenAI routes: `lifespan(app)` puts the
`SessionManager` on `app.state.sessions` and closes idle sessions in the background.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response

from inkwell import forkserver
from inkwell.service.auth import Principal, current_principal
from inkwell.service.errors import APIError, not_found
from inkwell.service.schemas import ErrorBody
from inkwell.service.sessions import messages, sampling
from inkwell.service.sessions.futures import Future as LiveFuture
from inkwell.service.sessions.manager import LiveSession, SessionManager
from inkwell.service.sessions.schemas import (
    MAX_WAIT_SECONDS,
    ComputeLogprobsRequest,
    ForwardBackwardRequest,
    Future,
    FutureRef,
    LoadRequest,
    OptimStepRequest,
    PendingFuture,
    SampleRequest,
    SamplerSaveRequest,
    SaveRequest,
    Session,
    SessionCreate,
    SessionHistory,
)
from inkwell.service.sessions.settings import SessionSettings
from inkwell.trainer.core import AdamParams
from inkwell.trainer.datums import Datum, DatumError, check_request

router = APIRouter(prefix="/v1", tags=["sessions"])


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    settings = SessionSettings()
    if settings.device == "cpu":
        forkserver.warm()  # session workers fork from it: its imports overlap the rest of startup
    databases, serving = (state.sessionmaker, state.read_sessionmaker), getattr(state, "serving", None)
    manager = SessionManager(*databases, state.store, state.settings, settings, serving)
    state.sessions = manager
    reaper = asyncio.ensure_future(manager.reap())
    try:
        yield
    finally:
        reaper.cancel()
        await manager.close_all()


def _manager(request: Request) -> SessionManager:
    return request.app.state.sessions


def _view(manager: SessionManager, live: LiveSession) -> Session:
    return Session(
        id=live.id,
        state=live.state,
        base_model=live.base_model,
        lora=live.lora,
        seed=live.seed,
        adapter_name=live.adapter_name,
        step=live.step,
        pending=manager.pending(live),
        created_at=live.created_at,
        last_active_at=live.last_active_at,
        closed_code=live.closed_code,
        closed_reason=live.closed_reason,
        idle_timeout_seconds=manager.settings.idle_seconds,
    )


def _ref(future: LiveFuture) -> FutureRef:
    return FutureRef(future_id=future.id, kind=future.kind)


# ---- sessions ----------------------------------------------------------------------------------------


@router.post("/sessions", status_code=201, response_model=Session)
async def create_session(
    body: SessionCreate, request: Request, principal: Principal = Depends(current_principal)
) -> Session:
    manager = _manager(request)
    live = await manager.create(
        principal.tenant_id,
        body.base_model,
        body.lora,
        body.seed,
        body.adapter_name,
        body.from_state,
        body.with_optimizer,
    )
    return _view(manager, live)


@router.get("/sessions", response_model=dict[str, list[Session]])
def list_sessions(request: Request, principal: Principal = Depends(current_principal)) -> dict[str, list[Session]]:
    manager = _manager(request)
    return {"data": [_view(manager, live) for live in manager.list(principal.tenant_id)]}


@router.get("/sessions/{session_id}", response_model=Session)
def get_session(session_id: str, request: Request, principal: Principal = Depends(current_principal)) -> Session:
    manager = _manager(request)
    return _view(manager, manager.get(principal.tenant_id, session_id))


@router.get("/sessions/{session_id}/history", response_model=SessionHistory)
def session_history(
    session_id: str, request: Request, principal: Principal = Depends(current_principal)
) -> SessionHistory:
    """The metrics of the session's training requests over its steps, and its requests in flight."""
    manager = _manager(request)
    live = manager.get(principal.tenant_id, session_id)
    pending = [PendingFuture(id=f.id, kind=f.kind, created_at=f.created_at) for f in manager.futures.pending(live.id)]
    return SessionHistory(session_id=live.id, points=list(live.history), pending=pending)


@router.post("/sessions/{session_id}/heartbeat", response_model=Session)
def heartbeat(session_id: str, request: Request, principal: Principal = Depends(current_principal)) -> Session:
    manager = _manager(request)
    return _view(manager, manager.use(principal.tenant_id, session_id))


@router.delete("/sessions/{session_id}", response_model=Session)
async def close_session(
    session_id: str, request: Request, principal: Principal = Depends(current_principal)
) -> Session:
    manager = _manager(request)
    live = manager.get(principal.tenant_id, session_id)
    await manager.close(live, "closed_by_owner", "closed by its owner")
    return _view(manager, live)


# ---- training requests -------------------------------------------------------------------------------


def _datums(live: LiveSession, body: ForwardBackwardRequest) -> list[Datum]:
    datums = [Datum(tokens=d.tokens, loss_fn_inputs=d.loss_fn_inputs, routing=d.routing) for d in body.data]
    try:
        check_request(datums, body.loss_fn, body.loss_fn_config, live.vocab_size, live.max_context, live.routing)
    except DatumError as exc:
        raise APIError(422, "invalid_datum", str(exc), field=exc.field, index=exc.index) from exc
    return datums


def _forward(request: Request, principal: Principal, session_id: str, body: ForwardBackwardRequest, backward: bool):
    manager = _manager(request)
    live = manager.use(principal.tenant_id, session_id)
    datums = _datums(live, body)
    kind = "forward_backward" if backward else "forward"
    op = lambda fid: messages.ForwardBackward(fid, datums, body.loss_fn, dict(body.loss_fn_config), backward)  # noqa: E731
    return _ref(manager.submit(live, kind, op))


@router.post("/sessions/{session_id}/forward_backward", status_code=202, response_model=FutureRef)
def forward_backward(
    session_id: str, body: ForwardBackwardRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    return _forward(request, principal, session_id, body, backward=True)


@router.post("/sessions/{session_id}/forward", status_code=202, response_model=FutureRef)
def forward(
    session_id: str, body: ForwardBackwardRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    return _forward(request, principal, session_id, body, backward=False)


@router.post("/sessions/{session_id}/optim_step", status_code=202, response_model=FutureRef)
def optim_step(
    session_id: str, body: OptimStepRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    manager = _manager(request)
    live = manager.use(principal.tenant_id, session_id)
    return _ref(manager.optim_step(live, AdamParams(**body.adam_params.model_dump())))


@router.post("/sessions/{session_id}/save_state", status_code=202, response_model=FutureRef)
def save_state(
    session_id: str, body: SaveRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    manager = _manager(request)
    return _ref(manager.save_state(manager.use(principal.tenant_id, session_id), body.name))


@router.post("/sessions/{session_id}/load_state", status_code=202, response_model=FutureRef)
def load_state(
    session_id: str, body: LoadRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    manager = _manager(request)
    live = manager.use(principal.tenant_id, session_id)
    return _ref(manager.load_state(live, body.state, body.with_optimizer))


@router.post("/sessions/{session_id}/save_weights_for_sampler", status_code=202, response_model=FutureRef)
def save_weights_for_sampler(
    session_id: str, body: SamplerSaveRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    manager = _manager(request)
    return _ref(manager.save_weights_for_sampler(manager.use(principal.tenant_id, session_id), body.name))


# ---- sampling ----------------------------------------------------------------------------------------


def _tier(request: Request):
    tier = getattr(request.app.state, "serving", None)
    if tier is None:
        raise APIError(503, "serving_unavailable", "this service runs no serving tier", retryable=False)
    return tier


@router.post("/sample", status_code=202, response_model=FutureRef)
async def sample(body: SampleRequest, request: Request, principal: Principal = Depends(current_principal)) -> FutureRef:
    manager = _manager(request)
    return _ref(await sampling.sample(_tier(request), manager.futures, principal.tenant_id, body))


@router.post("/compute_logprobs", status_code=202, response_model=FutureRef)
async def compute_logprobs(
    body: ComputeLogprobsRequest, request: Request, principal: Principal = Depends(current_principal)
) -> FutureRef:
    manager = _manager(request)
    return _ref(await sampling.compute_logprobs(_tier(request), manager.futures, principal.tenant_id, body))


# ---- futures -----------------------------------------------------------------------------------------


@router.get("/futures/{future_id}", response_model=Future, responses={202: {"model": Future}})
async def get_future(
    future_id: str,
    request: Request,
    response: Response,
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_SECONDS, description="seconds to wait for the result"),
    principal: Principal = Depends(current_principal),
) -> Future:
    """The future's state and, once settled, its result or error; 202 while it is still pending."""
    future = _manager(request).futures.get(principal.tenant_id, future_id)
    if future is None:
        raise not_found("future", future_id)
    if not await future.wait(wait):
        response.status_code = 202
    error = future.error
    return Future(
        id=future.id,
        kind=future.kind,
        session_id=future.session_id,
        state=future.state,
        result=future.result,
        error=None
        if error is None
        else ErrorBody(code=error.code, message=error.message, details={"retryable": error.retryable, **error.details}),
        created_at=future.created_at,
    )
