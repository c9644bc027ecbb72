"""The LoRA targets of an Inkling model, by transformers' module names, with their shapes.

An adapter's tensors are keyed by canonical names: the transformers module path of the
adapted weight followed by `.lora_A` or `.lora_B`. Linear targets hold A [r, in] and
B [out, r]. Expert groups use the shared-outer factorization, the same for routed experts
(count E) and shared experts (count S):

    gate_proj / up_proj:  lora_A [r, H] shared by all experts,  lora_B [E, F, r] per expert
    down_proj:            lora_A [E, r, F] per expert,           lora_B [H, r] shared

so expert e's delta is B_e @ A (gate/up) or B @ A_e (down), times alpha / r.
"""

from dataclasses import dataclass

from transformers import InklingTextConfig

from inkwell.adapters.spec import LoraSpec

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    """One adapted weight: its module path, group, kind and factor shapes."""

    module: str  # e.g. "model.layers.1.mlp.experts.gate_proj"
    group: str
    kind: str  # "linear" | "expert_in" (gate/up: shared A) | "expert_out" (down: shared B)
    layer: int | None
    proj: str
    in_features: int
    out_features: int
    num_experts: int = 0

    def shapes(self, r: int) -> dict[str, tuple[int, ...]]:
        i, o, e = self.in_features, self.out_features, self.num_experts
        if self.kind == "linear":
            return {"lora_A": (r, i), "lora_B": (o, r)}
        if self.kind == "expert_in":
            return {"lora_A": (r, i), "lora_B": (e, o, r)}
        return {"lora_A": (e, r, i), "lora_B": (o, r)}


def _attn_dims(config: InklingTextConfig, layer: int) -> dict[str, tuple[int, int]]:
    sliding = config.layer_types[layer] == "hybrid_sliding"
    heads = config.swa_num_attention_heads if sliding else config.num_attention_heads
    kv = config.swa_num_key_value_heads if sliding else config.num_key_value_heads
    hd = config.swa_head_dim if sliding else config.head_dim
    h = config.hidden_size
    return {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "r_proj": (h, heads * config.d_rel),
        "o_proj": (heads * hd, h),
    }


def model_targets(config: InklingTextConfig, spec: LoraSpec) -> list[Target]:
    """Every weight `spec` adapts in a model of `config`, in a stable order."""
    h = config.hidden_size
    out: list[Target] = []
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        if "attn" in spec.targets:
            for proj, (i, o) in _attn_dims(config, layer).items():
                out.append(Target(f"{prefix}.self_attn.{proj}", "attn", "linear", layer, proj, i, o))
        dense = config.mlp_layer_types[layer] == "dense"
        if dense and "mlp" in spec.targets:
            f = config.intermediate_size
            for proj, (i, o) in {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}.items():
                out.append(Target(f"{prefix}.mlp.{proj}", "mlp", "linear", layer, proj, i, o))
        if dense:
            continue
        f = config.moe_intermediate_size
        for group, sub, count in (
            ("experts", "experts", config.n_routed_experts),
            ("shared_experts", "shared_experts", config.n_shared_experts),
        ):
            if group not in spec.targets:
                continue
            out.append(Target(f"{prefix}.mlp.{sub}.gate_proj", group, "expert_in", layer, "gate_proj", h, f, count))
            out.append(Target(f"{prefix}.mlp.{sub}.up_proj", group, "expert_in", layer, "up_proj", h, f, count))
            out.append(Target(f"{prefix}.mlp.{sub}.down_proj", group, "expert_out", layer, "down_proj", f, h, count))
    if "lm_head" in spec.targets:
        out.append(Target("lm_head", "lm_head", "linear", None, "lm_head", h, config.vocab_size))
    return out


def expected_shapes(config: InklingTextConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape for an adapter of `spec` on `config`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for t in model_targets(config, spec):
        for factor, shape in t.shapes(spec.rank_for(t.group)).items():
            shapes[f"{t.module}.{factor}"] = shape
    return shapes
