"""An RL job of the service (method `grpo`): the recipe's own GRPO loop (`inkwell.recipes.rl.grpo`) on in-process
primitives (`inkwell.recipes.local`), scored by the built-in verifier the job names.

The job worker calls `run_grpo` as it calls `inkwell.trainer.train` for SFT: the same callbacks (events, checkpoints
to upload, stop), the same result (the adapter exported in both layouts). One process holds the training core and
a native engine on the same device; after each step only the adapter is synced into the engine, from memory.
"""

import time
from dataclasses import asdict
from pathlib import Path

from inkwell.adapters.io import save_adapter_layouts
from inkwell.recipes.local import LocalSession
from inkwell.recipes.problems import load_problems
from inkwell.recipes.rl import RLConfig, StepReport, grpo
from inkwell.serving.contract import EngineConfig
from inkwell.serving.native.engine import Engine
from inkwell.trainer.config import (
    GrpoJobConfig,
    TrainCallbacks,
    TrainingCancelled,
    TrainResult,
)
from inkwell.trainer.core import TrainingCore
from inkwell.trainer.parallel import model_parallel
from inkwell.trainer.verifiers import verifier

# The core beside the engine runs its layers eagerly. With routing replay (the default) a CUDA-graphed core runs its
# replayed forwards eagerly anyway; without it an RL step's datums change width from step to step, so graphs pay a
# capture per new width, and a graphed core beside an engine in one process once hit an illegal memory access on
# the H200 (docs/benchmarks.md, "GRPO on one GPU").
COMPILE_MODE: str | None = None


class GrpoCallbacks(TrainCallbacks):
    """The job worker's hooks; `on_step` in place of SFT's `on_event`."""

    def on_step(self, report: StepReport, total_steps: int) -> None:
        """Called after every step with its report."""


def rl_config(config: GrpoJobConfig) -> RLConfig:
    """The recipe's settings for the job's knobs; a state is saved every `checkpoint_every` steps."""
    return RLConfig(
        steps=config.max_steps,
        prompts_per_step=config.prompts_per_step,
        group_size=config.group_size,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        learning_rate=config.learning_rate,
        loss_fn=config.loss_fn,
        normalize_advantages=config.normalize_advantages,
        save_every=config.checkpoint_every,
        routing_replay=config.routing_replay,
        seed=config.seed,
    )


def step_data(report: StepReport, total_steps: int) -> dict:
    """A step's report as a progress event's data: `step` counts the steps done, as SFT's events do."""
    data = asdict(report) | {"step": report.step + 1, "total_steps": total_steps}
    data.pop("state")
    return data


def run_grpo(config: GrpoJobConfig, callbacks: GrpoCallbacks) -> TrainResult:
    """Run the job to `max_steps` (from `resume_from`'s step, if given) and export its adapter; TrainingCancelled
    when `callbacks.should_stop()` asked to stop (checked after every step)."""
    problems = load_problems(config.dataset_path, config.verifier_arg)
    reward_fn = verifier(config.verifier)
    began = time.perf_counter()
    if callbacks.should_stop():
        raise TrainingCancelled(0)

    def on_step(report: StepReport) -> None:
        callbacks.on_step(report, config.max_steps)
        if report.state is not None and report.step + 1 < config.max_steps:  # the last one is the adapter itself
            callbacks.on_checkpoint(report.step + 1, Path(report.state))
        if callbacks.should_stop():
            raise TrainingCancelled(report.step + 1)

    with model_parallel(1, 1, config.device, config.seed):
        core = TrainingCore.create(
            config.base_model_dir,
            config.lora,
            seed=config.seed,
            device=config.device,
            dtype=config.dtype,
            compile_mode=COMPILE_MODE,
        )
        engine = Engine(
            config.base_model_dir,
            EngineConfig(device=config.device, dtype=config.dtype, max_lora_rank=config.lora.max_rank),
        )
        session = LocalSession(core, engine, config.output_dir / "checkpoints", config.adapter_name)
        resume = str(config.resume_from) if config.resume_from is not None else None
        settings = rl_config(config)
        reports = grpo(
            session,
            engine.tokenizer,
            problems,
            reward_fn,
            settings,
            resume_from=resume,
            progress=False,
            on_step=on_step,
        )
        adapter = core.adapter({"name": config.adapter_name, "method": config.method})
    root = config.output_dir / "adapters"
    dirs = save_adapter_layouts(adapter, root, core.hf_config)
    seconds = time.perf_counter() - began
    tokens = sum(r.tokens for r in reports)
    return TrainResult(
        adapter_dirs=dirs,
        steps=len(reports),
        tokens=tokens,
        first_loss=reports[0].loss if reports else float("nan"),
        final_loss=reports[-1].loss if reports else float("nan"),
        initial_eval_loss=None,
        final_eval_loss=None,
        seconds=seconds,
        metrics={
            "first_reward": reports[0].reward if reports else None,
            "final_reward": reports[-1].reward if reports else None,
            "max_kl_k3": max((r.kl_k3 for r in reports), default=None),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "resumed_from_step": config.max_steps - len(reports),
            "dtype": config.dtype,
            "device": config.device,
        },
    )
