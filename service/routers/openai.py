"""OpenAI-compatible generation: POST /v1/completions and /v1/chat/completions; GET /v1/serving/workers, the fleet's
status.

`model` is "<base>" or "<base>:<adapter>[@<version>|@<alias>]", resolved for the caller's tenant
(another tenant's adapter is a 404, like a missing one). Responses stream as server-sent events
when `stream` is true. Errors use OpenAI's shape {"error": {"message", "type", "code", "param"}}
(plus inkwell's `details`, whose `retryable` is true for 429 and 503 only), with a 4xx for anything
the caller can fix (400 `too_many_prompts` for more prompts than the workers ever hold in flight), 429 +
Retry-After when every worker is full right now, and 503 + Retry-After when a worker or an adapter load
failed, or the adapter was unloaded before the request reached its worker (its message names the problem;
storage URLs, keys and tenant ids stay in the server log). A non-streaming request whose client disconnects is
aborted, as a stream is.

The service mounts this module as an extension: `router`, and `lifespan(app)`, which puts the
serving tier on `app.state.serving` (workers start on the first request for a base model).
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from inkwell import forkserver
from inkwell.models import encode_chat, encode_prompt_completion
from inkwell.service.auth import Principal, current_principal
from inkwell.service.metrics import PrefixCacheCollector
from inkwell.service.model_resolver import RegistryResolver, owned_adapter
from inkwell.service.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    OpenAIRequest,
    Usage,
    Wire,
    chat_logprobs,
    completion_logprobs,
    error_body,
    step_logprobs,
)
from inkwell.service.openapi_body import json_body
from inkwell.service.schemas import FleetStatus, ResidentAdapter, WorkerStatus
from inkwell.serving.contract import Choice, EngineError, SamplingParams, StepOutput
from inkwell.serving.handle import AdapterLoadError, RequestStream, WorkerDiedError
from inkwell.serving.resolve import ModelMismatchError, ModelNotFoundError, ResolvedModel
from inkwell.serving.router import QueueFullError
from inkwell.serving.settings import ServingSettings
from inkwell.serving.tier import ServingTier
from inkwell.validation import first_error

router = APIRouter(prefix="/v1", tags=["serving"])
log = logging.getLogger(__name__)

RETRY_AFTER_503 = "5"  # seconds, as the service's other 503s say (a worker restarts, storage comes back)


class OpenAIError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.headers = status, code, message, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.status, self.code, self.message, self.param), status_code=self.status, headers=self.headers
        )


def tenant_id(principal: Principal = Depends(current_principal)) -> str:
    return principal.tenant_id


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = app.state.settings
    keys = (settings.s3_access_key, settings.s3_secret_key)
    # reads only: on SQLite a request never waits for the database's writer
    resolver = RegistryResolver(app.state.read_sessionmaker, app.state.store, settings.s3_region, keys)
    serving = ServingSettings()
    if "cpu" in serving.worker_devices():
        forkserver.warm()  # CPU serving workers fork from it: its imports overlap the rest of startup
    app.state.serving = ServingTier(resolver, serving)
    app.state.metrics.registry.register(PrefixCacheCollector(app.state.serving))
    try:
        yield
    finally:
        await asyncio.to_thread(app.state.serving.close)


# ---- request handling shared by both routes ----------------------------------------------------


async def _parse[T: OpenAIRequest](request: Request, model: type[T]) -> T:
    try:
        data = await request.json()
    except ValueError as exc:
        raise OpenAIError(400, "invalid_json", f"the request body is not valid JSON ({exc})") from exc
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        param, why = first_error(exc)
        raise OpenAIError(400, "invalid_parameter", f"{param}: {why}", param or None) from exc
    unsupported = body.unsupported()
    if unsupported:
        raise OpenAIError(400, "unsupported_parameter", f"{unsupported} is not supported; leave it unset", unsupported)
    return body


async def _resolve(request: Request, tenant: str, model: str) -> tuple[ServingTier, ResolvedModel]:
    tier: ServingTier = request.app.state.serving
    try:
        return tier, await tier.resolve(tenant, model)
    except ModelNotFoundError as exc:
        raise OpenAIError(404, "model_not_found", str(exc), "model") from exc
    except ModelMismatchError as exc:
        raise OpenAIError(400, "model_mismatch", str(exc), "model") from exc


def _refusal(exc: Exception, prompt_param: str = "prompt") -> OpenAIError | None:
    """The OpenAI error for what the serving tier refused or lost (None: not the tier's to answer).

    The one translation of the tier's errors, whether they come before a stream starts or in it."""
    match exc:
        case EngineError(code="adapter_not_loaded"):
            # Another request's load unloaded it (to make room) between its load and this request reaching the
            # worker: nothing is wrong with the request, and the next try loads the adapter again.
            message = "the adapter was unloaded from the serving worker before the request reached it; retry shortly"
            return OpenAIError(503, exc.code, message, "model", headers={"Retry-After": RETRY_AFTER_503})
        case EngineError(param="prompt"):
            return OpenAIError(400, exc.code, str(exc), prompt_param)
        case EngineError():
            return OpenAIError(400, exc.code, str(exc), exc.param)
        case QueueFullError():
            return OpenAIError(429, "server_busy", str(exc), headers={"Retry-After": str(exc.retry_after)})
        case AdapterLoadError(code="adapter_incompatible"):
            return OpenAIError(400, exc.code, str(exc), "model")
        case AdapterLoadError():
            # the loader's text names S3 endpoints, object keys and the tenant: for the log, not the client
            log.warning("adapter load failed (%s): %s", exc.code, exc)
            why = (
                "its files could not be fetched from storage or failed verification"
                if exc.code == "adapter_load_failed"
                else "the serving worker has no room for it right now"
            )
            message = f"the adapter could not be loaded onto a serving worker: {why}; retry shortly"
            return OpenAIError(503, exc.code, message, "model", headers={"Retry-After": RETRY_AFTER_503})
        case WorkerDiedError():
            return OpenAIError(503, "worker_unavailable", str(exc), headers={"Retry-After": RETRY_AFTER_503})
    return None


def _check(
    tier: ServingTier, resolved: ResolvedModel, prompts: list[list[int]], params: SamplingParams, prompt_param: str
) -> SamplingParams:
    """The workers' own checks of every prompt, and that they can ever be in flight together, run before any
    stream starts (a 400 now, not an error event or a 429 that retrying never ends)."""
    try:
        tier.check_fits(len(prompts))
        for prompt in prompts:
            tier.check(resolved, prompt, params)
    except EngineError as exc:
        raise _refusal(exc, prompt_param) from exc
    return params


async def _start(tier: ServingTier, resolved: ResolvedModel, prompts: list[list[int]], params) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            streams.append(await tier.submit(resolved, prompt, params))
    except BaseException as exc:
        for stream in streams:
            stream.cancel()
        error = _refusal(exc) if isinstance(exc, Exception) else None
        if error is None:
            raise
        raise error from exc
    return streams


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: its body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, streams: list[RequestStream], n: int) -> dict[int, Choice]:
    """Every choice's outputs added up, by choice index. A client that disconnects first has its streams
    cancelled (aborted on the worker), so nobody's slots go on decoding for it (499, which nobody reads)."""
    choices: dict[int, Choice] = {}

    async def gather() -> None:
        for p, stream in enumerate(streams):
            async for out in stream:
                choices.setdefault(p * n + out.index, Choice()).extend(out)

    gathering, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((gathering, gone), return_when=asyncio.FIRST_COMPLETED)
        if not gathering.done() and gone.exception() is None:
            raise OpenAIError(499, "client_disconnected", "the client closed the connection before the answer")
        await gathering
    except (EngineError, WorkerDiedError) as exc:
        raise _refusal(exc) from exc
    finally:
        gathering.cancel()
        gone.cancel()
        for stream in streams:
            stream.cancel()
    return choices


