"""Fixtures shared by every test area: the tiny Inkling checkpoint everything runs on."""

from pathlib import Path

import pytest
import torch

from inkwell.models import init_base_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A deterministic `inkling-tiny` base model (seed 0), created once per test session."""
    return init_base_model("inkling-tiny", tmp_path_factory.mktemp("base") / "inkling-tiny", seed=0)
