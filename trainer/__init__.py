"""The megatron-core LoRA trainer for Inkling: `train(TrainJobConfig, TrainCallbacks) -> TrainResult`."""

from inkwell.trainer.api import load_job_config, parse_config, train
from inkwell.trainer.config import (
    TrainCallbacks,
    TrainConfigError,
    TrainEvent,
    TrainingCancelled,
    TrainJobConfig,
    TrainResult,
)

__all__ = [
    "TrainCallbacks",
    "TrainConfigError",
    "TrainEvent",
    "TrainJobConfig",
    "TrainResult",
    "TrainingCancelled",
    "load_job_config",
    "parse_config",
    "train",
]
