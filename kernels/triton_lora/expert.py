"""The routed experts' LoRA ops on dispatched rows: the shrink over per-expert A and the down projection's expand
over each group's B, both through the shrink and expand launchers' token tiles.
"""

import torch

from inkwell.kernels.torch_ops import ExpertGroups
from inkwell.kernels.triton_lora.common import require
from inkwell.kernels.triton_lora.expand import ExpertRows, launch_expand
from inkwell.kernels.triton_lora.shrink import launch_shrink


def _check_rows(rows: int, slots: torch.Tensor, expert_ids: torch.Tensor) -> None:
    """A slot and an expert id for each of the M dispatched rows."""
    require(slots.shape == expert_ids.shape == (rows,), f"slots and expert_ids must be [M={rows}]")


def _check_expert_a(x: torch.Tensor, lora_a: torch.Tensor, groups: ExpertGroups) -> None:
    """Per-expert A [S, E, R, K] for dispatched rows x [M, K], E the experts `groups` cover."""
    require(lora_a.shape[3] == x.shape[1], f"lora_a's K={lora_a.shape[3]} differs from x's K={x.shape[1]}")
    require(groups.count == lora_a.shape[1], f"groups cover {groups.count} experts, lora_a has {lora_a.shape[1]}")


def _check_down_b(rows: int, lora_b: torch.Tensor, out: torch.Tensor, groups: ExpertGroups) -> None:
    """One B per group [S, G, N, R] adding into out [M, N]."""
    require(lora_b.shape[1] == groups.groups, f"lora_b has {lora_b.shape[1]} groups, the groups say {groups.groups}")
    require(tuple(out.shape) == (rows, lora_b.shape[2]), f"out must be [M={rows}, N={lora_b.shape[2]}]")


# ---- public ops: the torch twins' signatures --------------------------------------------------------


def expert_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert - first]^T -> [M,R] (A: [S,E,R,K]); uncovered rows are zero."""
    require(x.dim() == 2 and lora_a.dim() == 4, "expert_lora_shrink needs x [M,K] and lora_a [S,E,R,K]")
    _check_rows(x.shape[0], slots, expert_ids)
    groups = groups or ExpertGroups(0, lora_a.shape[1])
    _check_expert_a(x, lora_a, groups)
    return launch_shrink(x, lora_a, slots, expert_ids, groups.first)


def expert_out_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
) -> torch.Tensor:
    """out[M,N] += scaling[slot, g] * y[M,R] @ B[slot, g]^T for rows whose expert the groups cover (lora_b
    [S, G, N, R], one shared B per group: the down projection), in place."""
    require(y.dim() == 2 and lora_b.dim() == 4, "expert_out_lora_expand needs y [M,R] and lora_b [S,G,N,R]")
    _check_rows(y.shape[0], slots, expert_ids)
    _check_down_b(y.shape[0], lora_b, out, groups)
    return launch_expand(y, lora_b, slots, scalings, out, None, ExpertRows(expert_ids, groups))
