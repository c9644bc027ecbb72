"""A job of the service as the trainer's `TrainJobConfig` (an RL job's: `GrpoJobConfig`), built in one place: the
API builds it for a new job (so a job the trainer would refuse gets its 422 at once, not a failure on a worker
later) and the job worker builds it to train the stored job.

The job brings what its owner chose (lora, method, adapter_name, hyperparameters); the service fills in the
paths under the job's work directory and the placement from its settings (`INKWELL_TRAIN_*`).
"""

from pathlib import Path

from pydantic import BaseModel

from inkwell.service.db.models import JobRow
from inkwell.service.schemas import JobCreate
from inkwell.service.settings import Settings
from inkwell.trainer.config import GrpoJobConfig, TrainConfigError, TrainJobConfig, parse_config


def train_config(
    job: JobRow | JobCreate, base_model_dir: Path, work: Path, settings: Settings, resume_from: Path | None = None
) -> TrainJobConfig | GrpoJobConfig:
    """The trainer's config for `job` (a stored row, or a body about to be stored) run in `work`;
    TrainConfigError names the first field the trainer refuses."""
    hyperparameters = job.hyperparameters
    if isinstance(hyperparameters, BaseModel):
        hyperparameters = hyperparameters.model_dump()
    if job.method == "grpo":
        return _grpo_config(job, hyperparameters, base_model_dir, work, settings, resume_from)
    return parse_config(
        {
            **hyperparameters,
            "base_model_dir": base_model_dir,
            "dataset_path": work / "data" / "train.jsonl",
            "eval_dataset_path": work / "data" / "eval.jsonl" if job.eval_dataset_id else None,
            "output_dir": work / "out",
            "resume_from": resume_from,
            "lora": job.lora,
            "method": job.method,
            "adapter_name": job.adapter_name,
            "device": settings.train_device,
            "dtype": settings.train_dtype,
            "nproc": settings.train_nproc,
            "tp": settings.train_tp,
            "ep": settings.train_ep,
        }
    )


def _grpo_config(
    job: JobRow | JobCreate,
    hyperparameters: dict,
    base_model_dir: Path,
    work: Path,
    settings: Settings,
    resume_from: Path | None,
) -> GrpoJobConfig:
    """An RL job runs in one process (its training core and sampling engine side by side): the service's device
    and dtype, no parallel layout, no eval set."""
    if job.eval_dataset_id:
        raise TrainConfigError(
            "eval_dataset_id: a grpo job has no eval set; its reward per step is in its events",
            field="eval_dataset_id",
            reason="a grpo job has no eval set; its reward per step is in its events",
        )
    return parse_config(
        {
            **hyperparameters,
            "base_model_dir": base_model_dir,
            "dataset_path": work / "data" / "train.jsonl",
            "output_dir": work / "out",
            "resume_from": resume_from,
            "lora": job.lora,
            "adapter_name": job.adapter_name,
            "device": settings.train_device,
            "dtype": settings.train_dtype,
        },
        GrpoJobConfig,
    )
