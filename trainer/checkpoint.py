"""Training state on disk: everything needed to continue exactly where a job or a session stopped.

One format for both. A state directory holds `state.pt` (adapter tensors and AdamW moments as full canonical
tensors, so they do not depend on the TP/EP layout, plus the optimizer step count, which for a job is also its
data position: rows are a pure function of the step), `rng-<rank>.pt` per process, and `meta.json` (base model
identity, LoRA spec, layout, step). It is written into a temporary sibling and renamed, so a crash never leaves
a half-written state under its final name.
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


def save_checkpoint(final: Path, step: int, params: list[nn.Parameter], optimizer, meta: dict, is_main: bool) -> Path:
    """Collective: every rank calls it; the state lands at `final` (replacing what was there)."""
    tmp = final.parent / f".{final.name}.tmp"
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
        torch.save({"step": step, "adapter": adapter, "moments": moments, "adam_steps": steps}, tmp / STATE)
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


def _step_device(optimizer, p: nn.Parameter) -> torch.device:
    """Where AdamW keeps a parameter's step count: beside the parameter when fused or capturable, else on the CPU."""
    on_param = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return p.device if on_param else torch.device("cpu")


@torch.no_grad()
def load_checkpoint(path: Path, params: list[nn.Parameter], optimizer, restore_rng: bool) -> int:
    """Restore the adapter, and with an optimizer its moments (and the RNG when `restore_rng`); returns the step.

    Without an optimizer only the adapter is read: a fresh start from those weights.
    """
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    for p in params:
        p.copy_(local_shard(state["adapter"][p.hf_name], p))
    if optimizer is None:
        return int(state["step"])
    optimizer.state.clear()
    for p in params:
        if p.hf_name in state["adam_steps"]:
            optimizer.state[p] = {
                "step": state["adam_steps"][p.hf_name].clone().to(_step_device(optimizer, p)),
                **{k: local_shard(v[p.hf_name], p).to(p.device).clone() for k, v in state["moments"].items()},
            }
    rng_file = path / f"rng-{dist.get_rank()}.pt"
    if restore_rng and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    return int(state["step"])
