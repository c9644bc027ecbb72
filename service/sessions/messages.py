"""The messages between a training session's worker process and its handle in the service, one frozen dataclass
each. Every request carries the id of the future it settles; the worker answers each with `Done` or `Failed`,
in the order it received them."""

from dataclasses import dataclass, field
from typing import Any

from inkwell.adapters.spec import LoraSpec
from inkwell.trainer.core import AdamParams
from inkwell.trainer.datums import Datum


@dataclass(frozen=True)
class StoreConfig:
    """How the worker reaches the object store (saved states live there)."""

    endpoint: str
    bucket: str
    region: str
    access_key: str | None
    secret_key: str | None


@dataclass(frozen=True)
class SessionConfig:
    """What a session worker builds: the base model, a fresh adapter (or a saved state) and its optimizer."""

    session_id: str
    base_model_dir: str
    lora: LoraSpec
    seed: int
    device: str
    dtype: str
    threads: int
    scratch_dir: str
    store: StoreConfig
    initial_state: str | None = None  # S3 prefix of a saved state to start from
    with_optimizer: bool = True


# ---- handle -> worker ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBackward:
    future_id: str
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    backward: bool = True  # False: `forward`, no gradients


@dataclass(frozen=True)
class OptimStep:
    future_id: str
    adam: AdamParams


@dataclass(frozen=True)
class SaveState:
    """Write adapter, optimizer and step under the S3 prefix."""

    future_id: str
    prefix: str


@dataclass(frozen=True)
class LoadState:
    future_id: str
    prefix: str
    with_optimizer: bool


@dataclass(frozen=True)
class ExportAdapter:
    """Write the current adapter in every layout under `dest` (one folder per layout) for publishing."""

    future_id: str
    dest: str


@dataclass(frozen=True)
class Stop:
    pass


# ---- worker -> handle ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionInfo:
    vocab_size: int
    max_context: int
    step: int


@dataclass(frozen=True)
class Ready:
    info: SessionInfo


@dataclass(frozen=True)
class StartFailed:
    code: str
    message: str


@dataclass(frozen=True)
class Done:
    future_id: str
    result: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    future_id: str
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stopped:
    pass


Operation = ForwardBackward | OptimStep | SaveState | LoadState | ExportAdapter
ToWorker = Operation | Stop
ToHandle = Ready | StartFailed | Done | Failed | Stopped
