"""The megatron-core LoRA trainer for Inkling: `train(TrainJobConfig, TrainCallbacks) -> TrainResult`.

`train` is imported on first use, so reading configs (the service, the CLI) does not load megatron-core.
"""

from inkwell.trainer.config import (
    TrainCallbacks,
    TrainConfigError,
    TrainEvent,
    TrainingCancelled,
    TrainJobConfig,
    TrainResult,
    load_job_config,
    parse_config,
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


def __getattr__(name: str):
    if name == "train":
        from inkwell.trainer.api import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
