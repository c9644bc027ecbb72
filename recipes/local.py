"""A training session and its sampler in this process: the primitives of `inkwell.recipes.primitives` answered by a
`TrainingCore` and a native `Engine` side by side, so an RL job runs the recipe's own loop (`inkwell.recipes.rl`).

After each step only the adapter moves: `save_weights_for_sampler` hands the core's LoRA tensors to the engine from
memory under a new key and unloads the previous version; the base stays resident on both sides. Calls run when
made, except sampling: `sample` queues a request and the first `result()` steps the engine until every queued
request is done, so a step's prompts are decoded in one batch.
"""

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inkwell.serving.contract import Choice, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.trainer.core import AdamParams, TrainingCore
from inkwell.trainer.datums import Datum


@dataclass(frozen=True)
class Done[T]:
    """A value already computed, read as a future is."""

    value: T

    def result(self, timeout: float | None = None) -> T:
        return self.value


@dataclass(frozen=True)
class LocalWeights:
    """The adapter after optimizer step `step`, loaded in the engine under `key`."""

    key: str
    step: int


class LocalSampler:
    """Samples from one adapter version of the engine, with the chosen tokens' logprobs and, when asked, the routing
    traces (the SDK's values, the traces as the engine's integer arrays rather than nested lists)."""

    def __init__(self, engine: Engine, key: str) -> None:
        self._engine, self._key = engine, key
        self._ids = itertools.count()
        self._choices: dict[str, dict[int, Choice]] = {}

    def sample(self, prompt_tokens: Iterable[int], num_samples: int = 1, **params: Any) -> "_Sampled":
        request_id = f"{self._key}-{next(self._ids)}"
        sampling = SamplingParams(n=num_samples, logprobs=0, **params)
        self._engine.add_request(Request(request_id, list(prompt_tokens), sampling, self._key))
        self._choices[request_id] = {}
        return _Sampled(self, request_id)

    def _settle(self, request_id: str) -> Mapping[str, Any]:
        while self._engine.has_work():
            for out in self._engine.step():
                if out.request_id in self._choices:
                    self._choices[out.request_id].setdefault(out.index, Choice()).extend(out)
        choices = [c for _, c in sorted(self._choices.pop(request_id).items())]
        first = choices[0].prompt_routing  # one prompt, one routing: the first choice's
        return {
            "sequences": [
                {
                    "tokens": c.token_ids,
                    "logprobs": [lp.logprob for lp in c.logprobs],
                    "finish_reason": c.finish_reason,
                    "routing": c.routing,
                }
                for c in choices
            ],
            "prompt_routing": None if first is None else [None, *first],
        }


@dataclass(frozen=True)
class _Sampled:
    sampler: LocalSampler
    request_id: str

    def result(self, timeout: float | None = None) -> Mapping[str, Any]:
        return self.sampler._settle(self.request_id)


def _trace(routing: Any) -> np.ndarray | None:
    """A datum's routing trace as one integer array (`rl.routing_trace` joins the engine's arrays into a list)."""
    return None if routing is None else np.asarray(routing)


class LocalSession:
    """A LoRA model training in this process (`core`) and its sampler (`engine`, the same base model); states are
    saved under `states` as directories."""

    def __init__(self, core: TrainingCore, engine: Engine, states: Path, name: str = "grpo") -> None:
        self.core, self.engine, self.states, self.name = core, engine, states, name
        self._loaded: str | None = None

    def forward_backward(
        self, data: Iterable[Mapping[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config=None
    ) -> Done[Mapping[str, Any]]:
        datums = [Datum(list(d["tokens"]), dict(d["loss_fn_inputs"]), _trace(d.get("routing"))) for d in data]
        out = self.core.forward_backward(datums, loss_fn, loss_fn_config)
        return Done({"logprobs": out.logprobs, "metrics": out.metrics})

    def optim_step(self, params: AdamParams | None = None, **overrides: Any) -> Done[Mapping[str, Any]]:
        adam = dataclasses.replace(params or AdamParams(), **overrides)
        return Done({"metrics": self.core.optim_step(adam), "step": self.core.step})

    def save_state(self, name: str) -> Done[Mapping[str, Any]]:
        return Done({"state": str(self.core.save_state(self.states / name)), "step": self.core.step})

    def load_state(self, state: str, with_optimizer: bool = True) -> Done[Mapping[str, Any]]:
        self.core.load_state(Path(state), with_optimizer)
        return Done({"step": self.core.step})

    def save_weights_for_sampler(self, name: str | None = None) -> Done[LocalWeights]:
        """The adapter as it stands into the engine (a new key per step), the previous version out of it."""
        key = f"{self.name}@{self.core.step}"
        if key != self._loaded:
            self.engine.load_adapter(key, self.core.adapter())
            if self._loaded is not None:
                self.engine.unload_adapter(self._loaded)
            self._loaded = key
        return Done(LocalWeights(key, self.core.step))

    def sampling_client(self, weights: LocalWeights) -> LocalSampler:
        return LocalSampler(self.engine, weights.key)
