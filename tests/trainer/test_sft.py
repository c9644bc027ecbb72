"""SFT on the bundled data: loss falls, held-out loss improves, resume is exact, cancel stops cleanly."""

import pytest
import torch

from inkwell.adapters.io import load_adapter
from inkwell.models import load_base_config
from inkwell.trainer import TrainCallbacks, TrainingCancelled, train
from inkwell.trainer.dataset import bundled_dataset
from tests.trainer.helpers import reverse_sample


class Recorder(TrainCallbacks):
    def __init__(self, stop_after: int | None = None):
        self.events, self.checkpoints, self.stop_after = [], [], stop_after

    def on_event(self, event):
        self.events.append(event)

    def on_checkpoint(self, step, path):
        self.checkpoints.append((step, path))

    def should_stop(self):
        return self.stop_after is not None and len(self.events) >= self.stop_after


def small_job(tmp_path, base, name, **overrides):
    data = reverse_sample(tmp_path / "reverse40.jsonl", 40)
    job = {
        "base_model_dir": str(base),
        "dataset_path": str(data),
        "output_dir": str(tmp_path / name),
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "learning_rate": 5e-3,
        "max_steps": 6,
        "batch_size": 4,
        "grad_accum": 2,
        "seq_len": 64,
        "warmup_steps": 2,
    }
    return {**job, **overrides}


def test_sft_on_bundled_data_learns(tmp_path, tiny_model_dir):
    recorder = Recorder()
    result = train(
        {
            "base_model_dir": str(tiny_model_dir),
            "dataset_path": str(bundled_dataset("uppercase")),
            "output_dir": str(tmp_path / "run"),
            "lora": {"rank": 16, "alpha": 32, "targets": ["attn", "mlp", "experts", "shared_experts", "lm_head"]},
            "learning_rate": 5e-3,
            "max_steps": 16,
            "batch_size": 8,
            "seq_len": 128,
            "warmup_steps": 3,
            "eval_fraction": 0.1,
            "eval_every": 8,
        },
        recorder,
    )
    assert [e.step for e in recorder.events] == list(range(1, 17))
    assert recorder.events[7].eval_loss is not None and recorder.events[0].eval_loss is None
    assert result.final_loss < 0.6 * result.first_loss, (result.first_loss, result.final_loss)
    assert result.final_eval_loss < 0.7 * result.initial_eval_loss, (result.initial_eval_loss, result.final_eval_loss)
    assert result.tokens > 0 and all(e.tokens_per_s > 0 for e in recorder.events)
    config = load_base_config(tiny_model_dir)
    sglang = load_adapter(result.adapter_dirs["sglang"], config)
    peft = load_adapter(result.adapter_dirs["peft"], config)
    assert sglang.metadata["name"] == "adapter"
    for name, tensor in sglang.tensors.items():
        torch.testing.assert_close(peft.tensors[name], tensor)
    assert any(t.abs().max() > 0 for n, t in sglang.tensors.items() if n.endswith("lora_B"))


def test_resume_from_a_mid_run_checkpoint_gives_the_same_adapter(tmp_path, tiny_model_dir):
    full = Recorder()
    uninterrupted = train(small_job(tmp_path, tiny_model_dir, "full", checkpoint_every=3), full)
    assert [step for step, _ in full.checkpoints] == [3]
    checkpoint = full.checkpoints[0][1]
    assert checkpoint.is_dir() and checkpoint.name == "step-0000003"

    resumed_events = Recorder()
    resumed = train(small_job(tmp_path, tiny_model_dir, "resumed", resume_from=str(checkpoint)), resumed_events)
    assert [e.step for e in resumed_events.events] == [4, 5, 6]
    assert [e.loss for e in resumed_events.events] == [e.loss for e in full.events[3:]]
    assert resumed.metrics["resumed_from_step"] == 3
    config = load_base_config(tiny_model_dir)
    a = load_adapter(uninterrupted.adapter_dirs["sglang"], config).tensors
    b = load_adapter(resumed.adapter_dirs["sglang"], config).tensors
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_should_stop_cancels_at_a_step_boundary(tmp_path, tiny_model_dir):
    recorder = Recorder(stop_after=2)
    with pytest.raises(TrainingCancelled) as info:
        train(small_job(tmp_path, tiny_model_dir, "cancelled"), recorder)
    assert info.value.step == 2
    assert [e.step for e in recorder.events] == [1, 2]
    assert not (tmp_path / "cancelled" / "adapters").exists()
