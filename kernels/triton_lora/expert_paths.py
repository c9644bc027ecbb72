"""The ways the Triton expert kernels can run the same dispatched rows, for the tests and benchmarks that run each.

`expert_in_lora_expand` and `expert_down_lora` pick their program shape from the row count (against ROW_MAX_ROWS)
and from whether segment ends are passed; `expert_path` forces one of them. The torch twins ignore both. Importing
this module loads no Triton: `common` is imported only inside `expert_path`.
"""

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

# name -> (pass the segment ends, the per-row kernels' row limit)
EXPERT_PATHS = {"per row": (False, 2**31), "segments": (True, 0), "token tiles": (False, 0)}


@contextlib.contextmanager
def expert_path(name: str, ends: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Within the block the expert kernels take path `name`; yields the segment ends to pass (or None)."""
    from inkwell.kernels.triton_lora import common

    with_ends, row_max = EXPERT_PATHS[name]
    with mock.patch.object(common, "ROW_MAX_ROWS", row_max):
        yield ends if with_ends else None
