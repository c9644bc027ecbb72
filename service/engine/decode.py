"""A decode forward fit for CUDA graph capture: one token per sequence, fixed shapes, no host sync.

A CUDA graph replays a fixed list of kernels on fixed buffers, so the step it captures may neither
read device values on the host nor branch in Python on data. This is `InklingModel.forward`
restricted to decode and rewritten to that rule (same arithmetic, same helpers where they already
obey it):
  - the batch is a bucket of fixed size: padding rows decode token 0 at position 0 in a scratch
    state slot with no adapter, so they never touch a real sequence's state;
  - full-attention layers attend over a fixed number of keys (`context`) masked by position,
    sliding layers over their whole ring as before;
  - routed experts run as grouped GEMMs over device offsets (tokens sorted by expert on the
    device), or where no capturable grouped GEMM exists (it needs bf16 on sm90+), as one batched
    GEMM of every expert over every token;
  - LoRA always goes through the kernels (rows of slot -1 are untouched), with no "any adapter?"
    check; the caller picks a forward without LoRA on the host when no row has an adapter.
With the model's `lora_stream` set, the LoRA shrinks that read only a layer's input run on the
side stream while the router and the base expert GEMMs run.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkwell.kernels import expert_lora_shrink, lora_expand
from inkwell.service.engine.lora import LoraSlots
from inkwell.service.engine.model import CONV_NAMES, Dispatch, InklingModel, rms_norm
from inkwell.service.engine.state import StatePool


def grouped_mm_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs without a host sync: its CUDA fallback copies the offsets to the
    host, and only bf16 on sm90/sm100 takes the fused path. On the CPU nothing is captured."""
    if device.type != "cuda":
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


@dataclass
class DecodeInputs:
    """The device inputs of one batch bucket, in one [4, B] long tensor so the host fills them in one copy."""

    packed: torch.Tensor  # rows: input ids, sequence slots, positions, LoRA slots (-1 = base model)

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> "DecodeInputs":
        return cls(torch.zeros(4, batch, dtype=torch.long, device=device))

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def seq_slots(self) -> torch.Tensor:
        return self.packed[1]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[2]

    @property
    def lora_slots(self) -> torch.Tensor:
        return self.packed[3]


