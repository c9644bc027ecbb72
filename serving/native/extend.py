"""A prefill forward fit for CUDA graph capture: a chunk of up to L tokens per sequence, continuing its state.

An eager prefill step of a 1B model is bound by its host work (hundreds of launches, index tables built in Python):
about 40 ms on an H200 whether it computes 16 tokens or 2,000. That is the whole time to first token of a request
whose prompt mostly comes from the prefix cache, or of a chat turn with a short new message. This forward runs
such steps with fixed shapes so that `graphs.StepGraphs` can capture them: B chunks (a bucket; padding chunks
have length 0 and the scratch slot) of L token places each (a bucket; places past a chunk's length are padding),
each continuing its sequence from its first position. It is `DecodeForward` with rows that are tokens of chunks
instead of one token per sequence, and the same arithmetic as `InklingModel.forward`'s chunk path:
  - ShortConv: each chunk's saved inputs, then its tokens, through the depthwise conv; the state it carries on
    is the last kernel-1 inputs up to its real length (gathered on the device);
  - full-attention layers: the chunk's keys and values are written to its slot first, then every query attends
    over a fixed number of keys (`context`) masked by position, as decode does;
  - sliding layers: queries attend over the ring as it was before the chunk plus the chunk's own keys, and then
    the chunk's last window of keys is written to the ring (writing first would overwrite keys earlier queries
    of a chunk longer than the free part of the ring still see);
  - padding tokens write their keys and values to the scratch slot only, and only each chunk's last real row
    gets logits;
  - on CUDA each ShortConv (with the residual add and the next RMSNorm) and each attention over the chunks is one
    Triton kernel (`kernels.triton_short_conv.short_conv_chunks`, `kernels.triton_prefill_attention`), which reads
    the history in place; the chunk's keys are written after it on every layer.
Experts, projections and LoRA are `DecodeForward`'s, over all B*L rows.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkwell.serving.native.decode import DecodeForward
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import InklingModel, rms_norm
from inkwell.serving.native.state import StatePool


@dataclass
class ExtendInputs:
    """The device inputs of one (B, L) bucket in one flat long tensor, so the host fills them in one copy: the B
    chunks' L token ids each (padding after a chunk's real ones), then B sequence slots, first positions, real
    lengths and LoRA slots (-1 = base model). Each part is a contiguous view, as the LoRA kernels read slots."""

    packed: torch.Tensor
    batch: int
    length: int

    @classmethod
    def empty(cls, batch: int, length: int, device: torch.device) -> "ExtendInputs":
        return cls(torch.zeros(batch * (length + 4), dtype=torch.long, device=device), batch, length)

    @staticmethod
    def host(
        input_ids: list[int], columns: list[tuple[int, int, int, int]], batch: int, length: int, scratch: int
    ) -> torch.Tensor:
        """The host side of `packed` for chunks given by their `columns` (sequence slot, first position, real length,
        LoRA slot), whose tokens follow one another in `input_ids` (at most `length` each), padded to `batch`
        chunks: padding chunks have no real tokens, the scratch slot and no adapter."""
        pad = batch - len(columns)
        tokens, first = [], 0
        for _, _, real, _ in columns:
            tokens += [*input_ids[first : first + real], *[0] * (length - real)]
            first += real
        tokens += [0] * (pad * length)
        defaults = (scratch, 0, 0, -1)
        return torch.tensor(
            tokens + [v for j, default in enumerate(defaults) for v in [c[j] for c in columns] + [default] * pad],
            dtype=torch.long,
        )

    def _column(self, j: int) -> torch.Tensor:
        first = self.batch * (self.length + j)
        return self.packed[first : first + self.batch]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed[: self.batch * self.length].view(self.batch, self.length)

    @property
    def seq_slots(self) -> torch.Tensor:
        return self._column(0)

    @property
    def starts(self) -> torch.Tensor:
        return self._column(1)

    @property
    def lengths(self) -> torch.Tensor:
        return self._column(2)

    @property
    def lora_slots(self) -> torch.Tensor:
        return self._column(3)


class ExtendForward(DecodeForward):
    """The capturable chunk forward of `model` over `state`; padding tokens write only to state slot `scratch`."""

    combine_in_sconv = False

    def __init__(
        self,
        model: InklingModel,
        state: StatePool,
        lora: LoraSlots | None,
        scratch: int,
        grouped_mm: bool | None = None,
    ):
        super().__init__(model, state, lora, grouped_mm)
        self.scratch = scratch

    # ---- rows: L token places per chunk ------------------------------------------------------------------

    def _row_ids(self, inputs: ExtendInputs) -> torch.Tensor:
        return inputs.input_ids.reshape(-1)

    def _row_lora_slots(self, inputs: ExtendInputs) -> torch.Tensor:
        # contiguous, as the LoRA kernels read slots (with one chunk, reshape would keep the broadcast view)
        return inputs.lora_slots[:, None].expand(-1, inputs.length).contiguous().view(-1)

    def _scored(self, x: torch.Tensor, slots: torch.Tensor, inputs: ExtendInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's last real row (a padding chunk's first), with the chunk's LoRA slot."""
        last = (inputs.lengths - 1).clamp(min=0)
        return x[self.offsets[: len(last)] * inputs.length + last], inputs.lora_slots

    def _positions(self, inputs: ExtendInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token place's position [B, L] in its sequence, and whether it holds a real token [B, L]."""
        places = self.offsets[: inputs.length]
        return inputs.starts[:, None] + places, places < inputs.lengths[:, None]

    # ---- ShortConv over chunks ---------------------------------------------------------------------------

    def _sconv(self, x: torch.Tensor, layer: int, site: int, inputs: ExtendInputs) -> torch.Tensor:
        """Each chunk's causal conv continuing its saved inputs (fp32), plus the residual; saves the last kernel-1
        inputs up to the chunk's real length."""
        if x.is_cuda:
            return self._sconv_chunks(x, layer, site, inputs)
        weight = self.model.sconv_weight(layer, site)
        saved = self.state.conv[layer][site]
        batch, length = inputs.input_ids.shape
        xf = x.float()
        channels = xf.shape[1]
        seq = torch.cat([saved[inputs.seq_slots], xf.view(batch, length, channels).transpose(1, 2)], dim=-1)
        out = F.conv1d(seq, weight, groups=channels).transpose(1, 2).reshape(batch * length, channels)
        keep = saved.shape[-1]
        tail = inputs.lengths[:, None] + self.offsets[None, :keep]  # [B, keep]: in seq, the inputs carried on
        saved[inputs.seq_slots] = seq.gather(-1, tail[:, None, :].expand(-1, channels, -1))
        return (out + xf).to(x.dtype)

    def _sconv_add_norm(
        self, x: torch.Tensor, h: torch.Tensor, layer: int, site: int, inputs: ExtendInputs, norm: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        if x.is_cuda:
            return self._sconv_chunks(x, layer, site, inputs, residual=h, norm_weight=m.w[norm], eps=m.eps)
        h = h + self._sconv(x, layer, site, inputs)
        return h, rms_norm(h, m.w[norm], m.eps)

    def _sconv_chunks(
        self,
        x: torch.Tensor,
        layer: int,
        site: int,
        inputs: ExtendInputs,
        residual: torch.Tensor | None = None,
        **norm,
    ):
        """The site's ShortConv over the chunks as one Triton kernel (CUDA), with the residual add and the next
        RMSNorm (`norm`: its weight and eps) where a `residual` is given; rows flat [B*L, C] in and out."""
        from inkwell.kernels.triton_short_conv import short_conv_chunks

        batch, length = inputs.input_ids.shape
        tables = [None if t is None else t.view(batch, length, t.shape[-1]) for t in (x, residual)]
        weight, saved = self.model.sconv_weight(layer, site), self.state.conv[layer][site]
        out = short_conv_chunks(tables[0], saved, inputs.seq_slots, inputs.lengths, weight, tables[1], **norm)
        if residual is None:
            return out.view(batch * length, -1)
        return tuple(t.view(batch * length, -1) for t in out)

    # ---- attention over chunks -------------------------------------------------------------------------

    def _attention(
        self,
        h: torch.Tensor,
        layer: int,
        inputs: ExtendInputs,
        slots: torch.Tensor,
        context: int,
        lora: LoraSlots | None,
    ) -> torch.Tensor:
        m, state = self.model, self.state
        sliding = state.sliding[layer]
        batch, length = inputs.input_ids.shape
        q, k, v, r = (t.view(batch, length, *t.shape[1:]) for t in self._qkvr(h, layer, inputs, slots, lora))
        positions, real = self._positions(inputs)
        seq = inputs.seq_slots
        cache_k, cache_v = state.keys[layer], state.values[layer]
        window = state.window
        if h.is_cuda:  # one kernel, reading each chunk's history in place; its own keys are written after it
            out = m.attend_chunks(layer, q, k, v, r, seq, inputs.starts, inputs.lengths, state)
        elif sliding:
            last = (inputs.starts - 1)[:, None]  # ring place i holds the latest position <= last at i mod window
            ring_pos = last - (last - self.offsets[None, :window]) % window
            keys, values = torch.cat([cache_k[seq], k], dim=1), torch.cat([cache_v[seq], v], dim=1)
            k_pos = torch.cat([ring_pos, positions], dim=1)
            out = m.attend(layer, q, keys, values, r, positions, k_pos, valid=k_pos >= 0)
        if sliding:
            real = real & (self.offsets[None, :length] >= inputs.lengths[:, None] - window)  # a window at most
            places = positions % window
        else:
            places = positions
        # padding tokens (and on a sliding layer the real ones the ring cannot keep) go to the scratch slot
        write_slots = torch.where(real, seq[:, None], self.scratch)
        write_places = torch.where(real, places, self.offsets[None, :length] % cache_k.shape[1])
        cache_k[write_slots, write_places] = k
        cache_v[write_slots, write_places] = v
        if not sliding and not h.is_cuda:
            k_pos = self.offsets[None, :context].expand(batch, -1)
            out = m.attend(layer, q, cache_k[seq, :context], cache_v[seq, :context], r, positions, k_pos)
        return m.linear(out.reshape(batch * length, -1), f"model.layers.{layer}.self_attn.o_proj", slots, lora)
