"""Multi-LoRA ops over a per-token adapter slot index; pure-torch references (Triton twins match them)."""

from inkwell.kernels.torch_ops import expert_lora_expand, expert_lora_shrink, lora_expand, lora_shrink

__all__ = ["expert_lora_expand", "expert_lora_shrink", "lora_expand", "lora_shrink"]
