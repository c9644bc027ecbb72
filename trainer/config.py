"""The contract between the service's job worker and the trainer: job config, events, result.

A job's training knobs are defined once, in `TrainingHyperparameters`: `TrainJobConfig` (what the trainer and
`inkwell train --config` read) extends it with paths, LoRA and placement, and the HTTP API's job body takes it as
`hyperparameters` (`inkwell.service.schemas.Hyperparameters`), so both get the same defaults and bounds.
"""

import json
import re
from pathlib import Path
from typing import Annotated, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from inkwell.adapters.spec import LoraSpec
from inkwell.trainer.records import SFT_FORMATS, DatasetFormat
from inkwell.trainer.verifiers import VERIFIERS, verifier
from inkwell.validation import first_error

# Adapter, alias and dataset names: a path segment that is safe in S3 keys, URLs and file names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "1-64 characters from letters, digits, '.', '_' and '-', starting with a letter or digit, no '..'"
LR_SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
# The largest integer any count or seed of a job may be: a signed 64-bit value, what a SQL BIGINT, a JSON
# parser in another language and torch's generators all hold.
MAX_INT64 = 2**63 - 1
# torch.manual_seed takes up to 2**64 - 1, and the trainer seeds with offsets (seed + epoch, megatron's
# seed + 2718 + rank, ...): seeds up to 2**63 - 1 leave that headroom.
MAX_SEED = MAX_INT64


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, alias or dataset, or None when it can."""
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it contains control characters"
    if "/" in name or "\\" in name:
        return "it contains a path separator"
    if ".." in name:
        return "it contains '..'"
    if not NAME_PATTERN.match(name):
        return f"it must be {NAME_RULE}"
    return None


class TrainConfigError(ValueError):
    """Bad input found before training starts; `field` names the config field, `line` the dataset line.

    `reason` is what is wrong without the field's name in front (the API reports the two apart); it defaults
    to the whole message.
    """

    def __init__(self, message: str, field: str | None = None, line: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.field = field
        self.line = line
        self.reason = reason or message


class TrainingCancelled(RuntimeError):
    """`TrainCallbacks.should_stop()` asked to stop; raised at the next step boundary."""

    def __init__(self, step: int):
        super().__init__(f"training cancelled at step {step}")
        self.step = step


class TrainingHyperparameters(BaseModel):
    """A job's training knobs, with the one set of defaults (sized for inkling-tiny on a CPU) and bounds.

    The API's job body takes them as `hyperparameters`; a `TrainJobConfig` (a config file) at its top level.
    """

    # No NaN or infinity: they pass `ge=0` bounds, train nothing useful and PostgreSQL's JSON refuses them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    max_steps: int = Field(20, ge=1, le=1_000_000)
    batch_size: int = Field(4, ge=1, le=4096, description="packed sequences per optimizer step (global)")
    seq_len: int = Field(256, ge=8, le=131072, description="packing length in tokens")
    grad_accum: int = Field(1, ge=1, le=1024)
    warmup_steps: int = Field(0, ge=0, le=MAX_INT64)
    # A string here and checked by TrainJobConfig: an unknown schedule is a job the trainer refuses (the API's
    # 422 invalid_job), not a malformed request body.
    lr_schedule: str = Field("cosine", description=f"one of {', '.join(LR_SCHEDULES)}")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds the adapter's init, the data order and the eval split")
    checkpoint_every: int = Field(10, ge=0, le=MAX_INT64, description="steps between checkpoints; 0 = never")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="held out from the dataset when no eval set")
    eval_every: int = Field(0, ge=0, le=MAX_INT64, description="steps between eval passes; 0 = only at start and end")


def layers_compile(device: str, dtype: str) -> bool:
    """Whether decoder layers can be compiled: on CUDA in bf16 only (torch's grouped GEMM, the experts, has no
    compiled fp32 form)."""
    return device.startswith("cuda") and dtype == "bfloat16"


def one_process_compile_mode(device: str, dtype: str) -> str | None:
    """The layers' compile mode of a core alone in its process taking datums of any shape (a session worker): CUDA
    graphs, one per power-of-two row width (trainer/core.py), where layers compile at all."""
    return "reduce-overhead" if layers_compile(device, dtype) else None


def _a_directory(path: Path) -> Path:
    """An output directory is made if missing; a file on its path is refused here, not after training has run."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{existing} is a file; give a directory (made if missing)")
    return path


OutputDir = Annotated[Path, AfterValidator(_a_directory)]


