"""The megatron-core LoRA trainer for Inkling: `train(TrainJobConfig, TrainCallbacks) -> TrainResult`.

`train` is imported on first use, so reading configs (the service, the CLI) does not load megatron-core.
"""

import logging
import warnings

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

# Every megatron-core import goes through this package. At import, megatron-core announces what it falls back to
# without Transformer Engine, Apex or absl (none of which inkwell uses) and torch that a CPU host has no CUDA
# runtime: a dozen lines at every `inkwell serve` that ask nothing of the user.
warnings.filterwarnings("ignore", r"(Transformer Engine and Apex are|absl\.logging is) not installed", UserWarning)
logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

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
