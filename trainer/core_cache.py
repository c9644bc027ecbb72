"""The training core of a process's last SFT job, kept for its next job (issue 22).

Building a core loads the base, builds the model and, on a GPU, compiles its layers and records their CUDA graphs:
the second job of a job worker would wait for all of it again. A job of the same base (same directory, files
unchanged), LoRA spec, device, dtype and compile mode instead takes the kept core, reset to its own seed
(`TrainingCore.reset`), and trains bit for bit as on a new one. Only a job of one process (tp = ep = 1) keeps its
core: a torchrun rank's process ends with its job.

The kept core holds megatron's parallel state open between jobs; it is torn down with the core when a job of
another kind arrives, a job fails (anything but a cancel), any other `model_parallel` begins, or the process ends.
"""

import atexit
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inkwell.trainer.config import TrainingCancelled, TrainJobConfig
from inkwell.trainer.core import TrainingCore
from inkwell.trainer.loop import build_core
from inkwell.trainer.parallel import Layout, model_parallel
from inkwell.trainer.prepare import Prepared


@dataclass(frozen=True)
class CoreKey:
    """What a core is built from, besides the seed: jobs of equal keys can share one."""

    base: tuple  # the base directory, and name, size and mtime of each file in it
    lora: str
    device: str
    dtype: str
    compile_mode: str | None

    @classmethod
    def of(cls, config: TrainJobConfig) -> "CoreKey":
        root = Path(config.base_model_dir).resolve()
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(root.iterdir()) if f.is_file())
        return cls(
            (str(root), files),
            config.lora.model_dump_json(),
            config.device,
            config.dtype,
            config.compile_mode,
        )


@dataclass
class _Kept:
    key: CoreKey
    core: TrainingCore
    layout: Layout
    parallel: contextlib.ExitStack  # holds `model_parallel` open


_kept: _Kept | None = None


def kept() -> TrainingCore | None:
    """The core kept for the next job, if any."""
    return _kept.core if _kept is not None else None


def release() -> None:
    """Drop the kept core and tear down the parallel state it holds (nothing if none is kept)."""
    global _kept
    if _kept is not None:
        parallel, _kept = _kept.parallel, None
        parallel.close()


atexit.register(release)


@contextlib.contextmanager
def job_core(config: TrainJobConfig, prepared: Prepared) -> Iterator[tuple[TrainingCore, Layout]]:
    """The job's core, reset to its seed, and its layout, inside its parallel state: the kept core when the job
    matches it, else a new one, kept after the job unless the job fails."""
    global _kept
    if config.nproc > 1:
        with model_parallel(config.tp, config.ep, config.device, config.seed) as layout:
            yield build_core(config, prepared), layout
        return
    key = CoreKey.of(config)
    if _kept is not None and _kept.key == key:
        _kept.core.reset(config.seed)
    else:  # model_parallel drops a kept core of another kind first
        with contextlib.ExitStack() as parallel:
            layout = parallel.enter_context(model_parallel(config.tp, config.ep, config.device, config.seed))
            _kept = _Kept(key, build_core(config, prepared), layout, parallel.pop_all())
    try:
        yield _kept.core, _kept.layout
    except TrainingCancelled:  # stopped at a step boundary: the next job resets the core
        raise
    except BaseException:
        release()
        raise
