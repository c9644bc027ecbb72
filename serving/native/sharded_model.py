"""One rank's Inkling forward in a tensor- and expert-parallel group: `InklingModel` over its shard, plus the sums.

The per-rank arithmetic is `InklingModel`'s own: with this rank's heads the attention (its fused q/k/v/r projection,
the K/V ShortConv on its channels, its rows of the KV cache) runs unchanged, and the output projection over its
input columns gives its share of the output. Three sums make the shares whole: attention's and the dense MLP's
outputs over the TP ranks, and the MoE's fp32 combine over every rank (before rounding to the model's dtype). The
residual stream, the ShortConvs on it, the router and the LM head then run alike on every rank, so every rank routes
the same tokens to the same experts.

A rank dispatches only the rows of its own experts: the others' rows sort after them (their local id is past its
last expert) and are left at zero in the combine.
"""

from collections.abc import Mapping

import torch
from transformers import InklingTextConfig

from inkwell.kernels import expert_out_lora_expand
from inkwell.serving.native.group import RankGroup
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import Dispatch, ForwardBatch, InklingModel
from inkwell.serving.native.shards import Shard
from inkwell.serving.native.state import StatePool


class ShardedInklingModel(InklingModel):
    """`InklingModel` over one rank's `weights` (a `Shard`'s slices); `group` is set once the ranks have joined."""

    def __init__(
        self,
        config: InklingTextConfig,
        weights: Mapping[str, torch.Tensor],
        shard: Shard,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__(config, weights, dtype=dtype, device=device)
        self.shard = shard
        self.group: RankGroup | None = None
        held = shard.expert_ids(config)
        self.held_experts = len(held)
        # model-wide expert id -> this rank's id for it; the experts of other ranks map past its last one
        self.local_of = torch.full((self.num_experts,), len(held), dtype=torch.long, device=self.device)
        self.local_of[held] = torch.arange(len(held), device=self.device)
        self.grouped_mm = self.grouped_mm and (config.moe_intermediate_size // shard.tp) % 8 == 0

    def _attention(
        self, h: torch.Tensor, layer: int, batch: ForwardBatch, state: StatePool, lora: LoraSlots | None
    ) -> torch.Tensor:
        return self.group.sum_over_tp(super()._attention(h, layer, batch, state, lora))

    def dense_mlp(self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
        return self.group.sum_over_tp(super().dense_mlp(x, layer, slots, lora))

    def _moe(
        self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None, routing: list[torch.Tensor]
    ) -> torch.Tensor:
        experts = lora.experts.get(layer) if lora is not None else None
        index, weights = self.route(x, layer)
        routing.append(index[:, : self.config.num_experts_per_tok])
        rows = Dispatch.of(self.local_of[index], weights, slots, self.held_experts)  # this rank's rows first
        held = int(rows.ends[-1])
        down = x.new_zeros(rows.tokens.shape[0], x.shape[1])
        if held:
            down[:held], lora = self.run_experts(x, layer, slots, rows.head(held), experts)
            if lora is not None:  # this rank's rows only: their delta joins them before the sum over ranks
                expert_out_lora_expand(
                    lora.y, lora.b, lora.slots, lora.experts, lora.scalings, down[:held], lora.groups
                )
        return self.group.sum_over_all(rows.combine(down, x.shape[0])).to(x.dtype)
