"""Inkling as a megatron-core model assembled from ModuleSpecs.

`inkling_layer_spec` describes a decoder layer: attention (q/k/v/r column-parallel, o
row-parallel, ShortConv on the K and V streams before the Q/K RMSNorms, relative-logits bias,
log scaling on full layers), ShortConv on the attention and MLP outputs, and a dense MLP or the
MoE. `build_module` instantiates the spec; every leaf is a megatron tensor-parallel linear or
one of Inkling's own parts in `layers` / `moe`. The forward reproduces transformers'
`InklingForCausalLM` (eager attention) on unpacked input, and runs packed batches segment-aware.

Sequence parallelism (megatron's meaning, over the TP group): between the attention and MLP blocks
the residual stream is split over the TP ranks along the flattened (batch, sequence) tokens and
the norms run on the local shard. Each block all-gathers its normed input once (feeding every
column-parallel projection and its LoRA A), and its partial row-parallel sum is reduce-scattered.
The ShortConv after a block needs the whole sequence in time order; it is linear in its input
(residual included, per-sample taps), so it runs on the rank's partial sum before the
reduce-scatter: conv(sum_r P_r) = sum_r conv(P_r). megatron's own sequence-parallel linears would
gather per projection and reduce-scatter before the conv, so they run with sequence_parallel off
and the layer does the communication.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer import ModuleSpec, TransformerConfig, build_module
from torch import nn
from transformers import InklingTextConfig

from inkwell.adapters.spec import LoraSpec
from inkwell.models.checkpoint import TP_SIZES
from inkwell.trainer.layers import Packing, RelativeLogits, RMSNorm, ShortConv, causal_skew
from inkwell.trainer.lora import LoraSettings, ParallelLinear, mark
from inkwell.trainer.moe import InklingMoE
from inkwell.trainer.parallel import gather_tokens, scatter_tokens, tp_group


@dataclass
class Build:
    """Everything a submodule needs to construct itself on this rank."""

    hf: InklingTextConfig
    mc: TransformerConfig
    lora: LoraSpec | None
    dtype: torch.dtype
    device: torch.device
    tp: int = 1
    ep: int = 1
    ep_rank: int = 0
    attention: str = "eager"
    sequence_parallel: bool = False

    def lora_for(self, group: str) -> LoraSettings | None:
        if self.lora is None or group not in self.lora.targets:
            return None
        return LoraSettings(self.lora.rank_for(group), self.lora.scaling_for(group), self.lora.dropout)


def megatron_config(hf: InklingTextConfig, tp: int, ep: int, dtype: torch.dtype, device: str) -> TransformerConfig:
    """megatron-core's TransformerConfig for the parallel linears; weights come from the bridge."""
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        ffn_hidden_size=hf.intermediate_size,
        num_moe_experts=hf.n_routed_experts,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=False,
        sequence_parallel=False,
        add_bias_linear=False,
    )


@dataclass
class AttentionSubmodules:
    linear_q: ModuleSpec
    linear_k: ModuleSpec
    linear_v: ModuleSpec
    linear_r: ModuleSpec
    linear_o: ModuleSpec
    kv_sconv: type = ShortConv
    qk_norm: type = RMSNorm
    rel_logits: type = RelativeLogits


