"""A base model in the released layouts trains and serves exactly as the original: the same SFT losses and
adapter bit for bit (TP=2 on the released shards: the same losses), and the native engine generates the same tokens."""

import pytest
import torch

from inkwell.adapters.io import load_adapter
from inkwell.models import load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.native.engine import Engine
from inkwell.trainer import TrainCallbacks, train
from tests.models.layouts import Layout, write_layout
from tests.trainer.helpers import reverse_sample

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 40))
SMOKE = [Layout("released", 3, "multimodal"), Layout("transformers", 3, "multimodal"), Layout("released", 1, "text")]


class Losses(TrainCallbacks):
    def __init__(self):
        self.losses = []

    def on_event(self, event):
        self.losses.append(event.loss)


def sft(base, tmp_path, name: str, **layout):
    """Two SFT steps; the losses and the adapter (sglang layout) they produced."""
    recorder = Losses()
    job = {
        "base_model_dir": str(base),
        "dataset_path": str(reverse_sample(tmp_path / "data.jsonl", 24)),
        "output_dir": str(tmp_path / name),
        "lora": {"rank": 4, "alpha": 8, "targets": ["attn", "mlp", "experts", "shared_experts", "lm_head"]},
        "learning_rate": 5e-3,
        "max_steps": 2,
        "batch_size": 4,
        "seq_len": 64,
        **layout,
    }
    result = train(job, recorder)
    return recorder.losses, load_adapter(result.adapter_dirs["sglang"], load_base_config(base))


def serve(base, adapter) -> list[int]:
    engine = Engine(base, EngineConfig(max_loras_per_batch=1, max_lora_rank=4))
    engine.load_adapter("a", adapter)
    return engine.generate([Request("x", PROMPT, GREEDY, "a")])["x"][0].token_ids


@pytest.fixture(scope="module")
def original(tiny_model_dir, tmp_path_factory):
    losses, adapter = sft(tiny_model_dir, tmp_path_factory.mktemp("original"), "run")
    return losses, adapter, serve(tiny_model_dir, adapter)


@pytest.fixture(scope="module")
def released_shards(tiny_model_dir, tmp_path_factory):
    return write_layout(tiny_model_dir, tmp_path_factory.mktemp("released") / "m", SMOKE[0])


@pytest.mark.parametrize("layout", SMOKE, ids=lambda layout: layout.id)
def test_a_release_trains_and_serves_as_the_original(original, released_shards, tiny_model_dir, tmp_path, layout):
    base = released_shards if layout == SMOKE[0] else write_layout(tiny_model_dir, tmp_path / "m", layout)
    losses, adapter = sft(base, tmp_path, "run")
    ref_losses, ref_adapter, ref_tokens = original
    assert losses == ref_losses
    assert adapter.tensors.keys() == ref_adapter.tensors.keys()
    for name, tensor in ref_adapter.tensors.items():
        assert torch.equal(adapter.tensors[name], tensor), name
    tokens = serve(base, adapter)
    assert len(tokens) == GREEDY.max_tokens and tokens == ref_tokens


def test_tp2_reads_its_slices_of_the_released_shards(original, released_shards, tmp_path):
    """Each of two TP ranks reads only its rows of the fused, interleaved w13 tensors: the losses are TP=1's."""
    losses, _ = sft(released_shards, tmp_path, "tp2", tp=2, nproc=2)
    for ours, ref in zip(losses, original[0], strict=True):
        assert abs(ours - ref) / abs(ref) < 1e-5, (losses, original[0])
