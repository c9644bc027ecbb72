"""Helpers for trainer tests: a world-of-one megatron context and the tiny model with an adapter."""

import pytest
import torch

from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.trainer.bridge import load_state
from inkwell.trainer.model import InklingGPT
from inkwell.trainer.parallel import model_parallel

ALL_GROUPS = ["attn", "mlp", "experts", "shared_experts", "lm_head"]


@pytest.fixture
def world_of_one():
    """megatron-core's parallel state for one CPU process (gloo), torn down after the test."""
    with model_parallel(tp=1, ep=1, device="cpu", seed=0) as layout:
        yield layout


def build_model(
    model_dir, spec: LoraSpec | None, adapter_tensors: dict | None = None, attention: str = "eager"
) -> InklingGPT:
    config = load_base_config(model_dir)
    model = InklingGPT(config, spec, torch.float32, "cpu", attention)
    load_state(model, load_base_weights(model_dir), lora=False)
    if adapter_tensors is not None:
        load_state(model, adapter_tensors, lora=True)
    return model


def identity(model_dir):
    return base_model_identity(model_dir)
