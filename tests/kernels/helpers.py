"""What the kernel tests share: the tolerance check against a float64 reference, and running a test module's cases
in a child process (with Triton's CPU interpreter, or with a stand-in driver that only compiles)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def row_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's error against the float64 reference, relative to the row's norm or the median row norm
    (`assert_close` says why the floor)."""
    got, ref = got.detach().cpu().double(), ref.double()
    norms = ref.norm(dim=-1)
    typical = float(norms[norms > 0].median()) if bool((norms > 0).any()) else 1.0
    return float(((got - ref).norm(dim=-1) / norms.clamp_min(typical)).max())


def assert_close(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, tolerance: float | None = None
) -> None:
    """Error per row against the float64 reference, relative to the row's norm or the median row norm, at most
    `tolerance` (default: the dtype's).

    The floor matters: a rank-1 or rank-2 slot's shrink row can nearly cancel (norm 0.04 against a
    median of 3), and the torch twin's own bf16 error on such a row is 5e-2 of it. A wrong or
    unwritten row still errs by about its whole norm. NaN never passes.
    """
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    err, bound = row_error(got, ref), TOLERANCE[dtype] if tolerance is None else tolerance
    assert err <= bound, f"{what}: worst row relative error {err:.2e} (allowed {bound:.2e})"


def run_in_child(module: str, function: str, done: str, env: dict[str, str] | None = None, timeout: int = 300) -> None:
    """Run `module`'s `function()` in a child process (with `env` added to this one's); fail with its output unless
    it exits 0 and prints `done`."""
    code = f"from {module} import {function}; {function}()"
    root = Path(__file__).resolve().parents[2]  # where `tests` is importable from
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **(env or {})}, cwd=root, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert done in proc.stdout


def run_in_interpreter(module: str) -> None:
    """Run `module`'s `run_interpreted_cases()` in a child process with TRITON_INTERPRET=1; fail with its output."""
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run_in_child(module, "run_interpreted_cases", "interpreted cases passed", env)
