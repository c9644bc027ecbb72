"""The engine contract: what a serving worker asks of an engine, and the types that cross it.

Every engine (the native one in `inkwell.serving.native`, SGLang's in `inkwell.serving.sglang`) takes an
`EngineConfig`, accepts `Request`s and returns `StepOutput`s; a worker picks one by name from `ENGINES`. This
module imports no engine: the names in `ENGINES` are resolved only when a worker starts one.
"""

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import TARGET_GROUPS
from inkwell.models.base import BaseModelIdentity
from inkwell.serving.limits import MAX_LOGPROBS, SEED_MAX, SEED_MIN

# engine kind -> "module:Class" (or a function returning one); it takes (model_dir, EngineConfig)
ENGINES: dict[str, str] = {
    "native": "inkwell.serving.native.group_engine:native_engine",  # one process, or a group (EngineConfig.ranks)
    "sglang": "inkwell.serving.sglang.engine:SglangEngine",  # extra inkwell[sglang], CUDA only
}
# the engine kinds that record routing traces (SamplingParams.return_routing, prompt_routing)
ROUTING_ENGINES = ("native",)


class EngineError(ValueError):
    """A request or an order the engine refuses; `code` is machine-readable, `param` names the offending field."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class SamplingError(EngineError):
    """A sampling parameter outside its legal range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__("invalid_parameter", message, param)


class AdapterIncompatibleError(ValueError):
    """An adapter this engine cannot serve (other base, rank too high, group not enabled)."""


