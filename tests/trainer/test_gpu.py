"""On a GPU: the bundled SFT run in bf16 (fp32 adapter master weights) tracks the same run in fp32 on CPU."""

import time

import pytest
import torch

from inkwell.trainer import TrainCallbacks, train
from inkwell.trainer.dataset import bundled_dataset

pytestmark = pytest.mark.gpu


class Losses(TrainCallbacks):
    def __init__(self):
        self.losses, self.first_at = [], None

    def on_event(self, event):
        self.losses.append(event.loss)
        self.first_at = self.first_at or time.perf_counter()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad_accum,compile_mode", [(2, "default"), (1, "reduce-overhead")])
def test_bf16_sft_on_gpu_tracks_fp32_on_cpu(tmp_path, tiny_model_dir, grad_accum, compile_mode):
    """The default `compile: auto` resolves per grad_accum; both modes track fp32 on the CPU."""
    job = {
        "base_model_dir": str(tiny_model_dir),
        "dataset_path": str(bundled_dataset("uppercase")),
        "lora": {"rank": 16, "alpha": 32, "targets": ["attn", "mlp", "experts", "shared_experts", "lm_head"]},
        "learning_rate": 5e-3,
        "max_steps": 24,
        "batch_size": 8,
        "seq_len": 128,
        "warmup_steps": 4,
        "grad_accum": grad_accum,
        "eval_fraction": 0.1,
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
    assert gpu_result.metrics["compile_mode"] == compile_mode
    assert gpu_result.final_loss < 0.6 * gpu_result.first_loss
    for a, b in zip(cpu, gpu, strict=True):
        assert abs(a - b) / a < 0.05, (cpu, gpu)
    assert abs(cpu_result.final_eval_loss - gpu_result.final_eval_loss) / cpu_result.final_eval_loss < 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_layers_equal_eager(tiny_model_dir, mode):
    """Compiled layers (and their CUDA graphs) compute the uncompiled model's loss and LoRA gradients on
    packed rows that cross the sliding window and the relative extent, to bf16 noise (they compile in
    bf16 only: torch's grouped GEMM has no fp32 compiled form), three steps in a row."""
    from inkwell.adapters.adapter import init_adapter
    from inkwell.adapters.spec import LoraSpec
    from inkwell.models import base_model_identity, load_base_config, load_base_weights
    from inkwell.trainer.bridge import is_lora, load_state
    from inkwell.trainer.model import InklingGPT
    from inkwell.trainer.parallel import model_parallel

    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=4, alpha=8, targets=["attn", "mlp", "experts", "shared_experts", "lm_head"])
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=1, b_std=0.02)
    ids = torch.randint(3, 263, (2, 96), generator=torch.Generator().manual_seed(0)).cuda()
    segments = torch.zeros_like(ids)
    segments[1, 40:] = 1

    def train_steps(compile_mode: str | None) -> list[tuple[float, dict[str, torch.Tensor]]]:
        model = InklingGPT(config, spec, torch.bfloat16, "cuda", "eager", compile_mode)
        load_state(model, load_base_weights(tiny_model_dir), lora=False)
        load_state(model, adapter.tensors, lora=True)
        params = [p for p in model.parameters() if is_lora(p)]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        steps = []
        for _ in range(3):
            logits = model(ids, segments).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            steps.append((loss.item(), {p.hf_name: p.grad.float().clone() for p in params}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return steps

    with model_parallel(tp=1, ep=1, device="cuda", seed=0):
        reference = train_steps(None)
        compiled = train_steps(mode)
    for (ref_loss, ref_grads), (loss, grads) in zip(reference, compiled, strict=True):
        errors = sorted(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items())
        median = errors[len(errors) // 2]
        print(f"loss {ref_loss:.5f} vs {loss:.5f}; grad rel. errors median {median:.2e} max {errors[-1]:.2e}")
        assert all(g.abs().max() > 0 for g in ref_grads.values())
        assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss)
        assert median < 5e-2
    assert reference[-1][0] < reference[0][0], "the steps must train for the later comparisons to mean anything"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_core_answers_datums_like_the_eager_one(tiny_model_dir, mode):
    """Datums of several lengths through a bf16 core with compiled layers (under reduce-overhead their rows are
    padded to a power of two and replay CUDA graphs) give the eager core's losses and logprobs to bf16 noise, over
    two steps that each accumulate two forward_backward calls of different widths; packed rows of one shape (the SFT
    path) still train on the same core after them."""
    from inkwell.adapters.spec import LoraSpec
    from inkwell.trainer.core import AdamParams, TrainingCore
    from inkwell.trainer.dataset import Rows
    from inkwell.trainer.losses import CROSS_ENTROPY
    from inkwell.trainer.parallel import model_parallel
    from tests.trainer.test_core import datums, ppo_datums

    spec = LoraSpec(rank=4, alpha=8, targets=["attn", "mlp", "experts", "shared_experts", "lm_head"])
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    ids = torch.randint(3, 263, (2, 96), generator=torch.Generator().manual_seed(0))
    rows = Rows(ids, torch.zeros_like(ids), ids.roll(-1, 1), torch.ones(ids.shape)).to("cuda")

    def run(compile_mode: str | None) -> list:
        core = TrainingCore.create(tiny_model_dir, spec, device="cuda", dtype="bfloat16", compile_mode=compile_mode)
        steps = []
        for _ in range(2):
            steps.append(core.forward_backward(ppo_datums(), "ppo"))
            steps.append(core.forward_backward(datums([100, 70], seed=3), "cross_entropy"))
            core.optim_step(adam)
        for _ in range(3):
            _, sums = core.forward_rows(rows, CROSS_ENTROPY, {}, {"weights": rows.loss_mask / 192}, backward=True)
            core.optim_step(adam)
            steps.append(sums["loss"].item())
        steps.append(core.forward(ppo_datums(), "ppo"))
        return steps

    with model_parallel(tp=1, ep=1, device="cuda", seed=0):
        eager, compiled = run(None), run(mode)
    for ref, ours in zip(eager, compiled, strict=True):
        if isinstance(ref, float):
            assert abs(ours - ref) < 2e-2 * abs(ref), (ref, ours)
            continue
        print(mode, ref.metrics, ours.metrics)
        assert abs(ours.metrics["loss:sum"] - ref.metrics["loss:sum"]) < 2e-2 * abs(ref.metrics["loss:sum"])
        for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0.05, atol=0.1)
    assert eager[6] < eager[4], "the row steps must train"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_kept_core_under_cuda_graphs_trains_the_next_job_as_a_new_core(tmp_path, tiny_model_dir):
    """A second job of the same kind replays the first job's CUDA graphs on the core it kept (trainer/core_cache.py)
    and gets a new core's losses: the adapter, the optimizer and the generators start over in place. The same job
    twice, so that one core is compiled (a second new core would double the test's minutes of compilation)."""
    from inkwell.trainer import core_cache

    job = {
        "base_model_dir": str(tiny_model_dir),
        "dataset_path": str(bundled_dataset("uppercase")),
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.1},
        "learning_rate": 5e-3,
        "max_steps": 6,
        "batch_size": 8,
        "seq_len": 128,
        "device": "cuda",
        "dtype": "bfloat16",
        "compile": "reduce-overhead",
    }

    def run(name: str, seed: int) -> tuple[list[float], float]:
        """The job's losses and the seconds until its first step's event."""
        recorder, began = Losses(), time.perf_counter()
        train({**job, "output_dir": str(tmp_path / name), "seed": seed}, recorder)
        return recorder.losses, recorder.first_at - began

    core_cache.release()
    fresh, fresh_first_step = run("first", seed=1)  # a new core: compiled, its CUDA graphs recorded
    kept = core_cache.kept()
    reused, reused_first_step = run("again", seed=1)  # the same job again, on the kept core reset in place
    assert kept is not None and core_cache.kept() is kept
    core_cache.release()
    print(f"first step: kept core {reused_first_step:.2f} s, new core {fresh_first_step:.2f} s")
    print("losses, kept core:", reused, "\nlosses, new core: ", fresh)
    assert reused_first_step < fresh_first_step
    for a, b in zip(reused, fresh, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (reused, fresh)
