"""What the kernel tests share: the float64 RMSNorm and the tolerance check against a float64 reference, and running a
test module's cases in a child process (with Triton's CPU interpreter, or with a stand-in driver that only compiles),
started ahead of their tests on a second core."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of float64 rows x by `weight`, in float64: the kernels' norms' reference."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


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


INTERPRETER_ENV = (("OMP_NUM_THREADS", "1"), ("TRITON_INTERPRET", "1"))


@dataclass(frozen=True)
class ChildRun:
    """`module`'s `function()` in a child process (with `env` added to this one's): it passes where it exits 0 and
    prints `done`. A test marked `@pytest.mark.child(run)` checks it (`check`), and the suite starts it ahead of the
    test on a second core (`LANE`)."""

    module: str
    function: str
    done: str
    env: tuple[tuple[str, str], ...] = ()
    timeout: int = 300

    @classmethod
    def interpreted(cls, module: str) -> "ChildRun":
        """`module`'s `run_interpreted_cases()` under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
        return cls(module, "run_interpreted_cases", "interpreted cases passed", INTERPRETER_ENV)

    def start(self) -> subprocess.Popen:
        code = f"from {self.module} import {self.function}; {self.function}()"
        root = Path(__file__).resolve().parents[2]  # where `tests` is importable from
        return subprocess.Popen(
            [sys.executable, "-c", code], env={**os.environ, **dict(self.env)}, cwd=root, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def check(self) -> None:
        """Fail with the child's output unless it passed."""
        code, out, err = LANE.result(self)
        assert code == 0, out[-3000:] + err[-6000:]
        assert self.done in out, out[-3000:]


class ChildLane:
    """Runs the child runs the session's selected tests will check, in their order, from the first check on: one at
    a time on a thread of this process and one on the checking test's thread, two children where the tests alone
    keep one core busy. A test whose run the lane has not begun runs it itself; while the lane runs it, the test
    runs the next waiting one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[ChildRun] = []
        self._results: dict[ChildRun, Future] = {}
        self._running: set[subprocess.Popen] = set()
        self._started = False

    def expect(self, runs: Iterable[ChildRun]) -> None:
        """The runs the session's tests will check, in the tests' order."""
        with self._lock:
            for run in runs:
                if run not in self._results:
                    self._results[run] = Future()
                    self._waiting.append(run)

    def result(self, run: ChildRun) -> tuple[int, str, str]:
        """`run`'s exit code, stdout and stderr: run here, or by the lane."""
        self.expect([run])
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._work, name="child-lane", daemon=True).start()
        if self._claim(run) is not None:
            self._complete(run)
        future = self._results[run]
        while not future.done() and (other := self._claim(None)) is not None:  # the lane has it: run the next
            self._complete(other)
        return future.result()

    def stop(self) -> None:
        """Start no more children and kill those still running (a session cut short)."""
        with self._lock:
            self._waiting.clear()
            for proc in self._running:
                proc.kill()

    def _claim(self, run: ChildRun | None) -> ChildRun | None:
        """Take `run` (None: the next waiting one) off the waiting list; None where it is not on it."""
        with self._lock:
            if run is None:
                return self._waiting.pop(0) if self._waiting else None
            if run in self._waiting:
                self._waiting.remove(run)
                return run
            return None

    def _complete(self, run: ChildRun) -> None:
        future = self._results[run]
        try:
            proc = run.start()
            with self._lock:
                self._running.add(proc)
            try:
                out, err = proc.communicate(timeout=run.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\nkilled after {run.timeout} s"
            finally:
                with self._lock:
                    self._running.discard(proc)
            future.set_result((proc.returncode, out, err))
        except BaseException as exc:  # the checking test raises it
            future.set_exception(exc)

    def _work(self) -> None:
        while (run := self._claim(None)) is not None:
            self._complete(run)


LANE = ChildLane()
