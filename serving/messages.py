"""The messages between a serving worker, its loader and its handle in the service, one frozen dataclass each.

Three queues carry them: the handle's orders to the worker (`ToWorker`, which the loader's answers share), the
worker's orders to its loader (`ToLoader`), and the worker's reports to the handle (`ToHandle`). Each side
dispatches with `match` on the message's class, so a reader can follow every message from its `put` to its case.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from inkwell.serving.contract import PrefixCacheStats, SamplingParams, StepOutput

if TYPE_CHECKING:  # sources import boto3 and transfer imports torch only where they are used
    import torch

    from inkwell.serving.sources import AdapterSource
    from inkwell.serving.transfer import StagedAdapter


@dataclass(frozen=True)
class Failure:
    """Why an order failed: a machine-readable code and a message a person can act on."""

    code: str
    message: str


# ---- handle -> worker ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Load:
    """Load `source` as adapter `key` (the worker forwards it to its loader when `key` is not loaded yet)."""

    key: str
    source: "AdapterSource"
    pinned: bool = False


@dataclass(frozen=True)
class Unload:
    key: str


@dataclass(frozen=True)
class Stop:
    """Stop the process (a worker stops its loader first)."""


# ---- loader -> worker --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Staged:
    """Adapter `key` is staged in a ring row, ready to register."""

    key: str
    staged: "StagedAdapter"
    pinned: bool


@dataclass(frozen=True)
class StageFailed:
    key: str
    failure: Failure


# ---- worker -> loader --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """The worker copied ring row `row` out; `copied` is its CUDA event for the row (sent the first time)."""

    row: int
    copied: "torch.cuda.Event | None"


# ---- worker -> handle --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker reports once its engine is up."""

    base_name: str
    config_sha256: str
    max_context: int
    vocab_size: int


@dataclass(frozen=True)
class Ready:
    info: WorkerInfo


@dataclass(frozen=True)
class StartFailed:
    reason: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[StepOutput]


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    code: str
    message: str
    param: str | None


@dataclass(frozen=True)
class Loaded:
    key: str
    failure: Failure | None = None


@dataclass(frozen=True)
class Unloaded:
    key: str
    failure: Failure | None = None


@dataclass(frozen=True)
class Evicted:
    keys: list[str]


@dataclass(frozen=True)
class CacheStats:
    """The engine's prefix cache counters, sent when they moved (at most once per `worker.CACHE_STATS_SECONDS`)."""

    stats: PrefixCacheStats


@dataclass(frozen=True)
class Stopped:
    pass


ToWorker = Generate | Abort | Load | Unload | Stop | Staged | StageFailed
ToLoader = Load | Release | Stop
ToHandle = Ready | StartFailed | Outputs | RequestFailed | Loaded | Unloaded | Evicted | CacheStats | Stopped
