"""`train(job_config, callbacks) -> TrainResult`: the trainer's one entry point for the service and the CLI."""

import os

from inkwell.trainer.config import TrainCallbacks, TrainJobConfig, TrainResult, parse_config
from inkwell.trainer.core_cache import job_core
from inkwell.trainer.launch import launch
from inkwell.trainer.loop import Trainer
from inkwell.trainer.prepare import prepare


def run_in_process(config: TrainJobConfig, callbacks: TrainCallbacks) -> TrainResult | None:
    """Train in this process (one rank of torchrun, or the whole world when nproc == 1, on the core kept from the
    process's last job when it fits: trainer/core_cache.py)."""
    prepared = prepare(config)
    with job_core(config, prepared) as (core, layout):
        return Trainer(config, prepared, layout, callbacks, core).run()


def train(config: TrainJobConfig | dict, callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Run an SFT job to completion and export its adapter in both layouts.

    Raises TrainConfigError before any training for bad input, TrainingCancelled when
    `callbacks.should_stop()` asked to stop. With nproc > 1 this launches torchrun itself.
    """
    config = parse_config(config)
    callbacks = callbacks or TrainCallbacks()
    if config.nproc > 1 and "LOCAL_RANK" not in os.environ:
        prepare(config)
        return launch(config, callbacks)
    result = run_in_process(config, callbacks)
    assert result is not None, "a single-process run always ends on rank 0"
    return result
