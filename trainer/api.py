"""`train(job_config, callbacks) -> TrainResult`: the trainer's one entry point for the service and the CLI."""

import os
from pathlib import Path

from pydantic import ValidationError

from inkwell.trainer.config import TrainCallbacks, TrainConfigError, TrainJobConfig, TrainResult
from inkwell.trainer.engine import Trainer
from inkwell.trainer.launch import launch
from inkwell.trainer.parallel import model_parallel
from inkwell.trainer.prepare import prepare


def parse_config(data: TrainJobConfig | dict) -> TrainJobConfig:
    """A TrainJobConfig from a dict; the first invalid field becomes a TrainConfigError naming it."""
    if isinstance(data, TrainJobConfig):
        return data
    try:
        return TrainJobConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise TrainConfigError(f"{field or 'config'}: {first['msg']}", field=field) from exc


def run_in_process(config: TrainJobConfig, callbacks: TrainCallbacks) -> TrainResult | None:
    """Train in this process (one rank of torchrun, or the whole world when nproc == 1)."""
    prepared = prepare(config)
    with model_parallel(config.tp, config.ep, config.device, config.seed) as layout:
        return Trainer(config, prepared, layout, callbacks).run()


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


def load_job_config(path: Path) -> TrainJobConfig:
    """A job config from a .json or .yaml file."""
    import json

    import yaml

    if not path.is_file():
        raise TrainConfigError(f"config: {path} does not exist", field="config")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        kind = path.suffix[1:].upper()
        raise TrainConfigError(f"config: {path} is not valid {kind} ({exc})", field="config") from exc
    if not isinstance(data, dict):
        raise TrainConfigError(f"config: {path} must hold a mapping of job fields", field="config")
    return parse_config(data)
