"""The routing trace of an Inkling model: per position, the routed experts each MoE layer chose there.

The native engine records traces while it samples; a training datum carries one back so that the trainer's forward
routes every token to the experts the sampler used (routing replay, RL's fix for a sampler and a trainer that
would otherwise route near-ties apart). A trace is an integer array [positions, MoE layers, top_k]: the ids (among
the routed experts, shared experts excluded: they always run) that MoE layer `moe_layers[j]` picked at a position,
in no particular order. Position i is the forward whose input is token i and which scores token i + 1, the
alignment of Tinker's datums (`tokens[i]` predicts `target_tokens[i]`) and of the sampler's logprobs (a sampled
token's logprob and routing both come from the forward that scored it).
"""

from dataclasses import dataclass

import numpy as np
from transformers import InklingTextConfig


@dataclass(frozen=True)
class RoutingShape:
    """What a routing trace of one model looks like: its MoE layers (in order), top_k and routed expert count."""

    moe_layers: tuple[int, ...]
    top_k: int
    experts: int

    @classmethod
    def of(cls, config: InklingTextConfig) -> "RoutingShape":
        layers = tuple(i for i, kind in enumerate(config.mlp_layer_types) if kind != "dense")
        return cls(layers, config.num_experts_per_tok, config.n_routed_experts)

    @property
    def dtype(self) -> np.dtype:
        """The narrowest integer type of an expert id: uint8 up to 256 experts, else int16."""
        return np.dtype(np.uint8 if self.experts <= 256 else np.int16)

    def empty(self) -> np.ndarray:
        """A trace of no positions."""
        return np.zeros((0, len(self.moe_layers), self.top_k), dtype=self.dtype)
