"""HF Inkling checkpoint <-> megatron-core InklingGPT shards, for any TP/EP layout.

Each model tensor carries `hf_name`, `tp_dim`, `ep_dim` and `hf_chunk` (see `lora.mark`): this
rank's shard is the HF tensor, chunked (fused gate_up), then split evenly along tp_dim over
TP ranks and along ep_dim over EP ranks. Writing back all-gathers the same splits. Adapter
tensors use the same attributes under their canonical names (`<module>.lora_A/B`). A base
checkpoint is read shard by shard: each rank reads only its slices from disk.
"""

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import nn

from inkwell.models import BaseCheckpoint
from inkwell.models.checkpoint import shard_index as checkpoint_shard_index
from inkwell.trainer.parallel import ep_group, tp_group


def marked_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for _, t in model.named_parameters():
        if hasattr(t, "hf_name"):
            yield t
    for _, t in model.named_buffers():
        if hasattr(t, "hf_name"):
            yield t


def is_lora(t: torch.Tensor) -> bool:
    return getattr(t, "is_lora", False)


def shard_index(shape: torch.Size, t: torch.Tensor) -> tuple[slice, ...]:
    """This rank's part of an HF/canonical tensor of `shape` for model tensor `t`, one slice per dim: the chunk
    (`hf_chunk`), then its TP chunk along tp_dim, then its EP chunk along ep_dim, as `torch.chunk` cuts them."""
    cuts = [t.hf_chunk] if t.hf_chunk is not None else []
    if t.tp_dim is not None:
        cuts.append((t.tp_dim, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()))
    if t.ep_dim is not None:
        cuts.append((t.ep_dim, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()))
    return checkpoint_shard_index(tuple(shape), cuts)


def local_shard(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of the HF/canonical tensor `full` for model tensor `t`."""
    return full[shard_index(full.shape, t)]


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Inverse of local_shard (without the chunk): gather over EP then TP; collective over both."""
    x = t.detach()
    if t.ep_dim is not None:
        x = _gather(x, t.ep_dim, ep_group())
    if t.tp_dim is not None:
        x = _gather(x, t.tp_dim, tp_group())
    return x


@torch.no_grad()
def load_state(model: nn.Module, state: Mapping[str, torch.Tensor], lora: bool) -> None:
    """Copy base (lora=False) or adapter (lora=True) tensors into this rank's shards; names must match. From a
    BaseCheckpoint only this rank's slices are read, in the checkpoint's order (one file after another)."""
    targets: dict[str, list[torch.Tensor]] = {}
    for t in marked_tensors(model):
        if is_lora(t) == lora:
            targets.setdefault(t.hf_name, []).append(t)
    missing, unexpected = sorted(targets.keys() - set(state)), sorted(set(state) - targets.keys())
    if missing or unexpected:
        what = "adapter" if lora else "base model"
        raise ValueError(f"{what} tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name in state:
        for t in targets[name]:
            if isinstance(state, BaseCheckpoint):
                shard = state.read(name, shard_index(state.shape(name), t))
            else:
                shard = local_shard(state[name], t)
            if shard.shape != t.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != model shape {tuple(t.shape)}")
            t.copy_(shard)


@torch.no_grad()
def gather_state(model: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """Full HF-named (lora=False) or canonical adapter (lora=True) tensors; every rank gets them."""
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for t in marked_tensors(model):
        if is_lora(t) != lora:
            continue
        full = full_tensor(t).float() if lora else full_tensor(t)
        dim, index, _ = t.hf_chunk if t.hf_chunk is not None else (0, 0, 1)
        pieces.setdefault(t.hf_name, []).append((index, dim, full.cpu()))
    out = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        out[name] = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts], dim=parts[0][1])
    return out
