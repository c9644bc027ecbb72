"""What a serving worker needs from an engine: the native engine implements it, and so can others
(an SGLang-backed engine, say) that a worker loads by name through `ENGINES`."""

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.models.base import BaseModelIdentity
from inkwell.service.engine.engine import EngineConfig, Request, StepOutput

# engine kind -> "module:Class"; the class takes (model_dir, EngineConfig)
ENGINES: dict[str, str] = {
    "native": "inkwell.service.engine.engine:Engine",
    "sglang": "inkwell.service.engine.sglang_engine:SglangEngine",  # extra inkwell[sglang], CUDA only
}


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


def make_engine(kind: str, model_dir: str | Path, config: EngineConfig) -> ServingEngine:
    """Instantiate the engine registered as `kind` (ValueError naming the known kinds otherwise)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known engines: {', '.join(sorted(ENGINES))}")
    module, _, name = ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), name)(model_dir, config)
