"""The model tests run the tiny model, whose ops are too small to split over threads."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """On a busy box a second thread only waits, and turns milliseconds into seconds (restored after)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