class InklingAttention(nn.Module):
    """Relative-logits attention over this rank's heads (sliding or full, log-scaled when full)."""

    def __init__(self, build: Build, layer: int, submodules: AttentionSubmodules):
        super().__init__()
        cfg, tp = build.hf, build.tp
        prefix = f"model.layers.{layer}.self_attn"
        self.sliding = cfg.layer_types[layer] == "hybrid_sliding"
        heads = cfg.swa_num_attention_heads if self.sliding else cfg.num_attention_heads
        kv = cfg.swa_num_key_value_heads if self.sliding else cfg.num_key_value_heads
        self.head_dim = cfg.swa_head_dim if self.sliding else cfg.head_dim
        self.heads, self.kv_heads = heads // tp, kv // tp
        self.window = cfg.sliding_window_size if self.sliding else None
        extent = cfg.sliding_window_size if self.sliding else cfg.rel_extent
        self.log_floor = None if self.sliding else cfg.log_scaling_n_floor
        self.log_alpha = cfg.log_scaling_alpha
        h, hd, lora = cfg.hidden_size, self.head_dim, build.lora_for("attn")
        kw = {"config": build.mc, "lora": lora, "sequence_parallel": build.sequence_parallel}
        self.q_proj = build_module(submodules.linear_q, h, heads * hd, hf_name=f"{prefix}.q_proj", **kw)
        self.k_proj = build_module(submodules.linear_k, h, kv * hd, hf_name=f"{prefix}.k_proj", **kw)
        self.v_proj = build_module(submodules.linear_v, h, kv * hd, hf_name=f"{prefix}.v_proj", **kw)
        self.r_proj = build_module(submodules.linear_r, h, heads * cfg.d_rel, hf_name=f"{prefix}.r_proj", **kw)
        self.o_proj = build_module(submodules.linear_o, heads * hd, h, hf_name=f"{prefix}.o_proj", **kw)
        conv = {"kernel": cfg.conv_kernel_size, "shard_tp": tp, "device": build.device}
        self.k_sconv = build_module(submodules.kv_sconv, kv * hd, hf_name=f"{prefix}.k_sconv", **conv)
        self.v_sconv = build_module(submodules.kv_sconv, kv * hd, hf_name=f"{prefix}.v_sconv", **conv)
        norm = {"eps": cfg.rms_norm_eps, "dtype": build.dtype, "device": build.device}
        self.q_norm = build_module(submodules.qk_norm, hd, hf_name=f"{prefix}.q_norm", **norm)
        self.k_norm = build_module(submodules.qk_norm, hd, hf_name=f"{prefix}.k_norm", **norm)
        self.attend = ATTENTION[build.attention]
        self.rel_logits = build_module(
            submodules.rel_logits, cfg.d_rel, extent, f"{prefix}.rel_logits_proj", build.dtype, build.device
        )

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_sconv(self.k_proj(x), packing).view(b, s, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = self.v_sconv(self.v_proj(x), packing).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        tau = None
        if self.log_floor is not None:
            n = (packing.positions + 1).float()
            tau = (1.0 + self.log_alpha * torch.log((n / self.log_floor).clamp(min=1.0)))[:, None, :, None]
            q = (q.float() * tau).to(q.dtype)
        rel = self.rel_logits(self.r_proj(x).view(b, s, self.heads, -1), tau)
        out = self.attend(q, k, v, rel, packing.masks[self.window], 1.0 / self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def relative_bias(rel: torch.Tensor) -> torch.Tensor:
    """The (query, distance) table [b, h, s, extent] as a (query, key) bias [b, h, s, s], 0 past the extent."""
    s = rel.shape[-2]
    return causal_skew(F.pad(rel, (0, s - rel.shape[-1])))


def eager_attention(q, k, v, rel, allowed, scaling: float) -> torch.Tensor:
    """transformers' eager attention: scores*scale + bias, masked, fp32 softmax, GQA by expansion."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling + relative_bias(rel)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def sdpa_attention(q, k, v, rel, allowed, scaling: float) -> torch.Tensor:
    """The same attention through torch's fused SDPA kernels, bias and mask passed as one float mask."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = relative_bias(rel).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)


ATTENTION = {"eager": eager_attention, "sdpa": sdpa_attention}


class DenseMLP(nn.Module):
    """SwiGLU with column-parallel gate/up, row-parallel down, times the learned global scale."""

    def __init__(self, build: Build, layer: int):
        super().__init__()
        cfg, prefix = build.hf, f"model.layers.{layer}.mlp"
        kw = {"config": build.mc, "lora": build.lora_for("mlp"), "sequence_parallel": build.sequence_parallel}
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ParallelLinear(h, f, parallel="column", hf_name=f"{prefix}.gate_proj", **kw)
        self.up_proj = ParallelLinear(h, f, parallel="column", hf_name=f"{prefix}.up_proj", **kw)
        self.down_proj = ParallelLinear(f, h, parallel="row", hf_name=f"{prefix}.down_proj", **kw)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=build.dtype, device=build.device), requires_grad=False)
        mark(self.global_scale, f"{prefix}.global_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * self.global_scale


@dataclass
class DecoderLayerSubmodules:
    self_attention: ModuleSpec
    mlp: type
    input_layernorm: type = RMSNorm
    attn_sconv: type = ShortConv
    pre_mlp_layernorm: type = RMSNorm
    mlp_sconv: type = ShortConv


class InklingDecoderLayer(nn.Module):
    """norm -> attention -> ShortConv -> +residual; norm -> MLP/MoE -> ShortConv -> +residual.

    Under sequence parallelism x is this rank's [tokens / tp, hidden] shard of the residual stream.
    """

    def __init__(self, build: Build, layer: int, submodules: DecoderLayerSubmodules):
        super().__init__()
        cfg, prefix = build.hf, f"model.layers.{layer}"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = {"eps": eps, "dtype": build.dtype, "device": build.device}
        conv = {"kernel": cfg.conv_kernel_size, "device": build.device}
        self.input_layernorm = build_module(submodules.input_layernorm, h, hf_name=f"{prefix}.input_layernorm", **norm)
        self.self_attn = build_module(submodules.self_attention, build, layer)
        self.attn_sconv = build_module(submodules.attn_sconv, h, hf_name=f"{prefix}.attn_sconv", **conv)
        self.post_attention_layernorm = build_module(
            submodules.pre_mlp_layernorm, h, hf_name=f"{prefix}.post_attention_layernorm", **norm
        )
        self.mlp = build_module(submodules.mlp, build, layer)
        self.mlp_sconv = build_module(submodules.mlp_sconv, h, hf_name=f"{prefix}.mlp_sconv", **conv)
        self.sequence_parallel = build.sequence_parallel

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        if self.sequence_parallel:
            x = x + self._sp_block(self.input_layernorm(x), packing, self.self_attn, self.attn_sconv, packing)
            return x + self._sp_block(self.post_attention_layernorm(x), packing, self.mlp, self.mlp_sconv)
        h = self.attn_sconv(self.self_attn(self.input_layernorm(x), packing), packing)
        x = x + h
        h = self.mlp_sconv(self.mlp(self.post_attention_layernorm(x)), packing)
        return x + h

    @staticmethod
    def _sp_block(local: torch.Tensor, packing: Packing, block: nn.Module, conv: ShortConv, *args) -> torch.Tensor:
        """Gather the normed shard, run the block to this rank's partial sum, ShortConv it, reduce-scatter."""
        b, s = packing.segments.shape
        full = gather_tokens(local, tp_group()).view(b, s, -1)
        partial = conv(block(full, *args), packing)
        return scatter_tokens(partial.view(b * s, -1), tp_group()).to(local.dtype)


def inkling_layer_spec(hf: InklingTextConfig, layer: int) -> ModuleSpec:
    """The ModuleSpec of decoder layer `layer`: dense MLP or MoE as the config says."""
    column = ModuleSpec(ParallelLinear, params={"parallel": "column"})
    row = ModuleSpec(ParallelLinear, params={"parallel": "row"})
    attention = ModuleSpec(
        InklingAttention,
        submodules=AttentionSubmodules(column, column, column, column, row),
    )
    mlp = DenseMLP if hf.mlp_layer_types[layer] == "dense" else InklingMoE
    return ModuleSpec(InklingDecoderLayer, submodules=DecoderLayerSubmodules(self_attention=attention, mlp=mlp))


class InklingGPT(nn.Module):
    """Embedding (vocab-parallel) + embed norm, decoder layers from specs, final norm, muP-scaled LM head.

    With `sequence_parallel` (needs tp > 1) the embedding output is split over the TP ranks before its
    norm and the final norm's output is all-gathered for the LM head.
    """

    def __init__(
        self,
        hf: InklingTextConfig,
        lora: LoraSpec | None,
        dtype: torch.dtype,
        device: str,
        attention: str = "eager",
        compile_mode: str | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        problem = layout_problem(hf, tp, ep)
        if problem:
            raise ValueError(problem[1])
        if sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the TP group; it needs tp > 1")
        mc = megatron_config(hf, tp, ep, dtype, device)
        dev = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        ep_rank = ps.get_expert_model_parallel_rank()
        build = Build(hf, mc, lora, dtype, dev, tp, ep, ep_rank, attention, sequence_parallel)
        self.config = hf
        self.sequence_parallel = sequence_parallel
        self.windows = tuple({None if t != "hybrid_sliding" else hf.sliding_window_size for t in hf.layer_types})
        self.embed_tokens = tensor_parallel.VocabParallelEmbedding(
            hf.vocab_size, hf.hidden_size, init_method=lambda _: None, config=mc
        )
        self.embed_tokens.weight.requires_grad_(False)
        mark(self.embed_tokens.weight, "model.embed_tokens.weight", tp_dim=0)
        norm = {"eps": hf.rms_norm_eps, "dtype": dtype, "device": dev}
        self.embed_norm = RMSNorm(hf.hidden_size, hf_name="model.embed_tokens.embed_norm", **norm)
        self.layers = nn.ModuleList(
            build_module(inkling_layer_spec(hf, i), build, i) for i in range(hf.num_hidden_layers)
        )
        self.norm = RMSNorm(hf.hidden_size, hf_name="model.norm", **norm)
        head_lora = build.lora_for("lm_head")
        self.lm_head = ParallelLinear(
            hf.hidden_size,
            hf.vocab_size,
            config=mc,
            parallel="column",
            hf_name="lm_head",
            lora=head_lora,
            sequence_parallel=sequence_parallel,
        )
        if compile_mode is not None:
            compile_decoder_layers(self.layers, compile_mode)

    def forward(self, input_ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel logits [b, s, V/tp] of (packed) token ids; segments [b, s] mark samples."""
        if segments is None:
            segments = torch.zeros_like(input_ids)
        packing = Packing.build(segments, self.config.conv_kernel_size, self.windows)
        x = self.embed_tokens(input_ids)
        b, s, h = x.shape
        if self.sequence_parallel:  # the embedding is frozen: a plain slice, no gradient flows back through it
            tp = ps.get_tensor_model_parallel_world_size()
            if b * s % tp:
                raise ValueError(f"sequence_parallel: batch*seq tokens ({b}*{s}) must split evenly over tp={tp}")
            n, rank = b * s // tp, ps.get_tensor_model_parallel_rank()
            x = x.view(b * s, h)[rank * n : (rank + 1) * n]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, packing)
        x = self.norm(x) / self.config.logits_mup_width_multiplier
        if self.sequence_parallel:
            x = gather_tokens(x, tp_group()).view(b, s, h)
        return self.lm_head(x)

    def set_attention(self, name: str) -> None:
        """Switch every layer to another attention function of `ATTENTION` (same math, other kernels)."""
        for layer in self.layers:
            layer.self_attn.attend = ATTENTION[name]

    def routers(self) -> dict[int, nn.Module]:
        return {i: layer.mlp.router for i, layer in enumerate(self.layers) if isinstance(layer.mlp, InklingMoE)}


def compile_decoder_layers(layers: nn.ModuleList, mode: str = "default") -> None:
    """torch.compile each layer in place (parameter names unchanged): one fused graph per layer, which
    "reduce-overhead" also replays as a CUDA graph. Layers of one kind share a graph; the limit is
    raised so every kind (dense/MoE x sliding/full x train/eval x attention function) gets its own."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in layers:
        layer.compile(dynamic=False, mode=mode)


def layout_problem(hf: InklingTextConfig, tp: int, ep: int) -> tuple[str, str] | None:
    """(field, message) when tp/ep cannot split this model evenly, else None."""
    for name in (*TP_SIZES, "vocab_size"):
        value = getattr(hf, name)
        if value % tp:
            return "tp", f"tp: {tp} does not divide the model's {name} ({value}); choose a tp that does"
    if hf.n_routed_experts % ep:
        return "ep", f"ep: {ep} does not divide the model's n_routed_experts ({hf.n_routed_experts}); choose another ep"
    return None
