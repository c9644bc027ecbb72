"""The bounds of a job's knobs hold for a config file as for the API (one model, `TrainingHyperparameters`):
a seed torch cannot take, a non-finite float or a bare-string LoRA target is refused before training, naming
the field; and the largest seed allowed is one every seeded part of the trainer takes. No training."""

import pytest
import torch

from inkwell.trainer.config import MAX_SEED, TrainConfigError, TrainingHyperparameters, load_job_config
from inkwell.trainer.dataset import Example, RowStream, split_eval


def config_file(tmp_path, text: str):
    path = tmp_path / "job.json"
    path.write_text('{"base_model_dir": "base", "dataset_path": "train.jsonl", "output_dir": "out", ' + text + "}")
    return path


@pytest.mark.parametrize(
    "text, field",
    [
        (f'"seed": {2**70}', "seed"),
        (f'"seed": {2**64}', "seed"),
        (f'"seed": {MAX_SEED + 1}', "seed"),
        ('"seed": -1', "seed"),
        (f'"warmup_steps": {2**70}', "warmup_steps"),
        ('"weight_decay": Infinity', "weight_decay"),
        ('"max_grad_norm": NaN', "max_grad_norm"),
        ('"lora": {"alpha": Infinity}', "lora.alpha"),
        ('"lora": {"targets": "attn"}', "lora.targets"),
        ('"lora": {"targets": null}', "lora.targets"),
    ],
)
def test_config_file_out_of_bounds_is_refused_naming_the_field(tmp_path, text, field):
    with pytest.raises(TrainConfigError) as info:
        load_job_config(config_file(tmp_path, text))
    assert info.value.field == field, str(info.value)


def test_largest_seed_is_accepted_and_seeds_every_generator(tmp_path):
    assert load_job_config(config_file(tmp_path, f'"seed": {MAX_SEED}')).seed == MAX_SEED
    assert load_job_config(str(config_file(tmp_path, '"seed": 7'))).seed == 7  # a path given as a string
    examples = [Example([1, 2, 3], [0, 1, 1], n) for n in range(1, 9)]
    train, held = split_eval(examples, 0.25, MAX_SEED)
    assert len(held) == 2 and len(train) == 6
    RowStream(train, 16, 0, MAX_SEED).rows(0, 8)  # epochs seed + e
    # megatron's offsets from the seed: + 2718 + tp rank, + 1024 + 100 * ep rank, + 65536 * (1 + remat rank)
    for offset in (0, 2718 + 7, 1024 + 100 * 63, 2718 + 65536 * 8):
        torch.Generator().manual_seed(MAX_SEED + offset)


def test_the_seed_bound_is_in_the_schema():
    """The API's OpenAPI and a config file's schema both show it: it is one Field of TrainingHyperparameters."""
    schema = TrainingHyperparameters.model_json_schema()["properties"]["seed"]
    assert (schema["minimum"], schema["maximum"]) == (0, MAX_SEED)


def test_an_output_dir_on_a_file_is_refused_before_training(tmp_path):
    """It was found when the adapter was written, after the training had run."""
    (tmp_path / "taken").write_text("")
    for output in (tmp_path / "taken", tmp_path / "taken" / "sub"):
        with pytest.raises(TrainConfigError, match=f"{tmp_path / 'taken'} is a file; give a directory") as info:
            load_job_config(config_file(tmp_path, f'"output_dir": "{output}"'))
        assert info.value.field == "output_dir"
    with pytest.raises(TrainConfigError, match="is a directory: give the job file"):
        load_job_config(tmp_path)
