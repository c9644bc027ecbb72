"""Adapters for the serving tests: five distinct ones on inkling-tiny, of different ranks and targets."""

import pytest
import torch

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.graphs import StepGraphs

SPECS = [
    LoraSpec(rank=8, alpha=16, targets=("attn", "mlp", "experts", "shared_experts", "lm_head")),
    LoraSpec(rank=4),
    LoraSpec(rank=16, alpha=8, targets=("experts",)),
    LoraSpec(rank=8, targets=("attn",)),
    LoraSpec(rank=2, targets=("shared_experts", "lm_head")),
]


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir):
    """Five random adapters (B ~ N(0, 0.05), so every one changes the logits)."""
    config = load_base_config(tiny_model_dir)
    identity = base_model_identity(tiny_model_dir)
    return [init_adapter(config, spec, identity, seed=i + 1, b_std=0.05) for i, spec in enumerate(SPECS)]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops are too small to split: a second thread only spins, and on a busy box
    it turns milliseconds into seconds. Restored afterwards for the other test areas."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def exact_fp32():
    """fp32 means fp32 on CUDA: no TF32 in matmuls or in the cuDNN convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def with_step_graphs(engine: Engine) -> StepGraphs:
    """Give a CPU engine the CUDA engine's step graphs (run eagerly here): decode steps and short prefill chunks
    then take the bucketed forwards a CUDA engine captures."""
    engine.graphs = StepGraphs.of(engine.model, engine.state, engine.lora, engine.config)
    return engine.graphs
