"""`inkwell train --config job.yaml` as a real subprocess: bad config exits 2 naming the field; a run exports."""

import json
import subprocess
import sys

import yaml

from tests.trainer.helpers import reverse_sample, tiny_job


def inkwell(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "inkwell.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_bad_job_file_exits_2_naming_the_field(tmp_path, tiny_model_dir):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"base_model_dir": str(tiny_model_dir), "output_dir": str(tmp_path / "o")}))
    result = inkwell("train", "--config", str(job))
    assert result.returncode == 2
    assert "dataset_path" in result.stdout


def test_train_command_runs_a_job_and_exports_both_layouts(tmp_path, tiny_model_dir):
    data = reverse_sample(tmp_path / "data.jsonl", 16)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job(tiny_model_dir, data, tmp_path / "out", max_steps=2, checkpoint_every=1)))
    result = inkwell("train", "--config", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 1: checkpoint" in result.stdout
    for layout in ("sglang", "peft"):
        assert (tmp_path / "out" / "adapters" / layout / "adapter_model.safetensors").is_file()
        # the whole path on one line, though longer than the 80 columns of a pipe
        assert f"adapter ({layout}): {tmp_path / 'out' / 'adapters' / layout}" in result.stdout.splitlines()
    again = inkwell("train", "--config", str(job))  # the same output_dir: refused, the reason the last line
    said = [line for line in again.stdout.splitlines() if line.strip()]
    assert again.returncode == 2 and "already exists" in said[-1], again.stdout
