"""A decode forward fit for CUDA graph capture: one token per sequence, fixed shapes, no host sync.

A CUDA graph replays a fixed list of kernels on fixed buffers, so the step it captures may neither
read device values on the host nor branch in Python on data. This is `InklingModel.forward`
restricted to decode and rewritten to that rule (same arithmetic, same helpers where they already
obey it):
  - the batch is a bucket of fixed size: padding rows decode token 0 at position 0 in a scratch
    state slot with no adapter, so they never touch a real sequence's state;
  - full-attention layers attend over a fixed number of keys (`context`) masked by position,
    sliding layers over their whole ring as before;
  - routed and shared experts (one id space) run as grouped GEMMs over device offsets (rows sorted
    by expert on the device), or where no capturable grouped GEMM exists (it needs bf16 on sm90+),
    as one batched GEMM of every expert over every token;
  - LoRA always goes through the kernels (rows of slot -1 are untouched), with no "any adapter?"
    check; the caller picks a forward without LoRA on the host when no row has an adapter;
  - on CUDA, each ShortConv step (with the residual add and the next RMSNorm), the attention's prologue (the K/V
    ShortConv, the Q/K norms and the cache write) and each attention over the cache are one Triton kernel
    (`inkwell.kernels.triton_short_conv`, `triton_attention_prologue`, `triton_decode_attention`), and so are the
    MoE layer's head (the router's gate GEMM, the routing and the dispatch: `kernels.triton_route_dispatch`), its
    combine, silu * up and expert GEMMs (`kernels.triton_moe`), rounding where the torch ops round (668 launches a
    step for inkling-small with the torch ops, 239 with the first of these kernels); with adapters the experts'
    LoRA adds no launch: the gate/up shrink runs in programs of the MoE head, the down shrink in silu * up, the
    expands in the GEMMs' epilogues. The combine runs inside the ShortConv step after the MoE layer
    (`Uncombined`), summing as the combine kernel of the eager forward sums, so the two round alike.
Past `few_tokens`, with the model's `lora_stream` set, the experts' gate/up LoRA shrink (it reads only the layer's
input) runs on the side stream while the router and the gate/up GEMM run.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkwell.kernels import RowExpand
from inkwell.serving.native.lora import ExpertLora, LoraSlots
from inkwell.serving.native.model import Dispatch, InklingModel, expert_gemm, few_tokens, rms_norm
from inkwell.serving.native.state import ATTN_SITE, KV_SITE, MLP_SITE, StatePool
from inkwell.serving.native.streams import SideStream


def grouped_mm_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs without a host sync: its CUDA fallback copies the offsets to the
    host, and only bf16 on sm90/sm100 takes the fused path. On the CPU nothing is captured."""
    if device.type != "cuda":
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


