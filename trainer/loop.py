"""The SFT loop every rank runs inside `model_parallel`: build, (resume), train, checkpoint, export.

Loss = sum of per-token cross entropy over completion tokens / completion tokens of the whole
optimizer step (all micro-batches, all data-parallel ranks), so gradients summed over DP equal
the single-process gradient. Non-expert LoRA gradients are summed over the data-parallel group
(which spans EP ranks: shared-outer factors are replicated across EP), per-expert factors over
the expert-data-parallel group. The grad norm counts every distinct shard once.
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.io import save_adapter
from inkwell.adapters.layouts import LAYOUTS
from inkwell.models import load_base_weights
from inkwell.trainer import checkpoint as ckpt
from inkwell.trainer.bridge import gather_state, is_lora, load_state
from inkwell.trainer.config import TrainCallbacks, TrainEvent, TrainingCancelled, TrainJobConfig, TrainResult
from inkwell.trainer.dataset import Rows, RowStream, pack
from inkwell.trainer.model import InklingGPT
from inkwell.trainer.parallel import Layout, all_reduce_
from inkwell.trainer.prepare import Prepared

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# transformers' own eager arithmetic everywhere; on GPUs each layer is compiled, which fuses the bias,
# mask and softmax (faster than SDPA and FlexAttention here: docs/benchmarks.md)
ATTENTION = {"cpu": "eager", "cuda": "eager"}


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


def token_losses(model: InklingGPT, rows: Rows) -> torch.Tensor:
    """Per-token cross entropy [b, s] of next-token targets (vocab-parallel, fp32)."""
    logits = model(rows.input_ids, rows.segments)
    return vocab_parallel_cross_entropy(logits.float(), rows.targets)


@dataclass
class Trainer:
    """One rank's model, adapter optimizer, data stream and loop; built inside `model_parallel`."""

    config: TrainJobConfig
    prepared: Prepared
    layout: Layout
    callbacks: TrainCallbacks

    def __post_init__(self):
        cfg, prep = self.config, self.prepared
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.model = InklingGPT(
            prep.hf_config,
            cfg.lora,
            DTYPES[cfg.dtype],
            cfg.device,
            ATTENTION[cfg.device],
            cfg.compile_mode,
            cfg.sequence_parallel,
        )
        load_state(self.model, load_base_weights(cfg.base_model_dir), lora=False)
        adapter = init_adapter(prep.hf_config, cfg.lora, prep.identity, seed=cfg.seed)
        load_state(self.model, adapter.tensors, lora=True)
        self.params = [p for p in self.model.parameters() if is_lora(p)]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.999),
            eps=1e-8,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.stream = RowStream(prep.train, cfg.seq_len, prep.pad_id, cfg.seed)
        self.per_rank = cfg.batch_size // self.layout.dp
        self.micro = self.per_rank // cfg.grad_accum
        self.eval_rows = self._eval_rows()

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

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_rows is None:
            return None
        self.model.eval()
        mine = self._dp_share(self.eval_rows)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        # without autograd, CUDA-graph trees treat every layer call as a new step and would overwrite the
        # output of a layer that shares its graph with a later one: evaluate uncompiled then
        stance = "force_eager" if self.config.compile_mode == "reduce-overhead" else "default"
        with torch.compiler.set_stance(stance):
            for i in range(0, mine.input_ids.shape[0], self.micro):
                rows = mine.slice(i, i + self.micro).to(self.device)
                total[0] += (token_losses(self.model, rows) * rows.loss_mask).sum().double()
                total[1] += rows.loss_mask.sum().double()
        all_reduce_(total, ps.get_data_parallel_group())
        self.model.train()
        return (total[0] / total[1]).item()

    def train_step(self, step: int) -> tuple[float, int]:
        """One optimizer step; returns (mean completion-token loss, real tokens processed globally)."""
        batch = self.stream.rows(step * self.config.batch_size, self.config.batch_size)
        denominator = max(batch.loss_tokens, 1)
        mine = self._dp_share(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(0, self.per_rank, self.micro):
            rows = mine.slice(i, i + self.micro).to(self.device)
            loss = (token_losses(self.model, rows) * rows.loss_mask).sum() / denominator
            loss.backward()
            loss_sum += loss.detach().double()
        self._reduce_grads()
        if self.config.max_grad_norm > 0:
            norm = self.grad_norm()
            if norm > self.config.max_grad_norm:
                for p in self.params:
                    p.grad.mul_(self.config.max_grad_norm / (norm + 1e-6))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        all_reduce_(loss_sum, ps.get_data_parallel_group())
        return loss_sum.item(), int((batch.input_ids != self.prepared.pad_id).sum().item())

    def _reduce_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        groups = {
            "dense": (ps.get_data_parallel_group(), [p for p in self.params if p.ep_dim is None]),
            "expert": (ps.get_expert_data_parallel_group(), [p for p in self.params if p.ep_dim is not None]),
        }
        for group, params in groups.values():
            if not params or dist.get_world_size(group) == 1:
                continue
            flat = _flatten_dense_tensors([p.grad for p in params])
            dist.all_reduce(flat, group=group)
            for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params]), strict=True):
                p.grad.copy_(g)

    def grad_norm(self) -> float:
        """Global L2 norm: each parameter's squared norm divided by how many ranks hold the same shard."""
        lay = self.layout
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            distinct = (lay.tp if p.tp_dim is not None else 1) * (lay.ep if p.ep_dim is not None else 1)
            total += p.grad.double().pow(2).sum() * distinct / lay.world
        all_reduce_(total, dist.group.WORLD)
        return total.sqrt().item()

    def meta(self) -> dict:
        cfg = self.config
        return {
            "base_model": self.prepared.identity.to_dict(),
            "lora": cfg.lora.model_dump(mode="json"),
            "layout": {"tp": cfg.tp, "ep": cfg.ep, "nproc": cfg.nproc},
            "seed": cfg.seed,
        }

    def should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.layout.is_main and self.callbacks.should_stop() else 0.0], device=self.device)
        all_reduce_(flag, dist.group.WORLD)
        return bool(flag.item() > 0)

    def run(self) -> TrainResult | None:
        cfg = self.config
        start = 0
        if cfg.resume_from is not None:
            same = self.prepared.resume_meta["layout"] == self.meta()["layout"]
            start = ckpt.load_checkpoint(cfg.resume_from, self.params, self.optimizer, self.scheduler, same)
        self.model.train()
        began = time.perf_counter()
        initial_eval = self.evaluate()
        first_loss = final_loss = float("nan")
        tokens = 0
        for step in range(start, cfg.max_steps):
            if self.should_stop():
                raise TrainingCancelled(step)
            tick = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
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
                path = ckpt.save_checkpoint(
                    cfg.output_dir / "checkpoints",
                    done,
                    self.params,
                    self.optimizer,
                    self.scheduler,
                    self.meta(),
                    self.layout.is_main,
                )
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
                "layout": self.meta()["layout"],
                "dtype": cfg.dtype,
                "device": cfg.device,
                "compile_mode": cfg.compile_mode,
            },
        )

    def export(self) -> dict[str, Path]:
        """Gather the adapter (collective) and write both layouts on rank 0."""
        tensors = gather_state(self.model, lora=True)
        if not self.layout.is_main:
            return {}
        adapter = Adapter(
            spec=self.config.lora,
            tensors=tensors,
            base=self.prepared.identity,
            metadata={"name": self.config.adapter_name, "method": self.config.method},
        )
        root = self.config.output_dir / "adapters"
        return {layout: save_adapter(adapter, root / layout, layout, self.prepared.hf_config) for layout in LAYOUTS}
