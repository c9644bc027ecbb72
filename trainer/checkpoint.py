"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint directory holds `state.pt` (adapter tensors and AdamW moments as full canonical
tensors, so they do not depend on the TP/EP layout, plus the scheduler and the step, which is
also the data position: rows are a pure function of the step), `rng-<rank>.pt` per process, and
`meta.json` (base model identity, LoRA spec, layout). It is written into a temporary sibling and
renamed, so a crash never leaves a half-written checkpoint under its final name.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from inkwell.models.base import BaseModelIdentity
from inkwell.trainer.bridge import full_tensor, local_shard
from inkwell.trainer.config import TrainConfigError

META = "meta.json"
STATE = "state.pt"


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    state = {"cpu": torch.get_rng_state(), "tracker": tracker}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_like(param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    proxy = tensor.detach()
    proxy.tp_dim, proxy.ep_dim = param.tp_dim, param.ep_dim
    return full_tensor(proxy).cpu()


def save_checkpoint(
    root: Path, step: int, params: list[nn.Parameter], optimizer, scheduler, meta: dict, is_main: bool
) -> Path:
    """Collective: every rank calls it; returns the final directory."""
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    adapter, moments = {}, {"exp_avg": {}, "exp_avg_sq": {}}
    steps = {}
    for p in params:
        adapter[p.hf_name] = _gather_like(p, p)
        state = optimizer.state.get(p, {})
        for key in moments:
            if key in state:
                moments[key][p.hf_name] = _gather_like(p, state[key])
        if "step" in state:
            steps[p.hf_name] = state["step"].detach().cpu()
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    torch.save(_rng_state(), tmp / f"rng-{dist.get_rank()}.pt")
    if is_main:
        state = {"step": step, "adapter": adapter, "moments": moments, "adam_steps": steps}
        torch.save({**state, "scheduler": scheduler.state_dict()}, tmp / STATE)
        (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=2, sort_keys=True) + "\n")
    dist.barrier()
    if is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    dist.barrier()
    return final


def read_meta(path: Path) -> dict:
    """meta.json of checkpoint `path`, or a TrainConfigError naming resume_from."""
    meta_file = path / META
    if not meta_file.is_file() or not (path / STATE).is_file():
        raise TrainConfigError(
            f"resume_from: {path} is not a checkpoint directory (needs {META} and {STATE})", field="resume_from"
        )
    return json.loads(meta_file.read_text())


def check_compatible(meta: dict, base: BaseModelIdentity, lora_spec: dict) -> None:
    """A checkpoint resumes only on the same base model and LoRA spec."""
    theirs = BaseModelIdentity.from_dict(meta["base_model"])
    if theirs != base:
        raise TrainConfigError(
            f"resume_from: checkpoint was trained on base model {theirs.name!r} "
            f"(config {theirs.config_sha256[:12]}), not {base.name!r} ({base.config_sha256[:12]}); "
            "resume with the same base_model_dir or start a new run",
            field="resume_from",
        )
    if meta["lora"] != lora_spec:
        raise TrainConfigError(
            f"resume_from: checkpoint has LoRA spec {meta['lora']}, the job asks for {lora_spec}; they must match",
            field="resume_from",
        )


@torch.no_grad()
def load_checkpoint(path: Path, params: list[nn.Parameter], optimizer, scheduler, same_layout: bool) -> int:
    """Restore adapter, optimizer, scheduler (and RNG when the layout is unchanged); returns the step."""
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    for p in params:
        p.copy_(local_shard(state["adapter"][p.hf_name], p))
        if p.hf_name in state["adam_steps"]:
            optimizer.state[p] = {
                "step": state["adam_steps"][p.hf_name].clone(),
                **{k: local_shard(v[p.hf_name], p).to(p.device).clone() for k, v in state["moments"].items()},
            }
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # the scheduler's state does not reach the optimizer by itself
    rng_file = path / f"rng-{dist.get_rank()}.pt"
    if same_layout and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    return int(state["step"])
