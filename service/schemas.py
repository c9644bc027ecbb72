"""The HTTP API's JSON shapes (pydantic). docs/api.md describes the same contract in prose.

The SDK and the CLI are written against these models, so they change only by adding fields.
"""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from inkwell.adapters.layouts import Layout
from inkwell.adapters.spec import LoraSpec
from inkwell.trainer.config import MAX_INT64, NAME_RULE, GrpoHyperparameters, TrainingHyperparameters
from inkwell.trainer.records import DatasetFormat

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATES: tuple[str, ...] = ("succeeded", "failed", "cancelled")
EventType = Literal["state", "progress", "checkpoint", "eval", "log", "published"]


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


# A string of a request body that is looked up in SQL: PostgreSQL cannot hold a NUL, so one is refused here
# (422) rather than by the driver (a 500), and the same on SQLite.
SqlText = Annotated[str, AfterValidator(_no_nul)]
# An id a request body names: no object has the empty one, and "" must not read as "none given" (a job's dataset
# lookup skipped, its row refused by the database's foreign key: a 500).
SqlId = Annotated[SqlText, Field(min_length=1)]


class Schema(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorBody(Schema):
    code: str = Field(description="machine-readable, e.g. 'not_found', 'invalid_dataset', 'storage_unavailable'")
    message: str = Field(description="what is wrong and how to fix it")
    details: dict[str, Any] = Field(default_factory=dict, description="always has 'retryable' (bool)")


class ErrorResponse(Schema):
    error: ErrorBody


class Page[T](Schema):
    """One page of a list. Pass `next_cursor` back as `cursor` for the next page; null = last page."""

    data: list[T]
    next_cursor: str | None = None


# ---- models -----------------------------------------------------------------------------------


class BaseModelInfo(Schema):
    """A registered base model, in the OpenAI `/v1/models` shape plus inkwell fields."""

    id: str = Field(description="the base model's name, e.g. 'inkling-tiny'")
    object: Literal["model"] = "model"
    created: int = Field(description="unix seconds")
    owned_by: str = "inkwell"
    config_sha256: str
    hidden_size: int
    num_hidden_layers: int
    n_routed_experts: int
    vocab_size: int


class ModelList(Schema):
    object: Literal["list"] = "list"
    data: list[BaseModelInfo]


# ---- datasets ---------------------------------------------------------------------------------


class Dataset(Schema):
    id: str = Field(description="'ds_' + 24 hex")
    name: str
    format: DatasetFormat
    num_examples: int
    size_bytes: int
    sha256: str
    created_at: datetime


# ---- jobs -------------------------------------------------------------------------------------


class Hyperparameters(TrainingHyperparameters):
    """A job body's `hyperparameters`: the trainer's own knobs, defaults and bounds, plus one rule of the service."""

    @field_validator("checkpoint_every")
    @classmethod
    def _resumable(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1: a job whose worker is lost resumes from its last checkpoint")
        return value


Method = Literal["sft", "grpo"]
# A job body's `hyperparameters`, by its method.
HYPERPARAMETERS: dict[str, type[Hyperparameters | GrpoHyperparameters]] = {
    "sft": Hyperparameters,
    "grpo": GrpoHyperparameters,
}


class JobCreate(Schema):
    model_config = ConfigDict(extra="forbid")

    base_model: SqlText = Field(description="a name from GET /v1/models")
    dataset_id: SqlId
    eval_dataset_id: SqlId | None = None
    adapter_name: str = Field(description=f"registry name of the adapter this job publishes; {NAME_RULE}")
    method: Method = Field("sft", description="sft: supervised on completions; grpo: RL scored by a verifier")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    hyperparameters: Hyperparameters | GrpoHyperparameters = Field(
        default_factory=Hyperparameters, description="the knobs of the job's method (SFT's or GRPO's)"
    )

    @field_validator("hyperparameters", mode="wrap")
    @classmethod
    def _of_method(
        cls, value: object, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Hyperparameters | GrpoHyperparameters:
        """Validated as the method's model only: errors name that model's fields, not a union's."""
        model = HYPERPARAMETERS[info.data.get("method", "sft")]
        return value if isinstance(value, model) else model.model_validate(value)


class JobErrorInfo(Schema):
    code: str
    message: str


class JobProgress(Schema):
    step: int = 0
    max_steps: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    reward: float | None = Field(None, description="grpo: the last step's mean reward")


class Job(Schema):
    id: str = Field(description="'job_' + 24 hex")
    state: JobState
    base_model: str
    dataset_id: str
    eval_dataset_id: str | None
    adapter_name: str
    adapter_version: int | None = Field(description="set once the job published its version")
    method: str
    lora: dict[str, Any]
    hyperparameters: dict[str, Any]
    progress: JobProgress
    error: JobErrorInfo | None
    cancel_requested: bool
    attempts: int = Field(description="how many times a worker claimed the job")
    last_checkpoint_step: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobEvent(Schema):
    id: int = Field(description="increasing; pass as `after` (or SSE Last-Event-ID) to resume")
    job_id: str
    type: EventType
    state: JobState | None = None
    message: str
    data: dict[str, Any]
    created_at: datetime


# ---- adapters ---------------------------------------------------------------------------------


class AdapterFile(Schema):
    layout: Layout
    path: str = Field(description="file name inside the layout directory, e.g. 'adapter_model.safetensors'")
    size: int
    sha256: str


class Lineage(Schema):
    source: Literal["job", "import", "session"]
    job_id: str | None = None
    dataset_id: str | None = None
    base_model: str
    base_config_sha256: str


class AdapterVersion(Schema):
    name: str
    version: int
    base_model: str
    lora: dict[str, Any]
    files: list[AdapterFile]
    size_bytes: int
    metrics: dict[str, Any]
    lineage: Lineage
    aliases: list[str] = Field(description="aliases that point at this version now")
    created_at: datetime
    deleted: bool
    deleted_at: datetime | None


class Adapter(Schema):
    name: str
    base_model: str
    latest_version: int | None = Field(description="highest version not deleted")
    num_versions: int = Field(description="versions not deleted")
    aliases: dict[str, int]
    created_at: datetime
    updated_at: datetime


class AliasSet(Schema):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=MAX_INT64)


class Alias(Schema):
    name: str
    alias: str
    version: int
    updated_at: datetime


class DownloadFile(AdapterFile):
    url: str = Field(description="presigned S3 GET, valid `expires_in` seconds")
    download_path: str = Field(description="path on this API that streams the file (sha256 checked)")


class Download(Schema):
    name: str
    version: int
    layout: Layout
    expires_in: int
    files: list[DownloadFile]


class AuditEntry(Schema):
    id: int
    action: str
    target: str
    actor: str | None
    data: dict[str, Any]
    created_at: datetime


# ---- serving fleet ----------------------------------------------------------------------------


class ResidentAdapter(Schema):
    name: str
    version: int


class WorkerStatus(Schema):
    name: str = Field(description="'<base>-<index>', one worker per device")
    base_model: str
    device: str
    engine: str
    alive: bool
    inflight: int = Field(description="requests submitted to the worker and not finished (its queue depth)")
    max_inflight: int = Field(description="beyond this on every worker of the base, requests get 429")
    requests: int = Field(description="requests sent to the worker since it started, every tenant's")
    tokens: int = Field(description="tokens the worker generated since it started, every tenant's")
    tokens_per_s: float = Field(description="tokens generated per second over the last 10 s")
    adapters: list[ResidentAdapter] = Field(description="the caller's adapter versions loaded on the worker")


class FleetStatus(Schema):
    data: list[WorkerStatus]
    starting: list[str] = Field(description="base models whose workers are starting")


# ---- health -----------------------------------------------------------------------------------


class Health(Schema):
    status: Literal["ok", "degraded"]
    database: Literal["ok", "unavailable"]
    storage: Literal["ok", "unavailable"]
    job_workers: int | None = Field(description="job workers alive (heartbeat within the lease); null: database down")
    version: str
