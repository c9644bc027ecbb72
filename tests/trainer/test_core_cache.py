"""A process's next SFT job of the same kind trains on the core its last job built (trainer/core_cache.py), bit for
bit as on a new core; a job of another LoRA spec or base builds its own; the kept core holds megatron's parallel
state open until it is dropped."""

import shutil

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import load_file

from inkwell.trainer import TrainCallbacks, core_cache, train
from inkwell.trainer.parallel import model_parallel
from tests.trainer.helpers import reverse_sample, tiny_job

LORA = {"rank": 2, "alpha": 4, "dropout": 0.1}  # dropout: a reused core must also reseed the generators


class Losses(TrainCallbacks):
    def __init__(self, fail_at: int | None = None):
        self.losses, self.fail_at = [], fail_at

    def on_event(self, event):
        self.losses.append(event.loss)
        if event.step == self.fail_at:
            raise RuntimeError("the job fails here")


@pytest.fixture
def no_kept_core():
    """Start and end without a kept core (other tests' jobs leave theirs)."""
    core_cache.release()
    yield
    core_cache.release()


def run(tmp_path, base, name: str, seed: int, lora: dict = LORA, callbacks: Losses | None = None):
    """One 3-step job; its losses and exported adapter tensors."""
    data = reverse_sample(tmp_path / "reverse40.jsonl", 40)
    job = tiny_job(base, data, tmp_path / name, max_steps=3, learning_rate=5e-3, seed=seed, lora=lora)
    callbacks = callbacks or Losses()
    result = train(job, callbacks)
    return callbacks.losses, load_file(result.adapter_dirs["peft"] / "adapter_model.safetensors")


def parallel_state_open() -> bool:
    return dist.is_initialized() and ps.model_parallel_is_initialized()


def test_a_second_job_reuses_the_core_and_trains_as_on_a_new_one(tmp_path, tiny_model_dir, no_kept_core):
    run(tmp_path, tiny_model_dir, "first", seed=0)
    first = core_cache.kept()
    assert first is not None and parallel_state_open()

    reused = run(tmp_path, tiny_model_dir, "second", seed=1)
    assert core_cache.kept() is first, "a job of the same kind takes the kept core"

    core_cache.release()
    assert core_cache.kept() is None and not parallel_state_open()
    fresh = run(tmp_path, tiny_model_dir, "second-fresh", seed=1)
    assert core_cache.kept() is not first
    assert reused[0] == fresh[0], "the kept core's losses equal a new core's, bit for bit"
    assert reused[1].keys() == fresh[1].keys()
    for name, tensor in fresh[1].items():
        assert torch.equal(reused[1][name], tensor), name


def test_another_lora_spec_or_base_builds_its_own_core(tmp_path, tiny_model_dir, no_kept_core):
    run(tmp_path, tiny_model_dir, "rank-2", seed=0)
    rank_2 = core_cache.kept()
    run(tmp_path, tiny_model_dir, "rank-4", seed=0, lora=LORA | {"rank": 4})
    rank_4 = core_cache.kept()
    assert rank_4 is not rank_2 and rank_4.lora.rank == 4

    other_base = shutil.copytree(tiny_model_dir, tmp_path / "inkling-tiny-copy")
    run(tmp_path, other_base, "other-base", seed=0, lora=LORA | {"rank": 4})
    assert core_cache.kept() is not rank_4 and parallel_state_open()


def test_a_failed_job_or_another_parallel_state_drops_the_kept_core(tmp_path, tiny_model_dir, no_kept_core):
    with pytest.raises(RuntimeError, match="the job fails here"):
        run(tmp_path, tiny_model_dir, "failing", seed=0, callbacks=Losses(fail_at=1))
    assert core_cache.kept() is None and not parallel_state_open()

    run(tmp_path, tiny_model_dir, "kept", seed=0)
    assert core_cache.kept() is not None
    with model_parallel(1, 1, "cpu", 0):
        assert core_cache.kept() is None and parallel_state_open()
    assert not parallel_state_open()