class DecodeForward:
    """The capturable decode forward of `model` over `state`, with `lora` slots (None: base model only)."""

    def __init__(self, model: InklingModel, state: StatePool, lora: LoraSlots | None, grouped_mm: bool | None = None):
        self.model = model
        self.state = state
        self.lora = lora
        cfg = model.config
        aligned = cfg.hidden_size % 8 == 0 and cfg.moe_intermediate_size % 8 == 0  # 16-byte rows for the GEMM
        if grouped_mm is None:
            grouped_mm = aligned and grouped_mm_capturable(model.dtype, model.device)
        self.grouped_mm = grouped_mm
        device = model.device
        self.ring = torch.arange(state.window, device=device)
        self.key_positions = torch.arange(state.max_context, device=device)
        self.expert_ids = torch.arange(cfg.n_routed_experts, device=device)

    @torch.inference_mode()
    def __call__(self, inputs: DecodeInputs, context: int, use_lora: bool = True) -> torch.Tensor:
        """fp32 next-token logits [B, vocab] of every row; full-attention keys cover positions < `context`,
        which must exceed every row's position. Updates each row's sequence state."""
        m, cfg = self.model, self.model.config
        lora = self.lora if use_lora else None
        slots = inputs.lora_slots
        h = F.embedding(inputs.input_ids, m.w["model.embed_tokens.weight"])
        h = rms_norm(h, m.w["model.embed_tokens.embed_norm.weight"], m.eps)
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}"
            x = rms_norm(h, m.w[f"{p}.input_layernorm.weight"], m.eps)
            x = self._attention(x, layer, inputs, context, lora)
            h = h + self._sconv(x, layer, 2, inputs.seq_slots)
            x = rms_norm(h, m.w[f"{p}.post_attention_layernorm.weight"], m.eps)
            if cfg.mlp_layer_types[layer] == "dense":
                x = m._dense_mlp(x, layer, slots, lora)
            else:
                x = self._moe(x, layer, slots, lora)
            h = h + self._sconv(x, layer, 3, inputs.seq_slots)
        h = rms_norm(h, m.w["model.norm.weight"], m.eps) / cfg.logits_mup_width_multiplier
        logits = m._linear(h, "lm_head", slots, lora)
        if cfg.unpadded_vocab_size is not None and cfg.unpadded_vocab_size < logits.shape[-1]:
            logits = logits[:, : cfg.unpadded_vocab_size]
        return logits.float()

    # ---- ShortConv and attention ----------------------------------------------------------------

    def _sconv(self, x: torch.Tensor, layer: int, site: int, seq_slots: torch.Tensor) -> torch.Tensor:
        """One step of each row's causal conv: its saved inputs plus this one (fp32), plus the residual."""
        weight = self.model.w[f"model.layers.{layer}.{CONV_NAMES[site]}.conv1d.weight"]
        saved = self.state.conv[layer][site]
        xf = x.float()
        window = torch.cat([saved[seq_slots], xf[:, :, None]], dim=-1)  # [B, C, kernel]
        out = F.conv1d(window, weight, groups=window.shape[1])[:, :, 0]
        saved[seq_slots] = window[:, :, 1:]
        return (out + xf).to(x.dtype)

    def _attention(
        self, h: torch.Tensor, layer: int, inputs: DecodeInputs, context: int, lora: LoraSlots | None
    ) -> torch.Tensor:
        m, cfg, state = self.model, self.model.config, self.state
        p = f"model.layers.{layer}.self_attn"
        slots, seq, pos = inputs.lora_slots, inputs.seq_slots, inputs.positions
        sliding = state.sliding[layer]
        head_dim = cfg.swa_head_dim if sliding else cfg.head_dim
        rows = h.shape[0]
        q, k, v, r = m.qkvr(h, layer, slots, lora)
        k = self._sconv(k, layer, 0, seq)
        v = self._sconv(v, layer, 1, seq)
        q = rms_norm(q.view(rows, -1, head_dim), m.w[f"{p}.q_norm.weight"], m.eps)
        k = rms_norm(k.view(rows, -1, head_dim), m.w[f"{p}.k_norm.weight"], m.eps)
        v = v.view(rows, -1, head_dim)
        r = r.view(rows, q.shape[1], -1)
        if sliding:
            window = state.window
            state.keys[layer][seq, pos % window] = k
            state.values[layer][seq, pos % window] = v
            keys, values = state.keys[layer][seq], state.values[layer][seq]
            k_pos = pos[:, None] - (pos[:, None] - self.ring[None]) % window
        else:
            state.keys[layer][seq, pos] = k
            state.values[layer][seq, pos] = v
            keys, values = state.keys[layer][seq, :context], state.values[layer][seq, :context]
            k_pos = self.key_positions[None, :context].expand(rows, -1)
        out = m._attend(layer, q[:, None], keys, values, r[:, None], pos[:, None], k_pos, valid=k_pos >= 0)
        return m._linear(out[:, 0].reshape(rows, -1), f"{p}.o_proj", slots, lora)

    # ---- MoE ------------------------------------------------------------------------------------

    def _moe(self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
        m = self.model
        p = f"model.layers.{layer}.mlp"
        side = m.lora_stream if lora is not None else None
        if side is None:
            shrunk = m.expert_input_shrinks(x, layer, slots, lora)
        else:
            with side.fork():
                shrunk = m.expert_input_shrinks(x, layer, slots, lora)
        index, weights, gammas = m._route(x, layer)
        rows = Dispatch.of(index, weights, slots)
        experts, tokens = rows.experts, rows.tokens
        gate_w, up_w, down_w = (
            m.w[f"{p}.experts.{proj}"].transpose(1, 2) for proj in ("gate_proj", "up_proj", "down_proj")
        )
        if self.grouped_mm:
            offsets = torch.searchsorted(experts, self.expert_ids, right=True, out_int32=True)
            xs = x[tokens]
            gate = torch._grouped_mm(xs, gate_w, offs=offsets)
            up = torch._grouped_mm(xs, up_w, offs=offsets)
        else:  # every expert on every token, then each dispatched row's own
            gate = torch.matmul(x, gate_w)[experts, tokens]
            up = torch.matmul(x, up_w)[experts, tokens]
        if side is not None:
            side.join()
        m.gate_up_lora(shrunk, f"{p}.experts", lora, rows.slots, experts, gate, up, tokens)
        act = F.silu(gate) * up
        if self.grouped_mm:
            down = torch._grouped_mm(act, down_w, offs=offsets)
        else:  # top-k experts are distinct, so each (expert, token) cell holds one dispatched row
            cells = act.new_zeros(down_w.shape[0], x.shape[0], act.shape[1])
            cells[experts, tokens] = act
            down = torch.matmul(cells, down_w)[experts, tokens]
        routed = m.combine_routed(x, layer, rows, down, act, slots, lora)
        return routed + self._shared_experts(x, layer, gammas, slots, lora, shrunk)

    def _shared_experts(
        self,
        x: torch.Tensor,
        layer: int,
        gammas: torch.Tensor,
        slots: torch.Tensor,
        lora: LoraSlots | None,
        shrunk: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Every shared expert on every token in batched GEMMs; its LoRA rows stacked expert-major."""
        m = self.model
        p = f"model.layers.{layer}.mlp.shared_experts"
        n_shared, tokens = self.model.config.n_shared_experts, x.shape[0]
        ids = self.expert_ids[:n_shared].repeat_interleave(tokens)
        slots_n = slots.repeat(n_shared)
        gate = torch.matmul(x, m.w[f"{p}.gate_proj"].transpose(1, 2))  # [n_shared, T, f]
        up = torch.matmul(x, m.w[f"{p}.up_proj"].transpose(1, 2))
        repeated = {mod: y.repeat(n_shared, 1) for mod, y in shrunk.items() if mod.startswith(f"{p}.")}  # expert-major
        flat = [t.view(n_shared * tokens, -1) for t in (gate, up)]
        m.gate_up_lora(repeated, p, lora, slots_n, ids, *flat)
        act = F.silu(gate) * up * gammas.t()[:, :, None]
        out = torch.matmul(act, m.w[f"{p}.down_proj"].transpose(1, 2)).float().sum(0).to(x.dtype)
        down_buf = lora.buffers.get(f"{p}.down_proj") if lora is not None else None
        if down_buf is not None:
            y = expert_lora_shrink(act.view(n_shared * tokens, -1), down_buf.a, slots_n, ids)
            lora_expand(y.view(n_shared, tokens, -1).sum(0), down_buf.b, slots, down_buf.scalings, out)
        return out
