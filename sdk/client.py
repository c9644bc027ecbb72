"""`Client` and `AsyncClient`: configuration, the four resources and `train()`, over one transport each."""

import contextlib
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from inkwell.adapters.spec import LoraSpec
from inkwell.sdk.calls import Op
from inkwell.sdk.errors import ConfigurationError, InkwellError
from inkwell.sdk.jobs import AsyncJob, Job
from inkwell.sdk.resources import DATASET_ID, Adapters, Datasets, DatasetSource, Jobs, Models, job_body
from inkwell.sdk.sessions import LEFT_OPEN_CLOSE_SECONDS, SamplingClient, Sessions, TrainingSession
from inkwell.sdk.transport import AsyncTransport, SyncTransport
from inkwell.service.schemas import Job as JobInfo

URL_ENV = "INKWELL_URL"
API_KEY_ENV = "INKWELL_API_KEY"


def resolve_config(url: str | None, api_key: str | None) -> tuple[str, str]:
    """The service URL and API key from the arguments, else from INKWELL_URL / INKWELL_API_KEY."""
    url = url or os.environ.get(URL_ENV)
    api_key = api_key or os.environ.get(API_KEY_ENV)
    missing = [f"the service URL (url=... / --url, or {URL_ENV})"] if not url else []
    if not api_key:
        missing.append(f"an API key (api_key=... / --api-key, or {API_KEY_ENV})")
    if missing:
        raise ConfigurationError(
            f"inkwell client needs {' and '.join(missing)}; `inkwell serve` prints both", code="configuration_error"
        )
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"service URL {url!r} must start with http:// or https://", code="configuration_error")
    return url, api_key


def default_adapter_name(base_model: str, method: str) -> str:
    return f"{base_model}-{method}-{datetime.now(UTC):%Y%m%d-%H%M%S}"[:64]


class _ClientBase:
    _job_class: type[Job] | type[AsyncJob]
    _transport_class: type[SyncTransport] | type[AsyncTransport]
    _is_async: bool

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 3,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport`: an httpx transport of the client's kind (sync or async), e.g. for tests."""
        url, api_key = resolve_config(url, api_key)
        self._transport = self._transport_class(
            url, api_key, timeout=timeout, max_retries=max_retries, transport=transport
        )
        self.datasets = Datasets(self)
        self.jobs = Jobs(self)
        self.adapters = Adapters(self)
        self.models = Models(self)
        self.sessions = Sessions(self)
        self._open_sessions: set[TrainingSession] = set()  # opened here and not closed: closed with the client

    def sampling_client(self, model: str) -> SamplingClient:
        """Sample from `model`: a base model or '<base>:<adapter>[@<version>|@<alias>]'."""
        return SamplingClient(self, model)

    @property
    def url(self) -> str:
        return self._transport.policy.url

    def _job(self, info: JobInfo) -> Job | AsyncJob:
        return self._job_class(self, info)

    def _train_op(
        self,
        base_model: str,
        dataset: DatasetSource,
        lora: LoraSpec | Mapping[str, Any] | None,
        method: str,
        adapter_name: str | None,
        eval_dataset: DatasetSource | None,
        hparams: Mapping[str, Any],
    ) -> Op[Job | AsyncJob]:
        """Check the job (and, before an upload, its base model), upload what needs uploading, then create the
        job: a job refused for a typo leaves no upload behind."""
        body = job_body(base_model, adapter_name or default_adapter_name(base_model, method), lora, method, hparams)
        sources = (dataset, eval_dataset)
        uploads = [None if s is None or _is_dataset_id(s) else self.datasets.upload_op(s) for s in sources]
        if any(uploads):
            yield self.models.get_call(base_model)
        ids = []
        for source, upload in zip(sources, uploads, strict=True):
            ids.append(source if upload is None else (yield from upload).id)
        return (yield from self.jobs.create_op(body, *ids))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def _is_dataset_id(dataset: DatasetSource) -> bool:
    """A 'ds_...' id of an uploaded dataset (a file of that name wins: it is uploaded)."""
    return isinstance(dataset, str) and DATASET_ID.match(dataset) is not None and not Path(dataset).exists()


class Client(_ClientBase):
    """Synchronous client. `url` / `api_key` default to INKWELL_URL / INKWELL_API_KEY.

    Transient failures (connection refused, 429, 503 with `retryable`) are retried with
    exponential backoff, at most `max_retries` times; nothing else is resent.
    """

    _job_class = Job
    _transport_class = SyncTransport
    _is_async = False

    def train(
        self,
        base_model: str,
        dataset: DatasetSource,
        *,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        method: str = "sft",
        adapter_name: str | None = None,
        eval_dataset: DatasetSource | None = None,
        wait: bool = True,
        timeout: float | None = None,
        progress: bool = True,
        **hyperparameters: Any,
    ) -> Job:
        """Train a LoRA adapter: `dataset` is a JSONL path, a list of example dicts or a 'ds_...' id.
        With `wait` it returns once the adapter is published (`job.adapter`), else right away."""
        op = self._train_op(base_model, dataset, lora, method, adapter_name, eval_dataset, hyperparameters)
        job = self._transport.run(op)
        return job.wait(timeout=timeout, progress=progress) if wait else job

    def close(self) -> None:
        """Close the sessions this client opened and left open (their heartbeats stop here), then the connection."""
        for session in list(self._open_sessions):
            with contextlib.suppress(InkwellError):  # already closed, or the service is gone
                session.close(timeout=LEFT_OPEN_CLOSE_SECONDS)
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """The asyncio twin of `Client`: the same methods, awaited (iterators are async iterators)."""

    _job_class = AsyncJob
    _transport_class = AsyncTransport
    _is_async = True

    async def train(
        self,
        base_model: str,
        dataset: DatasetSource,
        *,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        method: str = "sft",
        adapter_name: str | None = None,
        eval_dataset: DatasetSource | None = None,
        wait: bool = True,
        timeout: float | None = None,
        progress: bool = True,
        **hyperparameters: Any,
    ) -> AsyncJob:
        op = self._train_op(base_model, dataset, lora, method, adapter_name, eval_dataset, hyperparameters)
        job = await self._transport.run(op)
        return await job.wait(timeout=timeout, progress=progress) if wait else job

    async def aclose(self) -> None:
        """Close the sessions this client opened and left open (their heartbeats stop here), then the connection."""
        for session in list(self._open_sessions):
            with contextlib.suppress(InkwellError):  # already closed, or the service is gone
                await session.close(timeout=LEFT_OPEN_CLOSE_SECONDS)
        await self._transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