# Below this temperature a request decodes greedily, as SGLang decodes it (its _SAMPLING_EPS): logits divided by a
# smaller one can overflow fp32 (5e-324 is 0 there), making the draw NaN, and its distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and ends. Logprobs are those of the model's distribution (before temperature and
    top_p), as OpenAI reports."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # sample among the k most likely tokens; -1: no cut
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus the top k
    prompt_logprobs: bool = False
    ignore_eos: bool = False
    # routing traces (inkwell.models.routing): of each generated token, and of the prompt's tokens 1..P-1 (one
    # prompt, one routing: the first choice's)
    return_routing: bool = False
    prompt_routing: bool = False

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs or self.prompt_routing else 1):
            raise SamplingError(
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens} (0 is for scoring the prompt alone: ask for "
                "its logprobs or its routing)",
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError("temperature", f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and not 1 <= self.top_k <= 2**31 - 1:
            raise SamplingError("top_k", f"top_k must be -1 (no cut) or at least 1, got {self.top_k}")
        if not 1 <= self.n <= 16:
            raise SamplingError("n", f"n must be between 1 and 16, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise SamplingError("stop", "stop takes at most 4 non-empty strings")
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX
        ):
            raise SamplingError("seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the request decodes by argmax: temperature 0, or one below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` (None: unseeded), so the choices of one seeded request draw apart.

        Reduced modulo 2**63: every 64-bit seed then fits both torch's generator (which overflowed past 2**64 and
        killed the worker) and SGLang's i64 `sampling_seed`; the n <= 16 choices of one seed stay distinct, and a
        non-negative seed whose mix was below 2**63 keeps the draws it had."""
        return None if self.seed is None else (self.seed * 1009 + index) % 2**63


@dataclass(frozen=True)
class EngineConfig:
    max_loras_per_batch: int = 4
    max_lora_rank: int = 64
    max_loaded_adapters: int = 16
    lora_groups: tuple[str, ...] = TARGET_GROUPS
    max_seqs: int = 16
    max_batch_tokens: int = 256
    max_context: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: bool = True  # CUDA only: pure decode steps replay captured graphs
    # CUDA graphs only: steps with prefill chunks replay captured graphs too where their chunks pad to at most this
    # many token places (sequences bucket x longest chunk's power of two); longer ones run eagerly. 0: never. An
    # eager step's host takes 31-64 ms to issue its launches (H200 host, docs/benchmarks.md) and a replayed step of
    # 8,192 places about 30 ms on the GPU, so up to here a graph wins even over the padding; every step of the
    # service's 256-token budget (16 sequences x 256 places at most) replays one.
    graph_prefill_tokens: int = 8192
    # CUDA only: LoRA work beside the base GEMMs on a second stream. Off by default: decode projections take one
    # launch each (lora_linear; narrow ones up to 128 tokens), and where they did not the shrink beside cuBLAS lost to
    # the chained pair on one stream (H100, 128 sequences, 1 adapter: 0.987x decode; docs/benchmarks.md)
    lora_side_stream: bool = False
    # Queue the next decode step before reading this one's tokens on the host (see `native.Engine.step`).
    overlap_decode: bool = True
    # Native engine: reuse computed prompt prefixes per adapter (`native.prefix_cache`), within this many bytes of
    # each device's memory beside its state pool, in blocks of this many tokens.
    prefix_cache: bool = True
    prefix_cache_bytes: int = 2**30
    prefix_cache_block: int = 16
    # A prompt's last whole block is cached only where it lies more than this many tokens past where the prompt
    # leaves the tree: ending a chunk there costs a step (on CUDA a whole step's launches) to save a later prompt
    # that extends this one at most these tokens (a long system prompt's short questions are not worth it).
    prefix_cache_min_gain: int = 64
    # Native engine: one process per device over tensor_parallel * expert_parallel devices, rank r on the device r
    # places after `device` (`native.group_engine`); attention heads split over TP, experts over EP.
    tensor_parallel: int = 1
    expert_parallel: int = 1

    @property
    def ranks(self) -> int:
        """The processes (and devices) one engine spans."""
        return self.tensor_parallel * self.expert_parallel


@dataclass
class PrefixCacheStats:
    """A prefix cache's counters since the engine started: prompts looked up and how many found a cached prefix,
    their tokens and how many of those came from the cache instead of a forward, its bytes now, nodes evicted."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    bytes: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of looked-up prompt tokens that came from the cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # key of an adapter added with `load_adapter`; None = base model


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What one choice of a request produced in one step (deltas), and how it ended if it did."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[float | None] | None = None  # first output only; [0] is None (no context)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # with SamplingParams.logprobs = k
    # routing traces [tokens, MoE layers, top_k] (inkwell.models.routing), compact ints: with return_routing, of
    # `token_ids` (the forwards that scored them); with prompt_routing, the first output of the first choice (index
    # 0) only, of prompt tokens 1..P-1: the other choices start from its prompt state where the prefix cache holds it
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None


@dataclass
class Choice:
    """One choice's outputs added up: all its tokens, text, logprobs and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None

    def extend(self, out: StepOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason or self.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
        if out.routing is not None:
            self.routing = out.routing if self.routing is None else np.concatenate([self.routing, out.routing])
        if out.prompt_routing is not None:
            self.prompt_routing = out.prompt_routing


class ServingEngine(Protocol):
    identity: BaseModelIdentity
    model_config: InklingTextConfig
    max_context: int
    adapters: Mapping[str, Adapter]

    def load_adapter(self, key: str, adapter: Adapter, pinned: bool = False) -> None: ...

    def unload_adapter(self, key: str) -> None: ...

    def add_request(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> list[StepOutput]: ...

    def step(self) -> list[StepOutput]: ...

    def has_work(self) -> bool: ...

    def cache_stats(self) -> PrefixCacheStats | None: ...

    def shutdown(self) -> None: ...


def make_engine(kind: str, model_dir: str | Path, config: EngineConfig) -> ServingEngine:
    """Instantiate the engine registered as `kind` (ValueError naming the known kinds otherwise)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known engines: {', '.join(sorted(ENGINES))}")
    module, _, name = ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), name)(model_dir, config)


def generate(engine: ServingEngine, requests: list[Request]) -> dict[str, list[Choice]]:
    """Add `requests` to `engine`, step until all finish, and gather each request's choices (by index)."""
    for request in requests:
        engine.add_request(request)
    choices: dict[str, dict[int, Choice]] = {r.request_id: {} for r in requests}
    while engine.has_work():
        for out in engine.step():
            if out.request_id in choices:
                choices[out.request_id].setdefault(out.index, Choice()).extend(out)
    return {rid: [c[i] for i in sorted(c)] for rid, c in choices.items()}
