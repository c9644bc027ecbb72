"""The inkwell Python SDK.

    from inkwell import sdk
    job = sdk.train(base_model="inkling-tiny", dataset="chat.jsonl", lora={"rank": 8}, max_steps=50)
    job.adapter  # the published AdapterVersion

`sdk.train` uses a client configured from INKWELL_URL / INKWELL_API_KEY; `sdk.Client(url, api_key)`
and `sdk.AsyncClient` give the whole API (datasets, jobs, adapters, models).
"""

from collections.abc import Mapping
from typing import Any

from inkwell.adapters.spec import LoraSpec
from inkwell.sdk.client import AsyncClient, Client
from inkwell.sdk.errors import (
    APIConnectionError,
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    InkwellError,
    IntegrityError,
    JobCancelledError,
    JobFailedError,
    JobTimeoutError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    ValidationError,
)
from inkwell.sdk.events import Page
from inkwell.sdk.jobs import AsyncJob, Job
from inkwell.sdk.resources import DatasetSource, DownloadedAdapter

__all__ = [
    "APIConnectionError",
    "AsyncClient",
    "AsyncJob",
    "AuthenticationError",
    "Client",
    "ConfigurationError",
    "ConflictError",
    "DownloadedAdapter",
    "InkwellError",
    "IntegrityError",
    "Job",
    "JobCancelledError",
    "JobFailedError",
    "JobTimeoutError",
    "LoraSpec",
    "NotFoundError",
    "Page",
    "PayloadTooLargeError",
    "RateLimitError",
    "ServerError",
    "ServiceUnavailableError",
    "ValidationError",
    "train",
]


def train(
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
    client: Client | None = None,
    url: str | None = None,
    api_key: str | None = None,
    **hyperparameters: Any,
) -> Job:
    """Fine-tune a LoRA adapter on `base_model` and (with `wait`) return once it is published.

    `dataset`: a JSONL path, a list of example dicts (uploaded as JSONL) or a 'ds_...' id.
    `lora`: a LoraSpec or its dict. Extra keyword arguments are hyperparameters (learning_rate,
    max_steps, batch_size, seq_len, ...), checked before anything is sent.
    """
    client = client or Client(url, api_key)
    return client.train(
        base_model,
        dataset,
        lora=lora,
        method=method,
        adapter_name=adapter_name,
        eval_dataset=eval_dataset,
        wait=wait,
        timeout=timeout,
        progress=progress,
        **hyperparameters,
    )
