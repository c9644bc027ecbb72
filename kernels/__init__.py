"""Multi-LoRA ops over a per-token adapter slot index, and the MoE router: Triton kernels on CUDA, pure-torch
references elsewhere.

The engine's fused decode kernels live beside them (`triton_short_conv`, `triton_decode_attention`); they run on
CUDA only and are imported where used, so CPU processes never load Triton.
"""

from inkwell.kernels.dispatch import (
    EXPERT_MATMUL_MAX_TOKENS,
    FUSED_MAX_N,
    FUSED_MAX_TOKENS,
    expert_lora_shrink,
    expert_matmul,
    expert_out_lora_expand,
    gate_route,
    gate_route_dispatch,
    linear,
    lora_expand,
    lora_expand_sliced,
    lora_linear,
    lora_shrink,
    lora_shrink_expand,
    moe_combine,
    moe_dispatch,
    one_launch_projection,
    shared_sink_route,
    silu_mul,
    silu_mul_shrink,
)
from inkwell.kernels.torch_ops import ExpertGroups, RowExpand, TokenShrink

__all__ = [
    "EXPERT_MATMUL_MAX_TOKENS",
    "FUSED_MAX_N",
    "FUSED_MAX_TOKENS",
    "ExpertGroups",
    "RowExpand",
    "TokenShrink",
    "expert_lora_shrink",
    "expert_matmul",
    "expert_out_lora_expand",
    "gate_route",
    "gate_route_dispatch",
    "linear",
    "lora_expand",
    "lora_expand_sliced",
    "lora_linear",
    "lora_shrink",
    "lora_shrink_expand",
    "moe_combine",
    "moe_dispatch",
    "one_launch_projection",
    "shared_sink_route",
    "silu_mul",
    "silu_mul_shrink",
]
