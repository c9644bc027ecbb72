"""An adapter in memory: its spec, its tensors by canonical name, and the base it belongs to."""

from dataclasses import dataclass, field

import torch
from transformers import InklingTextConfig

from inkwell.adapters.spec import LoraSpec
from inkwell.adapters.targets import Target, model_targets
from inkwell.models.base import BaseModelIdentity


@dataclass
class Adapter:
    spec: LoraSpec
    tensors: dict[str, torch.Tensor]
    base: BaseModelIdentity
    metadata: dict = field(default_factory=dict)

    def factors(self, target: Target) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[f"{target.module}.lora_A"], self.tensors[f"{target.module}.lora_B"]

    def scaling(self, target: Target) -> float:
        return self.spec.scaling_for(target.group)

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def init_adapter(
    config: InklingTextConfig,
    spec: LoraSpec,
    base: BaseModelIdentity,
    seed: int = 0,
    b_std: float = 0.0,
) -> Adapter:
    """A fresh adapter: A ~ Kaiming-uniform as in peft, B zero (or normal(b_std) for tests)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for target in model_targets(config, spec):
        shapes = target.shapes(spec.rank_for(target.group))
        fan_in = target.in_features
        bound = (3.0 / fan_in) ** 0.5  # kaiming_uniform_(a=sqrt(5)) on [r, fan_in]
        tensors[f"{target.module}.lora_A"] = (torch.rand(shapes["lora_A"], generator=gen) * 2 - 1) * bound
        b = torch.randn(shapes["lora_B"], generator=gen) * b_std if b_std else torch.zeros(shapes["lora_B"])
        tensors[f"{target.module}.lora_B"] = b
    return Adapter(spec=spec, tensors=tensors, base=base)
