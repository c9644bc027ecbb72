"""Multi-LoRA ops over a per-token adapter slot index: Triton kernels on CUDA, pure-torch references elsewhere."""

from inkwell.kernels.dispatch import (
    expert_lora_expand,
    expert_lora_shrink,
    lora_expand,
    lora_expand_sliced,
    lora_shrink,
    lora_shrink_expand,
)

__all__ = [
    "expert_lora_expand",
    "expert_lora_shrink",
    "lora_expand",
    "lora_expand_sliced",
    "lora_shrink",
    "lora_shrink_expand",
]
