"""Process groups for one training run: torch.distributed + megatron-core's parallel_state.

World size 1 (the embedded default, in-process) uses a private gloo group on a HashStore, so
no port is taken and the service can call `train()` again in the same process. Under
`torchrun` the usual environment variables describe the world; CPU runs use gloo, GPU runs NCCL.

The token collectives along dim 0 serve both the EP dispatch and sequence parallelism over the TP
group (megatron-core's sequence-parallel mappings allocate on `torch.cuda.current_device()`, so
they cannot run on a CPU host).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from inkwell.trainer import megatron_cpu


@dataclass(frozen=True)
class Layout:
    """Where this process sits: tensor, expert and data parallel sizes and ranks."""

    world: int
    rank: int
    tp: int
    ep: int
    dp: int
    tp_rank: int
    ep_rank: int
    dp_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_layout() -> Layout:
    return Layout(
        world=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def seed_generators(seed: int) -> None:
    """Seed torch's generator and megatron's tensor-parallel RNG tracker (LoRA dropout) with `seed`."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def model_parallel(tp: int, ep: int, device: str, seed: int) -> Iterator[Layout]:
    """Initialise torch.distributed (if needed) and megatron's TP/EP/DP groups; tear down after.

    A core kept from an earlier job of this process holds the groups open (trainer/core_cache.py): it is
    dropped first.
    """
    from inkwell.trainer import core_cache  # it builds cores, which import this module

    core_cache.release()
    megatron_cpu.apply()
    own_pg = not dist.is_initialized()
    if own_pg:
        backend = "nccl" if device == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * ep) != 0:
        raise ValueError(f"world size {world} is not a multiple of tp*ep = {tp * ep}")
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
            create_gloo_process_groups=False,
        )
        seed_generators(seed)
        yield current_layout()
    finally:
        ps.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()


def tp_group():
    return ps.get_tensor_model_parallel_group()


def ep_group():
    return ps.get_expert_model_parallel_group()


def all_reduce_(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum in place over `group` (a no-op for a group of one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_sum(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter along dim 0 over `group`; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _scatter_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


def _scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's tokens, rank order, differentiable (identity for a group of one).

    The backward sums the ranks' gradients, so each rank's gradient must be its own partial share.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _GatherTokens.apply(x, group)


def scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks and keep this rank's slice of tokens (inverse layout of gather_tokens)."""
    if dist.get_world_size(group) == 1:
        return x
    return _ScatterTokens.apply(x, group)


def gather_tokens_nograd(x: torch.Tensor, group) -> torch.Tensor:
    """gather_tokens for tensors that carry no gradient (routing ids)."""
    if dist.get_world_size(group) == 1:
        return x
    return _all_gather(x, group)


class _ShareOfSum(torch.autograd.Function):
    """x / size forward; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int) -> torch.Tensor:
        return x / size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ShareOfGradient(torch.autograd.Function):
    """Identity forward; the gradient is divided by size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None


def tp_share(x: torch.Tensor) -> torch.Tensor:
    """A value replicated on every TP rank as this rank's share of a sum over the ranks (x / tp).

    Under sequence parallelism the row-parallel outputs are reduce-scattered, whose backward hands
    every rank the same full gradient; a replicated term (a LoRA B product of all-reduced rank-r
    activations) added before that sum counts once, and its factors still get the full gradient.
    """
    size = dist.get_world_size(tp_group())
    return x if size == 1 else _ShareOfSum.apply(x, size)


def tp_share_grad(x: torch.Tensor) -> torch.Tensor:
    """x unchanged, its gradient divided by tp: the share of a replicated path's full gradient.

    Under sequence parallelism the layer input is all-gathered and the gather's backward sums the
    ranks' gradients; a path whose gradient is already full on every rank (a LoRA A behind an
    all-reduced rank-r gradient) would otherwise be counted tp times.
    """
    size = dist.get_world_size(tp_group())
    return x if size == 1 else _ShareOfGradient.apply(x, size)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out
