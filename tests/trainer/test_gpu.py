"""On a GPU: the bundled SFT run in bf16 (fp32 adapter master weights) tracks the same run in fp32 on CPU."""

import pytest
import torch

from inkwell.trainer import TrainCallbacks, train
from inkwell.trainer.dataset import bundled_dataset

pytestmark = pytest.mark.gpu


class Losses(TrainCallbacks):
    def __init__(self):
        self.losses = []

    def on_event(self, event):
        self.losses.append(event.loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_sft_on_gpu_tracks_fp32_on_cpu(tmp_path, tiny_model_dir):
    job = {
        "base_model_dir": str(tiny_model_dir),
        "dataset_path": str(bundled_dataset("uppercase")),
        "lora": {"rank": 16, "alpha": 32, "targets": ["attn", "mlp", "experts", "shared_experts", "lm_head"]},
        "learning_rate": 5e-3,
        "max_steps": 24,
        "batch_size": 8,
        "seq_len": 128,
        "warmup_steps": 4,
    }
    runs = {}
    for name, extra in {"cpu-fp32": {}, "cuda-bf16": {"device": "cuda", "dtype": "bfloat16"}}.items():
        recorder = Losses()
        result = train({**job, "output_dir": str(tmp_path / name), **extra}, recorder)
        runs[name] = (recorder.losses, result)
    (cpu, cpu_result), (gpu, gpu_result) = runs["cpu-fp32"], runs["cuda-bf16"]
    print("step  fp32-cpu  bf16-cuda")
    for step, (a, b) in enumerate(zip(cpu, gpu, strict=True), start=1):
        print(f"{step:4d}  {a:.4f}  {b:.4f}")
    print("eval", cpu_result.final_eval_loss, gpu_result.final_eval_loss)
    assert gpu_result.metrics["dtype"] == "bfloat16" and gpu_result.metrics["device"] == "cuda"
    assert gpu_result.final_loss < 0.6 * gpu_result.first_loss
    for a, b in zip(cpu, gpu, strict=True):
        assert abs(a - b) / a < 0.05, (cpu, gpu)
    assert abs(cpu_result.final_eval_loss - gpu_result.final_eval_loss) / cpu_result.final_eval_loss < 0.05
