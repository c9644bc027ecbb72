"""Fold an adapter into base weights: W + (alpha / r) * B @ A, experts included."""

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.targets import Target, model_targets


def expert_deltas(target: Target, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per-expert deltas [E, out, in] of a shared-outer expert target."""
    if target.kind == "expert_in":  # A [r, in] shared, B [E, out, r]
        return scaling * torch.einsum("eor,ri->eoi", b, a)
    return scaling * torch.einsum("or,eri->eoi", b, a)  # A [E, r, in], B [out, r] shared


def merge(
    base_weights: dict[str, torch.Tensor], adapter: Adapter, config: InklingTextConfig
) -> dict[str, torch.Tensor]:
    """A new state dict (transformers names) with the adapter folded in; the input is not modified."""
    merged = dict(base_weights)
    f = config.moe_intermediate_size
    for target in model_targets(config, adapter.spec):
        a, b = adapter.factors(target)
        scaling = adapter.scaling(target)
        if target.kind == "linear":
            key = f"{target.module}.weight"
            merged[key] = base_weights[key] + (scaling * (b.double() @ a.double())).to(base_weights[key].dtype)
            continue
        delta = expert_deltas(target, a.double(), b.double(), scaling)
        parent = target.module.rsplit(".", 1)[0]
        if parent.endswith(".experts") and target.proj != "down_proj":
            key = f"{parent}.gate_up_proj"
            rows = slice(0, f) if target.proj == "gate_proj" else slice(f, 2 * f)
            w = merged[key].clone()
            w[:, rows, :] += delta.to(w.dtype)
            merged[key] = w
        else:
            key = f"{parent}.{target.proj}"
            merged[key] = merged[key] + delta.to(merged[key].dtype)
    return merged
