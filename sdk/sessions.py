"""Training sessions and sampling as a few primitives, each call returning a future.

    session = client.sessions.create("inkling-tiny", lora={"rank": 8})
    out = session.forward_backward(data, "cross_entropy").result()   # per-datum logprobs, metrics
    session.optim_step(learning_rate=1e-3).result()
    sampler = session.save_weights_for_sampler("step-1").result()   # a published, immutable version
    client.sampling_client(sampler.model).sample(prompt, num_samples=4, max_tokens=16).result()

On a `Client` every call returns an `APIFuture` (`.result(timeout)`); on an `AsyncClient` an `AsyncAPIFuture`
(`await`). A session sends heartbeats in the background while it is open (a `with` block closes it, and so does a
synchronous client's program at its exit), so an idle program does not lose its device; the service closes
sessions that stop sending them.
"""

import asyncio
import atexit
import contextlib
import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
import pydantic

from inkwell.adapters.spec import LoraSpec
from inkwell.sdk.calls import Call, Op, parse_model, segment
from inkwell.sdk.errors import InkwellError, RequestFailedError, ValidationError
from inkwell.sdk.resources import lora_spec, pydantic_error
from inkwell.sdk.transport import SyncTransport
from inkwell.service.sessions.schemas import (
    MAX_WAIT_SECONDS,
    AdamParams,
    DatumIn,
    Future,
    FutureRef,
    SampleRequest,
    Session,
)

if TYPE_CHECKING:
    from inkwell.sdk.client import AsyncClient, Client

type DatumLike = DatumIn | Mapping[str, Any]
POLL_SECONDS = 30.0  # one long-poll of a future
# a session left open is closed by its client's close and its program's exit in one try of at most this long: a
# service that does not answer does not hold the program's end for the client's retries (minutes)
LEFT_OPEN_CLOSE_SECONDS = 5.0


def _non_finite(values: list) -> str | None:
    """Where the first value JSON cannot carry (NaN, infinity) is: 'value nan at position 3', or with K values per
    token '... at position 3, target 1'; None if every value is finite."""
    for i, value in enumerate(values):
        for k, x in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if not math.isfinite(x):
                return f"value {x!r} at position {i}" + ("" if k is None else f", target {k}")
    return None


def _plain(values: Any) -> list:
    """A list of numbers from a list, a tuple, a numpy array or a torch tensor."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def datum(value: DatumLike) -> DatumIn:
    if isinstance(value, DatumIn):
        return value
    try:
        routing = value.get("routing")
        return DatumIn(
            tokens=_plain(value["tokens"]),
            loss_fn_inputs={k: _plain(v) for k, v in dict(value.get("loss_fn_inputs", {})).items()},
            routing=None if routing is None else _plain(routing),
        )
    except (KeyError, TypeError) as exc:
        raise ValidationError(
            f"a datum is a mapping with 'tokens' and 'loss_fn_inputs' ({exc})", code="invalid_datum"
        ) from exc
    except pydantic.ValidationError as exc:
        raise pydantic_error("datum field", exc, DatumIn.model_fields) from exc


def _adam(params: AdamParams | None, overrides: Mapping[str, Any]) -> AdamParams:
    try:
        base = params.model_dump() if params is not None else {}
        return AdamParams.model_validate({**base, **overrides})
    except pydantic.ValidationError as exc:
        raise pydantic_error("adam parameter", exc, AdamParams.model_fields) from exc


def _wait_op(future_id: str, timeout: float | None) -> Op[Any]:
    """Long-poll a future until it settles; its result, or RequestFailedError with the future's error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
        future: Future = yield Call(
            "GET",
            f"/v1/futures/{segment(future_id)}",
            params={"wait": min(left, MAX_WAIT_SECONDS)},
            parse=parse_model(Future),
            timeout=httpx.Timeout(left + 30.0, connect=10.0),
        )
        if future.state == "succeeded":
            return future.result
        if future.state == "failed":
            error = future.error
            raise RequestFailedError(
                f"{future.kind} request {future.id} failed: {error.message}", code=error.code, details=error.details
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{future.kind} request {future.id} is still pending after {timeout}s")


class APIFuture:
    """A submitted request; `.result(timeout)` waits for its value (raises RequestFailedError if it failed)."""

    def __init__(self, client: "Client", ref: FutureRef, shape=lambda value: value) -> None:
        self._client, self.id, self.kind, self._shape = client, ref.future_id, ref.kind, shape

    def result(self, timeout: float | None = None) -> Any:
        return self._shape(self._client._transport.run(_wait_op(self.id, timeout)))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.id}>"


class AsyncAPIFuture(APIFuture):
    """`await future` (or `await future.result(timeout)`) for the value."""

    async def result(self, timeout: float | None = None) -> Any:  # type: ignore[override]
        return self._shape(await self._client._transport.run(_wait_op(self.id, timeout)))

    def __await__(self):
        return self.result().__await__()


