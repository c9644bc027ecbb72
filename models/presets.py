"""Named Inkling configurations: a CPU-sized one with every feature on, and the GPU benchmark one."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import InklingTextConfig

PRESETS: dict[str, dict] = {
    # Under 10M parameters, yet every Inkling feature is exercised: sliding and full layers,
    # a dense first layer then MoE layers (routed experts + 2 shared experts with the sink),
    # ShortConv at its four sites, relative logits, log scaling on the full layers.
    # The window and relative extent are short so that tests cross them with short prompts.
    "inkling-tiny": dict(
        vocab_size=384,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=32,
        sliding_window_size=24,
        d_rel=8,
        rel_extent=48,
        log_scaling_n_floor=16,
        log_scaling_alpha=0.1,
        local_layer_ids=[0, 2],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        route_scale=2.0,
        max_position_embeddings=1024,
        logits_mup_width_multiplier=2.0,
        conv_kernel_size=4,
        initializer_range=0.05,
    ),
    # The 1.19B configuration whose transformers + peft figures on the H200 are in FACTS.md.
    "inkling-small": dict(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        swa_num_attention_heads=16,
        swa_num_key_value_heads=4,
        swa_head_dim=128,
        sliding_window_size=512,
        rel_extent=1024,
        mlp_layer_types=["dense"] + ["sparse"] * 15,
        intermediate_size=5632,
        moe_intermediate_size=512,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        max_position_embeddings=4096,
    ),
}

SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def preset_config(name: str) -> "InklingTextConfig":
    """The transformers config of a preset; raises KeyError naming the known presets."""
    from transformers import InklingTextConfig  # here, not above: the preset names need no torch

    from inkwell.models.tokenizer import VOCAB_SIZE as TOKENIZER_VOCAB

    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    kwargs = dict(PRESETS[name])
    assert kwargs["vocab_size"] >= TOKENIZER_VOCAB
    return InklingTextConfig(**kwargs, **SPECIAL_IDS)
