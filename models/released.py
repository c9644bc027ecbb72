"""The released Inkling checkpoint format: where each transformers tensor lies in it, and its config.

Inkling is published under its own names (`model.llm.layers.N.attn.wq_du.weight`, ...), with gate and up
projections fused into one `w13` tensor whose rows alternate gate, up, gate, up. transformers' conversion mapping
(`transformers/conversion_mapping.py`, entry `inkling_mm_model`) reads that format into its own names; `placement`
is the same mapping seen from transformers' side, the one definition inkwell reads released checkpoints with
(`models/checkpoint.py`) and writes them with (`ReleasedWeights`, for SGLang 0.5.23, which loads only this format).
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.models.config import MULTIMODAL_MODEL_TYPE

GATE, UP = 0, 1  # the halves of a fused w13 tensor; row k of half h is row 2k + h of the released tensor
RELEASED_PREFIX = "model.llm."
_TOP = {
    "model.embed_tokens.weight": "model.llm.embed.weight",
    "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "model.norm.weight": "model.llm.norm.weight",
    "lm_head.weight": "model.llm.unembed.weight",
}
# In a layer (`model.layers.N.` -> `model.llm.layers.N.`): transformers' name -> the released one, or the fused
# released tensor, the dim along which its gate and up rows alternate, and the halves this tensor holds.
_LAYER: dict[str, str | tuple[str, int, tuple[int, ...]]] = {
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight",
    "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0, (GATE,)),
    "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0, (UP,)),
    "mlp.down_proj.weight": "mlp.w2_md.weight",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.experts.gate_up_proj": ("mlp.experts.w13_weight", 1, (GATE, UP)),
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1, (GATE,)),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1, (UP,)),
    "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}


@dataclass(frozen=True)
class Placement:
    """Where one transformers tensor lies in the released checkpoint: all of tensor `name`, or (fused) the rows
    of `halves` (in this tensor's order) of `name`, whose gate and up rows alternate along `dim`."""

    name: str
    dim: int = 0
    halves: tuple[int, ...] = ()

    def released_size(self, size: int) -> int:
        """The released tensor's size along `dim` when this tensor's is `size`."""
        return size * 2 // len(self.halves) if self.halves else size

    def runs(self, start: int, stop: int, size: int) -> list[tuple[slice, slice]]:
        """Rows [start, stop) along `dim` of this tensor (`size` rows) as pairs of (rows of that range, relative to
        `start`; the released tensor's rows holding them), one pair per half the range touches."""
        if not self.halves:
            return [(slice(0, stop - start), slice(start, stop))]
        half, runs = size // len(self.halves), []
        for j, h in enumerate(self.halves):
            lo, hi = max(start, j * half), min(stop, (j + 1) * half)
            if lo < hi:
                first, last = 2 * (lo - j * half) + h, 2 * (hi - 1 - j * half) + h
                runs.append((slice(lo - start, hi - start), slice(first, last + 1, 2)))
        return runs


def placement(name: str) -> Placement:
    """Where transformers tensor `name` (canonical) lies in a released checkpoint; KeyError for a name the released
    format has no place for."""
    if name in _TOP:
        return Placement(_TOP[name])
    parts = name.split(".", 3)
    if parts[:2] != ["model", "layers"] or len(parts) != 4 or parts[3] not in _LAYER:
        raise KeyError(f"{name}: no place for it in the released Inkling format")
    to = _LAYER[parts[3]]
    prefix = f"{RELEASED_PREFIX}layers.{parts[2]}."
    if isinstance(to, str):
        return Placement(prefix + to)
    released, dim, halves = to
    return Placement(prefix + released, dim, halves)


class ReleasedWeights(Mapping[str, torch.Tensor]):
    """Tensors under transformers' names (any Mapping, read lazily) seen under the released names: each fused w13
    tensor is built when it is asked for, from its gate and up tensors."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights
        self.sources: dict[str, list[tuple[str, Placement]]] = {}
        for name in weights:
            where = placement(name)
            self.sources.setdefault(where.name, []).append((name, where))

    def __getitem__(self, name: str) -> torch.Tensor:
        sources = self.sources[name]
        if len(sources) == 1 and not sources[0][1].halves:
            return self.weights[sources[0][0]]
        out = None
        for source, where in sources:
            tensor = self.weights[source]
            size = tensor.shape[where.dim]
            if out is None:
                shape = list(tensor.shape)
                shape[where.dim] = where.released_size(size)
                out = torch.empty(shape, dtype=tensor.dtype)
            lead = (slice(None),) * where.dim
            for rows, released in where.runs(0, size, size):
                out[lead + (released,)] = tensor[lead + (rows,)]
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def released_config(config: InklingTextConfig) -> dict:
    """The `inkling_mm_model` config.json of a text-only checkpoint, in SGLang's field names.

    transformers reads the same file back into an equal `InklingTextConfig` (it maps
    `local_layer_ids`, `dense_mlp_idx` and `dense_intermediate_size` itself).
    """
    kinds = list(config.mlp_layer_types)
    dense_mlp_idx = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if "dense" in kinds[dense_mlp_idx:]:
        raise ValueError(f"mlp_layer_types {kinds}: SGLang's Inkling builds dense MLPs only before the first MoE layer")
    copied = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "swa_num_attention_heads",
        "swa_num_key_value_heads",
        "swa_head_dim",
        "sliding_window_size",
        "d_rel",
        "rel_extent",
        "log_scaling_n_floor",
        "log_scaling_alpha",
        "rms_norm_eps",
        "hidden_act",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "route_scale",
        "shared_expert_sink",
        "logits_mup_width_multiplier",
        "max_position_embeddings",
        "moe_intermediate_size",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
    ]
    text = {key: getattr(config, key) for key in copied}
    text |= {
        "local_layer_ids": [i for i, kind in enumerate(config.layer_types) if kind == "hybrid_sliding"],
        "dense_mlp_idx": dense_mlp_idx,
        "intermediate_size": config.moe_intermediate_size,  # SGLang: the experts' width
        "dense_intermediate_size": config.intermediate_size,
        "sconv_kernel_size": config.conv_kernel_size,
        # What transformers' Inkling always has and SGLang's config makes optional.
        "use_embed_norm": True,
        "use_sconv": True,
        "use_gate_bias": True,
        "use_global_scale": True,
        "gate_activation": "sigmoid",
        "norm_after_topk": True,
        "shared_experts_size": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["InklingForConditionalGeneration"],
        "model_type": MULTIMODAL_MODEL_TYPE,
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": config.eos_token_id,
        "bos_token_id": config.bos_token_id,
        "pad_token_id": config.pad_token_id,
    }