def _sse(data: Wire | dict | str) -> str:
    if isinstance(data, Wire):
        data = data.model_dump_json()
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(
    streams: list[RequestStream],
    n: int,
    chunk: Callable[[int, StepOutput], Wire],
    final: Callable[[Usage], Wire] | None,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    """SSE lines: `chunk(index, output)` per output, then `final(usage)` if asked, then [DONE]; aborts on
    disconnect."""
    completion_tokens = 0
    try:
        for p, stream in enumerate(streams):
            async for out in stream:
                yield _sse(chunk(p * n + out.index, out))
                if out.finish_reason is not None:
                    completion_tokens += out.completion_tokens
        if final is not None:
            yield _sse(final(Usage.of(prompt_tokens, completion_tokens)))
    except (EngineError, WorkerDiedError) as exc:
        err = _refusal(exc)
        yield _sse(error_body(err.status, err.code, err.message, err.param))
    finally:
        for stream in streams:
            stream.cancel()
    yield _sse("[DONE]")


def _json(response: Wire) -> JSONResponse:
    return JSONResponse(response.model_dump(mode="json"))


async def _open[T: OpenAIRequest](
    request: Request, tenant: str, model: type[T]
) -> tuple[T, ServingTier, ResolvedModel, PreTrainedTokenizerBase]:
    """A route's start: its body parsed, its model resolved for the tenant, and that base's tokenizer."""
    body = await _parse(request, model)
    tier, resolved = await _resolve(request, tenant, body.model)
    return body, tier, resolved, tier.tokenizer(resolved)


def _answers_errors(
    route: Callable[[Request, str], Awaitable[Response]],
) -> Callable[[Request, str], Awaitable[Response]]:
    """The route, taking its tenant from the API key, answers an OpenAIError raised anywhere in it with its JSON
    error body. (No `functools.wraps`: FastAPI would read the inner signature and ask for `tenant` in the query.)"""

    async def answered(request: Request, tenant: str = Depends(tenant_id)) -> Response:
        try:
            return await route(request, tenant)
        except OpenAIError as exc:
            return exc.response()

    answered.__name__, answered.__doc__ = route.__name__, route.__doc__
    return answered


# ---- routes ----------------------------------------------------------------------------------------


@router.post("/completions", response_model=None, openapi_extra=json_body(CompletionRequest))
@_answers_errors
async def completions(request: Request, tenant: str) -> Response:
    body, tier, resolved, tokenizer = await _open(request, tenant, CompletionRequest)
    given = body.prompts()
    if not given:
        raise OpenAIError(400, "invalid_parameter", "prompt is empty", "prompt")
    prompts = [encode_prompt_completion(tokenizer, p)[0] if isinstance(p, str) else list(p) for p in given]
    params = body.sampling(body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:  # score the prompt too (max_tokens 0: only the prompt)
        params = dataclasses.replace(params, prompt_logprobs=True)
    params = _check(tier, resolved, prompts, params, "prompt")
    texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True) for p in given]
    streams = await _start(tier, resolved, prompts, params)
    rid, created, n = f"cmpl-{secrets.token_hex(12)}", int(time.time()), body.n
    prompt_tokens = sum(len(p) for p in prompts)

    def echoed(index: int, chosen: list[float | None] | None, tops) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text and, with logprobs, its logprobs object (first token: no context, null)."""
        if not body.echo:
            return "", None
        lps = None
        if body.logprobs is not None and chosen is not None:
            lps = completion_logprobs(tokenizer, prompts[index // n], chosen, [None, *tops[1:]], 0)
        return texts[index // n], lps

    def choice(index: int, text: str, lps: CompletionLogprobs | None, generated: str, steps, offset: int, finish):
        """One choice: echoed text and logprobs (if any) followed by the generated ones from character `offset`."""
        if body.logprobs is not None:
            mine = step_logprobs(tokenizer, steps, offset)
            lps = mine if lps is None else lps + mine
        return CompletionChoice(index=index, text=text + generated, logprobs=lps, finish_reason=finish)

    def completion(choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=rid, created=created, model=body.model, choices=choices, usage=usage)

    if body.stream:
        offsets: dict[int, int] = {}

        def chunk(index: int, out: StepOutput) -> Completion:
            text, lps = "", None
            if index not in offsets:
                text, lps = echoed(index, out.prompt_logprobs, out.prompt_top_logprobs)
                offsets[index] = len(text)
            part = choice(index, text, lps, out.text, out.logprobs, offsets[index], out.finish_reason)
            offsets[index] += len(out.text)
            return completion([part])

        final = (lambda usage: completion([], usage)) if body.include_usage else None
        return StreamingResponse(_events(streams, n, chunk, final, prompt_tokens), media_type="text/event-stream")
    choices = await _collect(request, streams, n)
    data = []
    for index in sorted(choices):
        c = choices[index]
        text, lps = echoed(index, c.prompt_logprobs, c.prompt_top_logprobs)
        data.append(choice(index, text, lps, c.text, c.logprobs, len(text), c.finish_reason))
    return _json(completion(data, Usage.of(prompt_tokens, sum(c.completion_tokens for c in choices.values()))))


@router.post("/chat/completions", response_model=None, openapi_extra=json_body(ChatCompletionRequest))
@_answers_errors
async def chat_completions(request: Request, tenant: str) -> Response:
    body, tier, resolved, tokenizer = await _open(request, tenant, ChatCompletionRequest)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)[0]
    top = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "invalid_parameter", "top_logprobs needs logprobs: true", "top_logprobs")
    params = _check(tier, resolved, [prompt], body.sampling(body.limit(), top if body.logprobs else None), "messages")
    streams = await _start(tier, resolved, [prompt], params)
    rid, created, n = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), body.n

    def logprobs(steps):
        return chat_logprobs(tokenizer, steps) if body.logprobs else None

    if body.stream:
        started: set[int] = set()

        def chunk(index: int, out: StepOutput) -> ChatCompletionChunk:
            delta = ChatDelta(content=out.text if out.text or out.finish_reason is None else None)
            if index not in started:
                started.add(index)
                delta = ChatDelta(role="assistant", content=out.text)
            part = ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs(out.logprobs), finish_reason=out.finish_reason
            )
            return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[part])

        def final(usage: Usage) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[], usage=usage)

        events = _events(streams, n, chunk, final if body.include_usage else None, len(prompt))
        return StreamingResponse(events, media_type="text/event-stream")
    choices = await _collect(request, streams, n)
    data = [
        ChatChoice(
            index=index,
            message=ChatMessageOut(content=c.text),
            logprobs=logprobs(c.logprobs),
            finish_reason=c.finish_reason,
        )
        for index, c in sorted(choices.items())
    ]
    usage = Usage.of(len(prompt), sum(c.completion_tokens for c in choices.values()))
    return _json(ChatCompletion(id=rid, created=created, model=body.model, choices=data, usage=usage))


@router.get("/serving/workers", response_model=FleetStatus)
def serving_workers(request: Request, tenant: str = Depends(tenant_id)) -> FleetStatus:
    """The serving workers of every base model, their load and the caller's adapters resident on each. Workers are
    shared by every tenant (their counts are the fleet's); another tenant's adapters are left out."""
    tier: ServingTier = request.app.state.serving
    fleet = tier.fleet()
    workers = [
        WorkerStatus(
            name=handle.config.name,
            base_model=base,
            device=handle.config.engine.device,
            engine=handle.config.engine_kind,
            alive=handle.alive,
            inflight=handle.inflight,
            max_inflight=tier.settings.max_inflight_per_worker,
            requests=handle.stats.requests,
            tokens=handle.stats.tokens,
            tokens_per_s=handle.stats.tokens_per_s(),
            adapters=[
                ResidentAdapter(name=name, version=version)
                for name, version in sorted(filter(None, (owned_adapter(key, tenant) for key in set(handle.adapters))))
            ],
        )
        for base, handles in sorted(fleet.items())
        for handle in handles
    ]
    return FleetStatus(data=workers, starting=sorted(base for base, handles in fleet.items() if not handles))