class TrainJobConfig(TrainingHyperparameters):
    """One SFT job: the training knobs plus data and output paths, LoRA, resume point and parallel layout."""

    base_model_dir: Path
    dataset_path: Path = Field(description='JSONL; each line {"messages": [...]} or {"prompt": ..., "completion": ...}')
    eval_dataset_path: Path | None = None
    output_dir: OutputDir
    lora: LoraSpec = Field(default_factory=LoraSpec)
    method: Literal["sft"] = "sft"
    resume_from: Path | None = None
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    sequence_parallel: bool = Field(
        False,
        description="split the residual stream between layers over the TP group along the sequence "
        "(needs tp > 1 and seq_len divisible by tp); same math, less activation memory per rank",
    )
    nproc: int = Field(1, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    compile: Literal["auto", "none", "default", "reduce-overhead"] = Field(
        "auto",
        description="torch.compile mode of every decoder layer on CUDA in bf16 (ignored elsewhere); "
        "reduce-overhead also replays each layer as a CUDA graph; auto = reduce-overhead for one process "
        "without gradient accumulation, default for one process with it, none for several processes",
    )
    adapter_name: str = Field("adapter", description=f"the name in the exported adapter's metadata; {NAME_RULE}")

    @property
    def compile_mode(self) -> str | None:
        """The torch.compile mode the layers get on this device and dtype (None: not compiled)."""
        if not layers_compile(self.device, self.dtype) or self.compile == "none":
            return None
        if self.compile == "auto":  # compiled layers around NCCL collectives are not verified: one process only
            if self.nproc > 1:
                return None
            return "reduce-overhead" if self.grad_accum == 1 else "default"
        return self.compile

    @field_validator("lr_schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        if value not in LR_SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; use one of {', '.join(LR_SCHEDULES)}")
        return value

    @field_validator("adapter_name")
    @classmethod
    def _adapter_name(cls, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise ValueError(f"{value!r} is not allowed: {problem}")
        return value

    @field_validator("sequence_parallel")
    @classmethod
    def _sequence_parallel(cls, value: bool, info: ValidationInfo) -> bool:
        tp, seq_len = info.data.get("tp"), info.data.get("seq_len")
        if value and tp == 1:
            raise ValueError("needs tp > 1: it splits the sequence over the tensor-parallel group")
        if value and tp and seq_len and seq_len % tp:
            raise ValueError(f"needs seq_len ({seq_len}) divisible by tp ({tp})")
        return value

    @model_validator(mode="after")
    def _layout(self):
        if self.compile == "reduce-overhead" and self.grad_accum > 1:
            raise ValueError(
                "compile: 'reduce-overhead' replays CUDA graphs whose gradient outputs a second micro-batch "
                "would overwrite; use grad_accum 1 with it, or compile 'default'"
            )
        if self.compile == "reduce-overhead" and self.nproc > 1:
            raise ValueError(
                "compile: 'reduce-overhead' across several processes is not supported (CUDA-graph layers around "
                "the NCCL collectives did not finish on two GPUs); use compile 'auto' (eager), 'none' or 'default'"
            )
        if self.nproc % (self.tp * self.ep):
            raise ValueError(f"nproc ({self.nproc}) must be a multiple of tp*ep ({self.tp * self.ep})")
        dp = self.nproc // self.tp
        if self.batch_size % (self.grad_accum * dp):
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by grad_accum*data-parallel size "
                f"({self.grad_accum}*{dp}); data-parallel size = nproc / tp"
            )
        return self


class GrpoHyperparameters(BaseModel):
    """An RL job's knobs (method `grpo`): GRPO as `inkwell.recipes.rl` runs it, scored by a built-in verifier named
    here (no user code runs on the server), with the one set of defaults and bounds.

    The API's job body takes them as `hyperparameters` when its method is `grpo`.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_steps: int = Field(20, ge=1, le=1_000_000, description="optimizer steps, one per group of prompts")
    learning_rate: float = Field(1e-2, gt=0, le=1.0)
    prompts_per_step: int = Field(8, ge=1, le=4096, description="problems sampled per step")
    group_size: int = Field(8, ge=2, le=16, description="completions per prompt; advantage = reward - group mean")
    max_tokens: int = Field(8, ge=1, le=131072, description="new tokens per completion")
    temperature: float = Field(1.0, gt=0, le=2.0)
    loss_fn: Literal["importance_sampling", "ppo", "gspo", "cispo"] = "importance_sampling"
    normalize_advantages: bool = Field(False, description="divide by the group's standard deviation as well")
    routing_replay: bool = Field(
        True,
        description="the trainer routes each sampled sequence to the experts the sampler chose (the engine's "
        "routing traces), so a near-tie the two sides round apart does not move the logprobs",
    )
    verifier: str = Field("exact_match", description=f"a built-in verifier: {', '.join(VERIFIERS)}")
    verifier_arg: str | None = Field(
        None,
        description="the answer every completion is compared with (for regex: the pattern), in place of each "
        "dataset line's 'answer'; then the dataset needs prompts only",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds the adapter's init, the prompts and the sampling")
    checkpoint_every: int = Field(10, ge=1, le=MAX_INT64, description="steps between checkpoints (to resume)")

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        verifier(value)  # the one lookup rule, with its error naming the built-in ones
        return value

    @model_validator(mode="after")
    def _pattern(self) -> Self:
        if self.verifier == "regex" and self.verifier_arg is not None:
            try:
                re.compile(self.verifier_arg)
            except re.error as exc:
                raise ValueError(f"verifier_arg: {self.verifier_arg!r} is not a regular expression ({exc})") from exc
        return self


class GrpoJobConfig(GrpoHyperparameters):
    """One RL job: the GRPO knobs plus the problems' path (JSONL of prompts and answers), output, LoRA, resume
    point and device. It runs in one process: the training core and a native engine side by side."""

    base_model_dir: Path
    dataset_path: Path
    output_dir: OutputDir
    lora: LoraSpec = Field(default_factory=LoraSpec)
    method: Literal["grpo"] = "grpo"
    resume_from: Path | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    adapter_name: str = Field("adapter", description=f"the name in the exported adapter's metadata; {NAME_RULE}")


def dataset_problem(method: str, format: DatasetFormat, hyperparameters: BaseModel) -> str | None:
    """Why a dataset of `format` cannot train a job of `method` with these hyperparameters, or None when it can:
    SFT learns from completions; GRPO samples from prompts and, without a `verifier_arg`, scores against each
    line's answer."""
    if method == "sft" and format not in SFT_FORMATS:
        return f"the dataset is {format}; SFT learns from completions: give chat or prompt/completion lines"
    if method == "grpo" and format == "chat":
        return "the dataset is chat; GRPO samples from prompts: give prompt/answer lines"
    if method == "grpo" and format != "prompt_answer" and getattr(hyperparameters, "verifier_arg", None) is None:
        verifier = getattr(hyperparameters, "verifier", "")
        return (
            f"the dataset is {format} and has no answers; verifier {verifier!r} compares each completion with its "
            "line's 'answer': give prompt/answer lines, or hyperparameters.verifier_arg"
        )
    return None


class TrainEvent(BaseModel):
    """Progress after an optimizer step (eval_loss when an eval pass ran at that step)."""

    step: int
    total_steps: int
    loss: float
    lr: float
    tokens_per_s: float
    eval_loss: float | None = None
    elapsed_s: float


class TrainResult(BaseModel):
    """What a finished run produced: adapter directories by layout, losses and timings."""

    adapter_dirs: dict[str, Path]
    steps: int
    tokens: int
    first_loss: float
    final_loss: float
    initial_eval_loss: float | None
    final_eval_loss: float | None
    seconds: float
    metrics: dict = Field(default_factory=dict)


class TrainCallbacks:
    """Hooks the job worker overrides; the defaults do nothing."""

    def on_event(self, event: TrainEvent) -> None:
        """Called on rank 0 after every optimizer step."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """Called after checkpoint `path` (a directory) is complete on disk."""

    def should_stop(self) -> bool:
        """Return True to cancel: training stops at the next step boundary and raises TrainingCancelled."""
        return False


def parse_config[M: BaseModel](data: M | dict, model: type[M] = TrainJobConfig) -> M:
    """A TrainJobConfig (or `model`) from a dict; the first invalid field becomes a TrainConfigError naming it."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        field, why = first_error(exc)
        raise TrainConfigError(f"{field or 'config'}: {why}", field=field or None, reason=why) from exc


def load_job_config(path: str | Path) -> TrainJobConfig:
    """A job config from a .json or .yaml file."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory: give the job file" if path.is_dir() else "does not exist"
        raise TrainConfigError(f"config: {path} {what}", field="config")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        kind = path.suffix[1:].upper()
        raise TrainConfigError(f"config: {path} is not valid {kind} ({exc})", field="config") from exc
    if not isinstance(data, dict):
        raise TrainConfigError(f"config: {path} must hold a mapping of job fields", field="config")
    return parse_config(data)
