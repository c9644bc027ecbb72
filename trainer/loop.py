"""The SFT loop every rank runs inside `model_parallel`: build, (resume), train, checkpoint, export.

Each step is the training core's (trainer/core.py): the cross-entropy loss over this rank's packed rows, micro-batch
by micro-batch, with weights = loss mask / completion tokens of the whole optimizer step (all micro-batches, all
data-parallel ranks), so gradients summed over DP equal the single-process gradient; then one `optim_step` at the
scheduled learning rate.
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from inkwell.adapters.io import save_adapter_layouts
from inkwell.models import load_base_weights
from inkwell.trainer import checkpoint as ckpt
from inkwell.trainer.config import TrainCallbacks, TrainEvent, TrainingCancelled, TrainJobConfig, TrainResult
from inkwell.trainer.core import AdamParams, TrainingCore
from inkwell.trainer.dataset import Rows, RowStream, pack
from inkwell.trainer.losses import CROSS_ENTROPY
from inkwell.trainer.parallel import Layout, all_reduce_
from inkwell.trainer.prepare import Prepared


def lr_lambda(config: TrainJobConfig):
    """Linear warmup from 0, then cosine or linear decay to 0 at max_steps, or constant."""
    warm, total = config.warmup_steps, config.max_steps

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if config.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_core(config: TrainJobConfig, prepared: Prepared) -> TrainingCore:
    """A new core for the job (inside `model_parallel`): its base, LoRA spec, seed, device, dtype and compile mode."""
    return TrainingCore(
        prepared.hf_config,
        prepared.identity,
        load_base_weights(config.base_model_dir),
        config.lora,
        seed=config.seed,
        device=config.device,
        dtype=config.dtype,
        compile_mode=config.compile_mode,
        sequence_parallel=config.sequence_parallel,
    )


@dataclass
class Trainer:
    """One rank's data stream and loop on the job's training core (`build_core`, or a kept one reset to the job's
    seed: trainer/core_cache.py), inside `model_parallel`."""

    config: TrainJobConfig
    prepared: Prepared
    layout: Layout
    callbacks: TrainCallbacks
    core: TrainingCore

    def __post_init__(self):
        cfg, prep = self.config, self.prepared
        self.device = self.core.device
        self.schedule = lr_lambda(cfg)
        self.stream = RowStream(prep.train, cfg.seq_len, prep.pad_id, cfg.seed)
        self.per_rank = cfg.batch_size // self.layout.dp
        self.micro = self.per_rank // cfg.grad_accum
        self.eval_rows = self._eval_rows()

    def adam(self, step: int) -> AdamParams:
        """The optimizer step `step`'s hyper-parameters: the scheduled learning rate, the job's decay and clip."""
        cfg = self.config
        return AdamParams(
            learning_rate=cfg.learning_rate * self.schedule(step),
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=cfg.weight_decay,
            grad_clip_norm=cfg.max_grad_norm,
        )

    def _eval_rows(self) -> Rows | None:
        if not self.prepared.eval:
            return None
        rows = pack(self.prepared.eval, self.config.seq_len, self.prepared.pad_id)
        chunk = self.micro * self.layout.dp
        missing = -rows.input_ids.shape[0] % chunk
        if missing:
            empty = pack([], self.config.seq_len, self.prepared.pad_id)
            rows = Rows.cat([rows] + [empty] * missing)
        return rows

    def _dp_share(self, rows: Rows) -> Rows:
        n = rows.input_ids.shape[0] // self.layout.dp
        return rows.slice(self.layout.dp_rank * n, (self.layout.dp_rank + 1) * n)

    def evaluate(self) -> float | None:
        if self.eval_rows is None:
            return None
        mine = self._dp_share(self.eval_rows)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, mine.input_ids.shape[0], self.micro):
            rows = mine.slice(i, i + self.micro).to(self.device)
            _, sums = self.core.forward_rows(rows, CROSS_ENTROPY, {}, {"weights": rows.loss_mask}, backward=False)
            total[0] += sums["loss"].double()
            total[1] += rows.loss_mask.sum().double()
        all_reduce_(total, ps.get_data_parallel_group())
        return (total[0] / total[1]).item()

    def train_step(self, step: int) -> tuple[float, int]:
        """One optimizer step; returns (mean completion-token loss, real tokens processed globally)."""
        batch = self.stream.rows(step * self.config.batch_size, self.config.batch_size)
        denominator = max(batch.loss_tokens, 1)
        mine = self._dp_share(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(0, self.per_rank, self.micro):
            rows = mine.slice(i, i + self.micro).to(self.device)
            weights = {"weights": rows.loss_mask / denominator}
            _, sums = self.core.forward_rows(rows, CROSS_ENTROPY, {}, weights, backward=True)
            loss_sum += sums["loss"].double()
        self.core.optim_step(self.adam(step))
        all_reduce_(loss_sum, ps.get_data_parallel_group())
        return loss_sum.item(), int((batch.input_ids != self.prepared.pad_id).sum().item())

    def should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.layout.is_main and self.callbacks.should_stop() else 0.0], device=self.device)
        all_reduce_(flag, dist.group.WORLD)
        return bool(flag.item() > 0)

    def run(self) -> TrainResult | None:
        cfg = self.config
        if cfg.resume_from is not None:
            self.core.load_state(cfg.resume_from)
        start = self.core.step
        began = time.perf_counter()
        initial_eval = self.evaluate()
        first_loss = final_loss = float("nan")
        tokens = 0
        for step in range(start, cfg.max_steps):
            if self.should_stop():
                raise TrainingCancelled(step)
            tick = time.perf_counter()
            lr = self.adam(step).learning_rate
            loss, step_tokens = self.train_step(step)
            tokens += step_tokens
            first_loss = loss if step == start else first_loss
            final_loss = loss
            done = step + 1
            eval_loss = None
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.max_steps:
                eval_loss = self.evaluate()
            if self.layout.is_main:
                self.callbacks.on_event(
                    TrainEvent(
                        step=done,
                        total_steps=cfg.max_steps,
                        loss=loss,
                        lr=lr,
                        tokens_per_s=step_tokens / max(time.perf_counter() - tick, 1e-9),
                        eval_loss=eval_loss,
                        elapsed_s=time.perf_counter() - began,
                    )
                )
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                path = self.core.save_state(cfg.output_dir / "checkpoints" / ckpt.checkpoint_name(done))
                if self.layout.is_main:
                    self.callbacks.on_checkpoint(done, path)
        final_eval = self.evaluate()
        adapter_dirs = self.export()
        seconds = time.perf_counter() - began
        if not self.layout.is_main:
            return None
        return TrainResult(
            adapter_dirs=adapter_dirs,
            steps=cfg.max_steps - start,
            tokens=tokens,
            first_loss=first_loss,
            final_loss=final_loss,
            initial_eval_loss=initial_eval,
            final_eval_loss=final_eval,
            seconds=seconds,
            metrics={
                "tokens_per_s": tokens / max(seconds, 1e-9),
                "train_samples": len(self.prepared.train),
                "eval_samples": len(self.prepared.eval),
                "resumed_from_step": start,
                "layout": self.core.meta()["layout"],
                "dtype": cfg.dtype,
                "device": cfg.device,
                "compile_mode": cfg.compile_mode,
            },
        )

    def export(self) -> dict[str, Path]:
        """Gather the adapter (collective) and write both layouts on rank 0."""
        adapter = self.core.adapter({"name": self.config.adapter_name, "method": self.config.method})
        if not self.layout.is_main:
            return {}
        root = self.config.output_dir / "adapters"
        return save_adapter_layouts(adapter, root, self.prepared.hf_config)
