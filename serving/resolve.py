"""From a request's `model` string to a base-model directory and an adapter version to load.

`model` is "<base>" (no adapter) or "<base>:<adapter>[@<version>|@<alias>]" (no ref: the latest
version). A `ModelResolver` looks both up for the caller's tenant (the service's registry is one,
`inkwell.service.model_resolver`): another tenant's adapter is not found, exactly like a missing one,
so names never leak. An adapter is served only on the base it was trained on.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from inkwell.serving.router import AdapterRef

SERVING_LAYOUT = "sglang"  # the layout workers load (the registry keeps every layout of a version)


class ModelNotFoundError(LookupError):
    """No such base model, or no such adapter/version/alias for this tenant (HTTP 404)."""


class ModelMismatchError(ValueError):
    """The adapter exists but was trained on another base model (HTTP 400)."""


@dataclass(frozen=True)
class ModelName:
    base: str
    adapter: str | None = None
    ref: str | None = None

    @classmethod
    def parse(cls, model: str) -> "ModelName":
        base, sep, rest = model.partition(":")
        if not base or (sep and not rest):
            raise ModelNotFoundError(f"model {model!r} is not '<base>' or '<base>:<adapter>[@<version>|@<alias>]'")
        if not sep:
            return cls(base)
        adapter, at, ref = rest.partition("@")
        if not adapter or (at and not ref):
            raise ModelNotFoundError(f"model {model!r}: the adapter name or the reference after '@' is empty")
        return cls(base, adapter, ref or None)


@dataclass(frozen=True)
class ResolvedModel:
    base: str
    model_dir: Path
    adapter: AdapterRef | None


class ModelResolver(Protocol):
    def base_dir(self, base: str) -> Path: ...

    def resolve(self, tenant_id: str, name: ModelName) -> ResolvedModel: ...
