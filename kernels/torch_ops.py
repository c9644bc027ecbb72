"""Pure-torch reference multi-LoRA ops: segmented shrink/expand over a per-token adapter slot index.

One batch mixes tokens of different adapters (and of the base model, slot -1). Each op groups rows
by slot (or by slot and expert) and runs one GEMM per group, the SGMV formulation the Triton twins
implement in a single launch. Slot buffers are preallocated at the maximum rank; an adapter of a
smaller rank is zero-padded, so padding rows contribute nothing. Signatures are the contract the
Triton twins in this package match.
"""

import torch


def _groups(keys: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(key, row indices) for each distinct non-negative key, in ascending key order."""
    valid = keys >= 0
    if not bool(valid.any()):
        return []
    rows = valid.nonzero().squeeze(1)
    picked = keys[rows]
    order = torch.argsort(picked, stable=True)
    rows, picked = rows[order], picked[order]
    uniq, counts = torch.unique_consecutive(picked, return_counts=True)
    out, start = [], 0
    for key, count in zip(uniq.tolist(), counts.tolist(), strict=True):
        out.append((key, rows[start : start + count]))
        start += count
    return out


def _expert_keys(slots: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.where(slots >= 0, slots * num_experts + expert_ids, torch.full_like(slots, -1))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ A[slot]^T -> [T,R]; rows of slot -1 are zero."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in _groups(token_slots):
        out[rows] = x[rows] @ lora_a[slot].to(x.dtype).t()
    return out


def lora_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[T,N] += scaling[slot] * y[T,R] @ B[slot]^T, in place; rows of slot -1 are untouched."""
    for slot, rows in _groups(token_slots):
        delta = (y[rows].float() @ lora_b[slot].float().t()) * scalings[slot]
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


def expert_lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert]^T -> [M,R] (A: [S,E,R,K]); slot -1 rows are zero."""
    num_experts = lora_a.shape[1]
    out = x.new_zeros(x.shape[0], lora_a.shape[2])
    for key, rows in _groups(_expert_keys(slots, expert_ids, num_experts)):
        out[rows] = x[rows] @ lora_a[key // num_experts, key % num_experts].to(x.dtype).t()
    return out


def expert_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[M,N] += scaling[slot] * y[M,R] @ B[slot, expert]^T (B: [S,E,N,R]), in place."""
    num_experts = lora_b.shape[1]
    for key, rows in _groups(_expert_keys(slots, expert_ids, num_experts)):
        slot = key // num_experts
        delta = (y[rows].float() @ lora_b[slot, key % num_experts].float().t()) * scalings[slot]
        out.index_add_(0, rows, delta.to(out.dtype))
    return out
