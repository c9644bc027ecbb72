"""One job definition: a job sent through the SDK and the HTTP API resolves to the same trainer config as the
same fields in an `inkwell train --config` file, so their defaults cannot drift apart again. No training."""

import json

import pytest
import yaml

from inkwell.sdk.resources import hyperparameters as sdk_hyperparameters
from inkwell.sdk.resources import lora_spec
from inkwell.service.db.models import JobRow
from inkwell.service.jobs import train_config
from inkwell.service.schemas import Hyperparameters, JobCreate
from inkwell.service.settings import Settings
from inkwell.trainer.config import TrainingHyperparameters, TrainJobConfig, load_job_config

TRAINING_FIELDS = list(TrainingHyperparameters.model_fields)


def training_fields(config: TrainJobConfig) -> dict:
    return {name: getattr(config, name) for name in TRAINING_FIELDS} | {"lora": config.lora, "method": config.method}


def through_the_service(tmp_path, **chosen) -> TrainJobConfig:
    """What the worker trains for a job the SDK submits with `chosen` hyperparameters: the SDK's request body,
    parsed as the API parses it, stored as the API stores it, built into a config as the worker builds it."""
    body = {
        "base_model": "inkling-tiny",
        "dataset_id": "ds_" + "0" * 24,
        "adapter_name": "same-job",
        "lora": lora_spec(None).model_dump(mode="json"),
        "hyperparameters": sdk_hyperparameters(chosen),
    }
    create = JobCreate.model_validate_json(json.dumps(body))
    row = JobRow(**create.model_dump(mode="json"))  # every field of the body, in its column, as JSON
    work = tmp_path / "work"
    settings = Settings(data_dir=tmp_path, train_device="cpu", train_dtype="float32", train_nproc=1)
    validated = train_config(create, tmp_path / "base", work, settings)  # the API's check_trainable
    trained = train_config(row, tmp_path / "base", work, settings)  # the job worker's _prepare
    assert training_fields(validated) == training_fields(trained)
    return trained


def through_a_config_file(tmp_path, suffix: str, **chosen) -> TrainJobConfig:
    job = {
        "base_model_dir": str(tmp_path / "base"),
        "dataset_path": str(tmp_path / "train.jsonl"),
        "output_dir": str(tmp_path / "out"),
        "adapter_name": "same-job",
        **chosen,
    }
    path = tmp_path / f"job{suffix}"
    path.write_text(yaml.safe_dump(job) if suffix == ".yaml" else json.dumps(job))
    return load_job_config(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize(
    "chosen",
    [{}, {"max_steps": 7, "seq_len": 64, "lr_schedule": "linear", "eval_fraction": 0.2, "checkpoint_every": 3}],
    ids=["defaults", "chosen"],
)
def test_service_and_config_file_resolve_to_the_same_training(tmp_path, suffix, chosen):
    service = through_the_service(tmp_path, **chosen)
    config_file = through_a_config_file(tmp_path, suffix, **chosen)
    assert training_fields(service) == training_fields(config_file)
    assert service.adapter_name == config_file.adapter_name


def test_the_api_takes_the_trainers_fields():
    """The job body's `hyperparameters` is the trainer's model (one rule added), not a copy of its fields."""
    assert issubclass(Hyperparameters, TrainingHyperparameters)
    assert list(Hyperparameters.model_fields) == TRAINING_FIELDS
    assert set(TRAINING_FIELDS) <= set(TrainJobConfig.model_fields)
    assert Hyperparameters().model_dump() == TrainingHyperparameters().model_dump()


def test_service_placement_comes_from_its_settings(tmp_path):
    body = JobCreate(base_model="inkling-tiny", dataset_id="ds_x", eval_dataset_id="ds_y", adapter_name="a")
    settings = Settings(data_dir=tmp_path, train_nproc=2, train_tp=2, train_ep=1)
    config = train_config(body, tmp_path / "base", tmp_path / "work", settings, resume_from=tmp_path / "ckpt")
    assert (config.nproc, config.tp, config.ep) == (2, 2, 1)
    assert config.dataset_path.parent == config.eval_dataset_path.parent == tmp_path / "work" / "data"
    assert config.output_dir == tmp_path / "work" / "out" and config.resume_from == tmp_path / "ckpt"
