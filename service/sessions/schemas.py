"""The JSON shapes of training sessions, sampling and futures (`/v1/sessions`, `/v1/sample`, `/v1/futures`).

Datums follow Tinker's convention: position i of `tokens` predicts `loss_fn_inputs["target_tokens"][i]`, and every
input array has one value per token. docs/api.md describes the same contract in prose.
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inkwell.adapters.spec import LoraSpec
from inkwell.service.schemas import ErrorBody, SqlText
from inkwell.serving.limits import MAX_LOGPROBS, SEED_MAX, SEED_MIN
from inkwell.trainer.config import MAX_INT64, NAME_RULE, name_problem

SessionState = Literal["starting", "active", "closed"]
FutureState = Literal["pending", "succeeded", "failed"]
MAX_DATUMS = 4096
MAX_WAIT_SECONDS = 60.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)  # NaN reaches the datum check, which names it


def _name(value: str) -> str:
    problem = name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


class SessionCreate(_Body):
    base_model: SqlText = Field(description="a name from GET /v1/models")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    seed: int = Field(0, ge=0, le=MAX_INT64, description="seeds the adapter's initialisation")
    adapter_name: str | None = Field(
        None, description=f"registry name the sampler weights are published under (default: session-<id>); {NAME_RULE}"
    )
    from_state: SqlText | None = Field(None, description="start from a saved state: '<session id>/<state name>'")
    with_optimizer: bool = Field(True, description="with from_state: restore the optimizer's moments too")

    _check_name = field_validator("adapter_name")(lambda cls, v: v if v is None else _name(v))


class Session(BaseModel):
    id: str
    state: SessionState
    base_model: str
    lora: LoraSpec
    seed: int
    adapter_name: str
    step: int = Field(description="optimizer steps taken")
    pending: int = Field(description="requests submitted and not finished")
    created_at: datetime
    last_active_at: datetime
    closed_code: str | None = None
    closed_reason: str | None = Field(None, description="why the session ended, when it has")
    idle_timeout_seconds: float


class DatumIn(_Body):
    tokens: list[int] = Field(description="the model's input tokens")
    loss_fn_inputs: dict[str, list[float] | list[list[float]]] = Field(
        description="per-token arrays: target_tokens, weights, logprobs (the sampler's), advantages, "
        "sequence_ratio_mask (gspo); cross_entropy's target_tokens and weights may hold K per token ([N][K])"
    )
    routing: list[list[list[int]]] | None = Field(
        None,
        description="the sampler's routing trace to replay, one entry per token: per MoE layer the top_k expert ids "
        "(prompt_routing[1:] + routing of a /v1/sample sequence)",
    )


class ForwardBackwardRequest(_Body):
    data: list[DatumIn] = Field(max_length=MAX_DATUMS)
    loss_fn: str = Field("cross_entropy", description="cross_entropy | importance_sampling | ppo | gspo | cispo | dro")
    loss_fn_config: dict[str, float] = Field(default_factory=dict)


class AdamParams(_Body):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(1e-4, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(0.0, ge=0.0, description="0: no clipping")


class OptimStepRequest(_Body):
    adam_params: AdamParams = Field(default_factory=AdamParams)


class SaveRequest(_Body):
    name: str = Field(description=NAME_RULE)

    _check_name = field_validator("name")(lambda cls, v: _name(v))


class SamplerSaveRequest(_Body):
    name: str | None = Field(None, description=f"an alias for the published version; {NAME_RULE}")

    _check_name = field_validator("name")(lambda cls, v: v if v is None else _name(v))


class LoadRequest(_Body):
    state: SqlText = Field(description="'<session id>/<state name>' of a saved state")
    with_optimizer: bool = True


class SampleRequest(_Body):
    model: SqlText = Field(
        description="'<base>' or '<base>:<adapter>[@<version>|@<alias>]', as save_weights_for_sampler returns"
    )
    prompt_tokens: list[int] = Field(min_length=1)
    num_samples: int = Field(1, ge=1, le=16)
    max_tokens: int = Field(16, ge=0, le=MAX_INT64)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1, description="sample among the k most likely tokens; -1: no cut")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] | list[int] | None = Field(None, description="stop strings, or stop token ids")
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    topk_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS, description="the k likeliest tokens at each sampled position")
    return_routing: bool = Field(False, description="each sequence's routing trace (native engine only)")
    prompt_routing: bool = Field(False, description="the prompt's routing trace (native engine only)")


class ComputeLogprobsRequest(_Body):
    model: SqlText
    tokens: list[int] = Field(min_length=1)


class FutureRef(BaseModel):
    future_id: str
    kind: str


class Future(BaseModel):
    id: str
    kind: str
    session_id: str | None
    state: FutureState
    result: Any = None
    error: ErrorBody | None = None
    created_at: datetime


class SessionPoint(BaseModel):
    """The metrics of one training request of a session, as it finished."""

    kind: Literal["forward_backward", "forward", "optim_step"]
    step: int = Field(description="the session's optimizer steps once the request finished")
    metrics: dict[str, float | None] = Field(description="the request's metrics (`loss:sum`, `grad_norm:mean`, ...)")
    finished_at: datetime


class PendingFuture(BaseModel):
    id: str
    kind: str
    created_at: datetime


class SessionHistory(BaseModel):
    session_id: str
    points: list[SessionPoint] = Field(description="oldest first; the last 2000 training requests")
    pending: list[PendingFuture] = Field(description="the session's requests in flight, in submission order")
