"""`sample` and `compute_logprobs` as futures, served by the serving tier's workers (the adapter chosen per request,
as on the OpenAI routes): what a sampling client of a training session calls.

The model, the prompt and the sampling parameters are checked before the future exists, so bad input is a 4xx;
what goes wrong while generating (a worker lost, no room for the adapter) fails the future with a code.
"""

import asyncio
import logging
from functools import partial
from typing import Any

import numpy as np

from inkwell.service.errors import APIError
from inkwell.service.sessions.futures import Future, FutureError, FutureStore
from inkwell.service.sessions.schemas import ComputeLogprobsRequest, SampleRequest
from inkwell.serving.contract import Choice, EngineError, SamplingParams
from inkwell.serving.handle import AdapterLoadError, WorkerDiedError
from inkwell.serving.resolve import ModelMismatchError, ModelNotFoundError, ResolvedModel
from inkwell.serving.router import QueueFullError
from inkwell.serving.tier import ServingTier

log = logging.getLogger("inkwell.sessions")


def sample_params(body: SampleRequest) -> SamplingParams:
    stop = body.stop or []
    return SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        n=body.num_samples,
        stop=tuple(s for s in stop if isinstance(s, str)),
        stop_token_ids=tuple(s for s in stop if isinstance(s, int)),
        logprobs=max(body.topk_prompt_logprobs, body.topk_logprobs),  # each side cut to its own k (`_sequences`)
        prompt_logprobs=body.prompt_logprobs or body.topk_prompt_logprobs > 0,
        return_routing=body.return_routing,
        prompt_routing=body.prompt_routing,
    )


def logprob_params() -> SamplingParams:
    """Score a sequence: its prompt's logprobs, nothing generated."""
    return SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=True)


async def _resolve(tier: ServingTier, tenant_id: str, model: str, tokens: list[int], params: SamplingParams):
    try:
        resolved = await tier.resolve(tenant_id, model)
    except ModelNotFoundError as exc:
        raise APIError(404, "model_not_found", str(exc), field="model") from exc
    except ModelMismatchError as exc:
        raise APIError(400, "model_mismatch", str(exc), field="model") from exc
    try:
        params.validate()
        tier.check(resolved, tokens, params)
    except EngineError as exc:
        field = "prompt_tokens" if exc.param == "prompt" else exc.param
        raise APIError(400, exc.code, str(exc), field=field) from exc
    return resolved


def _failure(exc: Exception) -> FutureError:
    match exc:
        case QueueFullError():
            return FutureError("server_busy", str(exc), True)
        case AdapterLoadError():
            log.warning("adapter load failed (%s): %s", exc.code, exc)
            return FutureError(exc.code, "the adapter could not be loaded onto a serving worker; retry shortly", True)
        case WorkerDiedError():
            return FutureError("worker_unavailable", str(exc), True)
        case EngineError():
            return FutureError(exc.code, str(exc), False, {"param": exc.param})
    return FutureError("sampling_error", f"{type(exc).__name__}: {exc}")


async def _generate(
    tier: ServingTier, resolved: ResolvedModel, tokens: list[int], params: SamplingParams
) -> list[Choice]:
    stream = await tier.submit(resolved, tokens, params)
    choices: dict[int, Choice] = {}
    async for out in stream:
        choices.setdefault(out.index, Choice()).extend(out)
    return [choices[i] for i in sorted(choices)]


def _run(futures: FutureStore, future: Future, work, shape) -> None:
    async def run() -> None:
        try:
            choices = await work
        except Exception as exc:  # noqa: BLE001 - the future carries the reason
            futures.fail(future, _failure(exc))
            return
        futures.succeed(future, shape(choices))

    asyncio.ensure_future(run())


def _trace(routing: np.ndarray | None) -> list | None:
    """A routing trace as JSON: per token, per MoE layer, the top_k expert ids."""
    return None if routing is None else routing.tolist()


def _sequences(choices: list[Choice], prompt_k: int, sampled_k: int) -> dict[str, Any]:
    """The choices as the sample's value; the engine computed the top max(prompt_k, sampled_k) tokens at each
    position, and each side keeps its own k."""
    first, prompt_top = choices[0], choices[0].prompt_top_logprobs
    return {
        "sequences": [
            {
                "tokens": c.token_ids,
                "logprobs": [lp.logprob for lp in c.logprobs],
                "finish_reason": c.finish_reason,
                "routing": _trace(c.routing),
                **({"topk_logprobs": [lp.top[:sampled_k] for lp in c.logprobs]} if sampled_k else {}),
            }
            for c in choices
        ],
        "prompt_logprobs": first.prompt_logprobs,
        "topk_prompt_logprobs": None if prompt_top is None else [row[:prompt_k] for row in prompt_top],
        # the first prompt token is scored by no forward, as its logprob is None
        "prompt_routing": None if first.prompt_routing is None else [None, *_trace(first.prompt_routing)],
    }


async def sample(tier: ServingTier, futures: FutureStore, tenant_id: str, body: SampleRequest) -> Future:
    params = sample_params(body)
    resolved = await _resolve(tier, tenant_id, body.model, body.prompt_tokens, params)
    future = futures.create(tenant_id, "sample")
    value = partial(_sequences, prompt_k=body.topk_prompt_logprobs, sampled_k=body.topk_logprobs)
    _run(futures, future, _generate(tier, resolved, body.prompt_tokens, params), value)
    return future


async def compute_logprobs(
    tier: ServingTier, futures: FutureStore, tenant_id: str, body: ComputeLogprobsRequest
) -> Future:
    params = logprob_params()
    resolved = await _resolve(tier, tenant_id, body.model, body.tokens, params)
    future = futures.create(tenant_id, "compute_logprobs")
    _run(
        futures,
        future,
        _generate(tier, resolved, body.tokens, params),
        lambda choices: {"logprobs": choices[0].prompt_logprobs},
    )
    return future