@dataclass(frozen=True)
class Uncombined:
    """A MoE layer's down rows [T*k, H] not yet combined per token: on CUDA the ShortConv step after the layer sums
    each token's rows as it loads its input (`short_conv_step(combine=...)`), one launch fewer per MoE layer."""

    rows: torch.Tensor
    dispatch: Dispatch
    tokens: int

    def combined(self) -> torch.Tensor:
        """The combine itself [T, H], in the rows' dtype (where no kernel takes it in)."""
        return self.dispatch.combine(self.rows, self.tokens, self.rows.dtype)


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

    # the MoE's combine inside the ShortConv step after it (rows without a down LoRA left to the combine); the
    # chunked forward's ShortConv kernels do not combine
    combine_in_sconv = True

    def __init__(self, model: InklingModel, state: StatePool, lora: LoraSlots | None, grouped_mm: bool | None = None):
        self.model = model
        self.state = state
        self.lora = lora
        if grouped_mm is None:
            grouped_mm = model.grouped_mm and grouped_mm_capturable(model.dtype, model.device)
        self.grouped_mm = grouped_mm
        # 0, 1, ...: ring places, key positions, rows and the like, sliced on the device
        self.offsets = torch.arange(max(state.max_context, state.window, state.max_seqs), device=model.device)

    @torch.inference_mode()
    def __call__(
        self, inputs: DecodeInputs, context: int, use_lora: bool = True, routing: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Next-token logits [B, vocab] of every row in the model's dtype (`sampling.greedy_scores` makes them fp32
        with each row's greedy token); full-attention keys cover positions < `context`, which must exceed every
        row's position. Updates each row's sequence state. Each MoE layer's routed expert ids [B, top_k] are
        appended to `routing` where one is given (in layer order)."""
        routing = [] if routing is None else routing
        m, cfg = self.model, self.model.config
        lora = self.lora if use_lora else None
        slots = self._row_lora_slots(inputs)
        h, x = m.embed(self._row_ids(inputs))
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}"
            out = self._attention(x, layer, inputs, slots, context, lora)
            h, x = self._sconv_add_norm(out, h, layer, ATTN_SITE, inputs, f"{p}.post_attention_layernorm.weight")
            if cfg.mlp_layer_types[layer] == "dense":
                out = m.dense_mlp(x, layer, slots, lora)
            else:
                out = self._moe(x, layer, slots, lora, routing)
            last = layer + 1 == cfg.num_hidden_layers
            norm = "model.norm.weight" if last else f"model.layers.{layer + 1}.input_layernorm.weight"
            h, x = self._sconv_add_norm(out, h, layer, MLP_SITE, inputs, norm)
        x, slots = self._scored(x, slots, inputs)
        logits = m.linear(x / cfg.logits_mup_width_multiplier, "lm_head", slots, lora)
        if cfg.unpadded_vocab_size is not None and cfg.unpadded_vocab_size < logits.shape[-1]:
            logits = logits[:, : cfg.unpadded_vocab_size]
        return logits

    # ---- rows: one per sequence here; `extend.ExtendForward` has a chunk of tokens per sequence -----------------

    def _row_ids(self, inputs: DecodeInputs) -> torch.Tensor:
        return inputs.input_ids

    def _row_lora_slots(self, inputs: DecodeInputs) -> torch.Tensor:
        return inputs.lora_slots

    def _scored(self, x: torch.Tensor, slots: torch.Tensor, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows whose next-token logits the step returns, and their LoRA slots: every row."""
        return x, slots

    # ---- ShortConv and attention ----------------------------------------------------------------

    def _sconv(self, x: torch.Tensor, layer: int, site: int, inputs: DecodeInputs) -> torch.Tensor:
        """One step of each row's causal conv: its saved inputs plus this one (fp32), plus the residual."""
        seq_slots = inputs.seq_slots
        if x.is_cuda:
            return self._sconv_kernel(x, layer, site, seq_slots)
        weight = self.model.sconv_weight(layer, site)
        saved = self.state.conv[layer][site]
        xf = x.float()
        window = torch.cat([saved[seq_slots], xf[:, :, None]], dim=-1)  # [B, C, kernel]
        out = F.conv1d(window, weight, groups=window.shape[1])[:, :, 0]
        saved[seq_slots] = window[:, :, 1:]
        return (out + xf).to(x.dtype)

    def _sconv_add_norm(
        self, x: torch.Tensor | Uncombined, h: torch.Tensor, layer: int, site: int, inputs: DecodeInputs, norm: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h plus the site's ShortConv of the block output x (or of the combine of `Uncombined`
        rows), and that sum's RMSNorm by weight `norm` (the next block's input): one kernel on CUDA."""
        m = self.model
        residual_norm = dict(residual=h, norm_weight=m.w[norm], eps=m.eps)
        if isinstance(x, Uncombined):
            if x.rows.is_cuda:
                combine = (x.dispatch.weights, x.dispatch.places)
                return self._sconv_kernel(x.rows, layer, site, inputs.seq_slots, combine=combine, **residual_norm)
            x = x.combined()
        if x.is_cuda:
            return self._sconv_kernel(x, layer, site, inputs.seq_slots, **residual_norm)
        h = h + self._sconv(x, layer, site, inputs)
        return h, rms_norm(h, m.w[norm], m.eps)

    def _sconv_kernel(self, x: torch.Tensor, layer: int, site: int, seq_slots: torch.Tensor, **residual_norm):
        """The site's ShortConv step as one Triton kernel (Triton is imported once a CUDA tensor arrives)."""
        from inkwell.kernels.triton_short_conv import short_conv_step

        weight = self.model.sconv_weight(layer, site)
        return short_conv_step(x, self.state.conv[layer][site], seq_slots, weight, **residual_norm)

    def _qkvr(
        self, h: torch.Tensor, layer: int, inputs: DecodeInputs, slots: torch.Tensor, lora: LoraSlots | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row's queries, keys and values [rows, heads, head dim] (q and k normalised, k and v through their
        ShortConv) and relative-logit inputs r [rows, heads, d_rel] of attention layer `layer`."""
        m, cfg = self.model, self.model.config
        p = f"model.layers.{layer}.self_attn"
        head_dim = cfg.swa_head_dim if self.state.sliding[layer] else cfg.head_dim
        rows = h.shape[0]
        q, kv, r = m.qkvr(h, layer, slots, lora)
        k, v = self._sconv(kv, layer, KV_SITE, inputs).split(m.kv_splits[layer], dim=-1)
        q = rms_norm(q.view(rows, -1, head_dim), m.w[f"{p}.q_norm.weight"], m.eps)
        k = rms_norm(k.view(rows, -1, head_dim), m.w[f"{p}.k_norm.weight"], m.eps)
        return q, k, v.view(rows, -1, head_dim), r.view(rows, q.shape[1], -1)

    def _attention(
        self,
        h: torch.Tensor,
        layer: int,
        inputs: DecodeInputs,
        slots: torch.Tensor,
        context: int,
        lora: LoraSlots | None,
    ) -> torch.Tensor:
        m, state = self.model, self.state
        seq, pos = inputs.seq_slots, inputs.positions
        sliding = state.sliding[layer]
        rows = h.shape[0]
        window = state.window
        if h.is_cuda:
            q, r = self._prologue_kernel(h, layer, inputs, slots, lora)
            out = self._attend_kernel(q, r, layer, seq, pos, window if sliding else context, sliding)
        else:
            q, k, v, r = self._qkvr(h, layer, inputs, slots, lora)
            places = pos % window if sliding else pos
            state.keys[layer][seq, places] = k
            state.values[layer][seq, places] = v
            if sliding:
                keys, values = state.keys[layer][seq], state.values[layer][seq]
                k_pos = pos[:, None] - (pos[:, None] - self.offsets[None, :window]) % window
            else:
                keys, values = state.keys[layer][seq, :context], state.values[layer][seq, :context]
                k_pos = self.offsets[None, :context].expand(rows, -1)
            out = m.attend(layer, q[:, None], keys, values, r[:, None], pos[:, None], k_pos, valid=k_pos >= 0)[:, 0]
        return m.linear(out.reshape(rows, -1), f"model.layers.{layer}.self_attn.o_proj", slots, lora)

    def _prologue_kernel(
        self, h: torch.Tensor, layer: int, inputs: DecodeInputs, slots: torch.Tensor, lora: LoraSlots | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_qkvr` and the row's key and value into the cache, as the q/k/v/r GEMM and one Triton kernel (CUDA):
        q normalized [rows, heads, head dim] and r [rows, heads, d_rel]."""
        from inkwell.kernels.triton_attention_prologue import decode_attention_prologue

        m, state = self.model, self.state
        p = f"model.layers.{layer}.self_attn"
        sliding = state.sliding[layer]
        qkvr = m.qkvr_proj(h, layer, slots, lora)
        q_cols, kv_cols, _ = m.qkvr_splits[layer]
        heads = q_cols // (m.config.swa_head_dim if sliding else m.config.head_dim)
        q = decode_attention_prologue(
            qkvr,
            heads,
            state.conv[layer][KV_SITE],
            m.sconv_weight(layer, KV_SITE),
            m.w[f"{p}.q_norm.weight"],
            m.w[f"{p}.k_norm.weight"],
            m.eps,
            state.keys[layer],
            state.values[layer],
            inputs.seq_slots,
            inputs.positions,
            state.window if sliding else None,
        )
        return q, qkvr[:, q_cols + kv_cols :].view(qkvr.shape[0], heads, -1)

    def _attend_kernel(
        self,
        q: torch.Tensor,
        r: torch.Tensor,
        layer: int,
        seq: torch.Tensor,
        pos: torch.Tensor,
        entries: int,
        sliding: bool,
    ) -> torch.Tensor:
        """`InklingModel.attend` of one query per row as one Triton kernel over the cache in place (CUDA)."""
        from inkwell.kernels.triton_decode_attention import decode_attention

        proj = self.model.w[f"model.layers.{layer}.self_attn.rel_logits_proj.proj"]
        keys, values = self.state.keys[layer], self.state.values[layer]
        return decode_attention(q, r, keys, values, proj, seq, pos, entries, sliding, self.model.log_scaling)

    # ---- MoE ------------------------------------------------------------------------------------

    def _moe(
        self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None, routing: list[torch.Tensor]
    ) -> torch.Tensor | Uncombined:
        """Routed and shared experts (one id space) as one gate/up and one down GEMM over the dispatched rows; the
        routed ids [B, top_k] are appended to `routing`. Their rows are left `Uncombined` for the ShortConv step
        after the layer, unless the combine has a down LoRA to add."""
        m = self.model
        experts = lora.experts.get(layer) if lora is not None else None
        few = few_tokens(x)  # then the MoE head computes the gate/up shrink (`route_and_dispatch`)
        side = m.lora_stream if experts is not None and not few else None
        shrunk = None
        if side is not None:
            with side.fork():
                shrunk = m.expert_shrink(x, slots, experts)
        elif not few:
            shrunk = m.expert_shrink(x, slots, experts)
        index, rows, head_shrunk = m.route_and_dispatch(x, layer, slots, experts)
        routing.append(index[:, : m.config.num_experts_per_tok])
        if few:
            down, down_lora = m.few_experts(x, layer, rows, slots, experts, head_shrunk)
        else:
            down, down_lora = self._many_experts(x, layer, rows, shrunk, experts, side)
        if self.combine_in_sconv and down_lora is None and down.dtype == x.dtype:
            return Uncombined(down, rows, x.shape[0])
        return rows.combine(down, x.shape[0], x.dtype, down_lora)

    def _many_experts(
        self,
        x: torch.Tensor,
        layer: int,
        rows: Dispatch,
        shrunk: torch.Tensor | None,
        experts: ExpertLora | None,
        side: SideStream | None,
    ) -> tuple[torch.Tensor, RowExpand | None]:
        """`InklingModel.run_experts` past `few_tokens`, capturable: the grouped GEMM where it needs no host sync,
        else every expert over every token and each dispatched row's own; `shrunk` is joined from `side` after the
        gate/up GEMM."""

        def gemm(inputs: torch.Tensor, weight: torch.Tensor, gather: bool) -> torch.Tensor:
            if self.grouped_mm:
                return expert_gemm(inputs[rows.tokens] if gather else inputs, weight, rows.ends, None)
            if gather:  # every expert on every token, then each dispatched row's own
                return torch.matmul(inputs, weight.transpose(1, 2))[rows.experts, rows.tokens]
            # a token's experts are distinct, so each (expert, token) cell holds one dispatched row
            cells = inputs.new_zeros(weight.shape[0], x.shape[0], inputs.shape[1])
            cells[rows.experts, rows.tokens] = inputs
            return torch.matmul(cells, weight.transpose(1, 2))[rows.experts, rows.tokens]

        join = side.join if side is not None else None
        return self.model.experts_then_lora(x, layer, rows, shrunk, experts, gemm, join)