class SamplerWeights(pydantic.BaseModel):
    """What `save_weights_for_sampler` returns: `model` names the published version for sampling and the OpenAI
    routes; `sync_seconds` is how long the adapter took to reach the serving workers after publishing."""

    model: str
    adapter_name: str
    version: int
    alias: str | None = None
    step: int
    publish_seconds: float
    sync_seconds: float


class _Primitives:
    """What a training session and a sampling client share: their client, and futures of its kind."""

    def __init__(self, client: "Client | AsyncClient") -> None:
        self._client = client
        self._future_class = AsyncAPIFuture if client._is_async else APIFuture

    def _submit(self, path: str, body: dict[str, Any], shape=lambda value: value) -> Op[APIFuture]:
        ref = yield Call("POST", path, json=body, parse=parse_model(FutureRef))
        return self._future_class(self._client, ref, shape)

    def _run(self, op: Op[Any]) -> Any:
        return self._client._transport.run(op)


class TrainingSession(_Primitives):
    """A LoRA model resident on the service: forward/backward, optimizer steps, saves and sampler weights."""

    def __init__(self, client: "Client | AsyncClient", info: Session) -> None:
        super().__init__(client)
        self.info = info
        self._beat: threading.Thread | asyncio.Task | None = None
        self._stop = threading.Event()

    @property
    def id(self) -> str:
        return self.info.id

    def _path(self, action: str) -> str:
        return f"/v1/sessions/{segment(self.id)}/{action}"

    def forward_backward(
        self,
        data: Iterable[DatumLike],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ):
        """Add the gradients of `loss_fn` summed over `data`; the future's value has per-datum target `logprobs`
        and `metrics`. Gradients accumulate until `optim_step`."""
        return self._run(self._submit(self._path("forward_backward"), self._fb_body(data, loss_fn, loss_fn_config)))

    def forward(
        self,
        data: Iterable[DatumLike],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ):
        """As `forward_backward`, without gradients."""
        return self._run(self._submit(self._path("forward"), self._fb_body(data, loss_fn, loss_fn_config)))

    @staticmethod
    def _fb_body(data: Iterable[DatumLike], loss_fn: str, config: Mapping[str, float] | None) -> dict[str, Any]:
        datums = [datum(d).model_dump() for d in data]
        for index, d in enumerate(datums):  # JSON has no NaN or infinity: name the value here, as the service would
            for name, values in d["loss_fn_inputs"].items():
                bad = _non_finite(values)
                if bad is not None:
                    field = f"loss_fn_inputs.{name}"
                    raise ValidationError(
                        f"data[{index}].{field}: {bad} is not a finite number",
                        code="invalid_datum",
                        details={"field": field, "index": index},
                    )
        return {"data": datums, "loss_fn": loss_fn, "loss_fn_config": dict(config or {})}

    def optim_step(self, params: AdamParams | None = None, **overrides: Any):
        """One AdamW step over the accumulated gradients (learning_rate, beta1, beta2, eps, weight_decay,
        grad_clip_norm; Tinker's defaults); the future's value has `step` and `metrics`."""
        body = {"adam_params": _adam(params, overrides).model_dump()}
        return self._run(self._submit(self._path("optim_step"), body))

    def save_state(self, name: str):
        """Save adapter, optimizer and step; the future's value has `state` ('<session>/<name>') to load later."""
        return self._run(self._submit(self._path("save_state"), {"name": name}))

    def load_state(self, state: str, with_optimizer: bool = True):
        return self._run(self._submit(self._path("load_state"), {"state": state, "with_optimizer": with_optimizer}))

    def save_weights_for_sampler(self, name: str | None = None):
        """Publish the adapter as a new immutable registry version (`name` becomes its alias) and put it on the
        serving workers; the future's value is a `SamplerWeights`."""
        return self._run(
            self._submit(self._path("save_weights_for_sampler"), {"name": name}, SamplerWeights.model_validate)
        )

    def sampling_client(self, weights: SamplerWeights | str) -> "SamplingClient":
        return SamplingClient(self._client, weights.model if isinstance(weights, SamplerWeights) else weights)

    def _get_op(self, call: Call) -> Op["TrainingSession"]:
        self.info = yield call
        return self

    def refresh(self):
        return self._run(self._get_op(Call("GET", f"/v1/sessions/{segment(self.id)}", parse=parse_model(Session))))

    def heartbeat(self):
        return self._run(self._get_op(Call("POST", self._path("heartbeat"), parse=parse_model(Session))))

    def close(self, timeout: float | None = None):
        """End the session and free its device (pending requests fail). With `timeout`, one try of at most that
        many seconds (the service goes on closing it once the request has arrived); without, the client's timeout
        and retries."""
        self._forget()
        return self._run(self._close_op(timeout))

    def _forget(self) -> None:
        """No longer open here: heartbeats stop, neither the client nor the program's exit closes it again."""
        self._stop.set()
        atexit.unregister(self._close_at_exit)
        self._client._open_sessions.discard(self)

    def _close_op(self, timeout: float | None) -> Op["TrainingSession"]:
        bound = {} if timeout is None else {"timeout": httpx.Timeout(timeout), "max_retries": 0}
        return self._get_op(Call("DELETE", f"/v1/sessions/{segment(self.id)}", parse=parse_model(Session), **bound))

    def __enter__(self) -> "TrainingSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "TrainingSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _start_heartbeats(self) -> None:
        interval = max(1.0, self.info.idle_timeout_seconds / 4)
        self._client._open_sessions.add(self)
        atexit.register(self._close_at_exit)
        if self._client._is_async:

            async def beat() -> None:
                while not self._stop.is_set():
                    await asyncio.sleep(interval)
                    try:
                        await self.heartbeat()
                    except InkwellError:
                        return

            self._beat = asyncio.ensure_future(beat())
            return

        def beat_sync() -> None:
            while not self._stop.wait(interval):
                try:
                    self.heartbeat()
                except InkwellError:
                    return

        self._beat = threading.Thread(target=beat_sync, name=f"heartbeat-{self.id}", daemon=True)
        self._beat.start()

    def _close_at_exit(self) -> None:
        """The program ends (or is interrupted) with the session open: close it. Its heartbeats stop there, and the
        session would hold its device until the service's idle timeout. One synchronous request on a connection of
        its own: an AsyncClient's event loop is gone by then (asyncio.run ended without `aclose`)."""
        self._forget()
        policy = self._client._transport.policy
        with contextlib.suppress(InkwellError):  # already closed, or the service is gone: it holds nothing then
            transport = SyncTransport(policy.url, policy.api_key)  # the call bounds its own time and tries
            try:
                transport.run(self._close_op(LEFT_OPEN_CLOSE_SECONDS))
            finally:
                transport.close()

    def __repr__(self) -> str:
        return f"<TrainingSession {self.id} {self.info.state} step={self.info.step}>"


