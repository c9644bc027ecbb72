"""A base model in the released Inkling checkpoint format, the only one SGLang 0.5.23 loads.

Our base models are transformers checkpoints (`InklingForCausalLM`, model_type `inkling_text`);
SGLang's `InklingForConditionalGeneration` reads an `inkling_mm_model` config with a `text_config`
in its own field names and weights under the released names (`model.llm.layers.N.attn.wq_du`,
interleaved `w13` expert weights, ...). transformers' `conversion_mapping.py` maps the released
names to its own (`inkling_mm_model` entry); this module applies that mapping in reverse, and
writes the config fields SGLang's `InklingModelConfig` reads, so transformers loading the written
directory gets back exactly the weights we started from.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import InklingTextConfig

from inkwell.models import load_base_config, load_base_weights, load_tokenizer

# Plain renames, ours -> released, applied in order (each the reverse of one transformers rule).
_RENAMES: list[tuple[str, str]] = [
    (r"^model\.layers\.", "model.llm.layers."),
    (r"^model\.embed_tokens\.embed_norm\.weight$", "model.llm.embed_norm.weight"),
    (r"^model\.embed_tokens\.weight$", "model.llm.embed.weight"),
    (r"^model\.norm\.weight$", "model.llm.norm.weight"),
    (r"^lm_head\.weight$", "model.llm.unembed.weight"),
    (r"\.self_attn\.q_proj\.", ".attn.wq_du."),
    (r"\.self_attn\.k_proj\.", ".attn.wk_dv."),
    (r"\.self_attn\.v_proj\.", ".attn.wv_dv."),
    (r"\.self_attn\.r_proj\.", ".attn.wr_du."),
    (r"\.self_attn\.o_proj\.", ".attn.wo_ud."),
    (r"\.self_attn\.k_sconv\.conv1d\.", ".attn.k_sconv."),
    (r"\.self_attn\.v_sconv\.conv1d\.", ".attn.v_sconv."),
    (r"\.self_attn\.", ".attn."),  # q_norm, k_norm, rel_logits_proj
    (r"\.attn_sconv\.conv1d\.weight$", ".attn_sconv.weight"),
    (r"\.mlp_sconv\.conv1d\.weight$", ".mlp_sconv.weight"),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.bias"),
    (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w13_weight"),
    (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w2_weight"),
    (r"\.mlp\.shared_experts\.down_proj$", ".mlp.shared_experts.shared_w2_weight"),
    (r"\.mlp\.down_proj\.weight$", ".mlp.w2_md.weight"),
]


def interleave_gate_up(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate rows; up rows] along `dim` -> gate and up rows alternating, as the released w13 stores them.

    The inverse of transformers' `Interleave(dim)` on load.
    """
    shape = list(gate_up.shape)
    split = shape[:dim] + [2, shape[dim] // 2] + shape[dim + 1 :]
    return gate_up.reshape(split).transpose(dim, dim + 1).reshape(shape).contiguous()


def released_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (transformers 5.19) tensors under the released checkpoint's names and layouts."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith((".mlp.up_proj.weight", ".mlp.shared_experts.up_proj")):
            continue  # written with its gate below
        if name.endswith(".mlp.gate_proj.weight"):  # dense MLP: w13_dn [2F, H]
            up = weights[name.replace(".gate_proj.", ".up_proj.")]
            name, tensor = name.replace(".gate_proj.", ".w13_dn."), interleave_gate_up(torch.cat([tensor, up]), 0)
        elif name.endswith(".mlp.shared_experts.gate_proj"):  # [S, F, H] each -> shared_w13 [S, 2F, H]
            up = weights[name.replace(".gate_proj", ".up_proj")]
            name = name.replace(".gate_proj", ".shared_w13_weight")
            tensor = interleave_gate_up(torch.cat([tensor, up], dim=1), 1)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2F, H], gate rows first
            tensor = interleave_gate_up(tensor, 1)
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        out[name] = tensor.contiguous()
    return out


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
        "model_type": "inkling_mm_model",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": config.eos_token_id,
        "bos_token_id": config.bos_token_id,
        "pad_token_id": config.pad_token_id,
    }


def write_sglang_checkpoint(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write base model `model_dir` as a released-format checkpoint SGLang can load (with its tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = load_base_config(model_dir)
    (out / "config.json").write_text(json.dumps(released_config(config), indent=2) + "\n")
    save_file(released_weights(load_base_weights(model_dir)), str(out / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(model_dir).save_pretrained(str(out))
    return out