class SamplingClient(_Primitives):
    """Samples from a base model or a published adapter version (`model` as the OpenAI routes take it)."""

    def __init__(self, client: "Client | AsyncClient", model: str) -> None:
        super().__init__(client)
        self.model = model

    def sample(self, prompt_tokens: Iterable[int], num_samples: int = 1, **params: Any):
        """Draw `num_samples` completions (max_tokens, temperature, top_p, top_k, seed, stop, prompt_logprobs,
        topk_prompt_logprobs, topk_logprobs, return_routing, prompt_routing); each sequence has its tokens, their
        logprobs, its finish_reason, (topk_logprobs) the k likeliest tokens at each position and (return_routing)
        its routing trace."""
        try:
            body = SampleRequest(
                model=self.model, prompt_tokens=_plain(prompt_tokens), num_samples=num_samples, **params
            )
        except pydantic.ValidationError as exc:
            raise pydantic_error("sampling parameter", exc, SampleRequest.model_fields) from exc
        return self._run(self._submit("/v1/sample", body.model_dump(exclude_none=True)))

    def compute_logprobs(self, tokens: Iterable[int]):
        """Each token's logprob given the ones before it (None for the first)."""
        body = {"model": self.model, "tokens": _plain(tokens)}
        return self._run(self._submit("/v1/compute_logprobs", body, lambda value: value["logprobs"]))

    def __repr__(self) -> str:
        return f"<SamplingClient {self.model}>"


class Sessions:
    """`client.sessions`: open a training session, or list and find them."""

    def __init__(self, client: "Client | AsyncClient") -> None:
        self._client = client

    def _open_op(self, body: dict[str, Any]) -> Op[TrainingSession]:
        info = yield Call("POST", "/v1/sessions", json=body, parse=parse_model(Session))
        session = TrainingSession(self._client, info)
        session._start_heartbeats()
        return session

    def create(
        self,
        base_model: str,
        *,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        seed: int = 0,
        adapter_name: str | None = None,
    ):
        """A new session with a fresh adapter (`lora`, initialised from `seed`) on `base_model`."""
        body = {"base_model": base_model, "lora": lora_spec(lora).model_dump(mode="json"), "seed": seed}
        if adapter_name is not None:
            body["adapter_name"] = adapter_name
        return self._client._transport.run(self._open_op(body))

    def from_state(self, base_model: str, state: str, *, with_optimizer: bool = True, adapter_name: str | None = None):
        """A new session resuming saved `state` ('<session>/<name>'): its adapter, and its optimizer if asked."""
        body = {"base_model": base_model, "from_state": state, "with_optimizer": with_optimizer}
        if adapter_name is not None:
            body["adapter_name"] = adapter_name
        return self._client._transport.run(self._open_op(body))

    def get(self, session_id: str):
        def op() -> Op[TrainingSession]:
            info = yield Call("GET", f"/v1/sessions/{segment(session_id)}", parse=parse_model(Session))
            return TrainingSession(self._client, info)

        return self._client._transport.run(op())

    def list(self):
        return self._client._transport.run(
            Call(
                "GET",
                "/v1/sessions",
                parse=lambda r: [Session.model_validate(x) for x in r.json()["data"]],
            )
        )
