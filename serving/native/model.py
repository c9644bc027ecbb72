"""Inkling's forward pass over a flat batch of token chunks, with per-token multi-LoRA.

A step's batch is the concatenation of chunks of many sequences (a prefill chunk or one decode
token each); projections, the router and the experts run on all tokens at once, and LoRA deltas
are added through `inkwell.kernels` with a per-token slot index, so one launch serves every
adapter in the batch. Attention and ShortConv read and update each sequence's state in
`StatePool`. The arithmetic follows transformers' eager `InklingForCausalLM` step by step, with
one regrouping: the shared experts run as experts E..E+n-1 beside the routed ones (their gammas are
their routing weights), so both take the same dispatch, grouped GEMMs and LoRA kernels. On CUDA the ShortConv
sites, the attention over prefill chunks (`attend_chunks`; `attend` is their reference) and the MoE rows (dispatch,
combine, silu * up, and at decode sizes the expert GEMMs: `kernels.moe_dispatch` and its neighbours) are Triton
kernels.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import InklingTextConfig

from inkwell.kernels import (
    EXPERT_MATMUL_MAX_TOKENS,
    RowExpand,
    TokenShrink,
    expert_lora_shrink,
    expert_matmul,
    gate_route,
    gate_route_dispatch,
    linear,
    lora_expand_sliced,
    lora_linear,
    lora_shrink,
    moe_combine,
    moe_dispatch,
    one_launch_projection,
    silu_mul,
    silu_mul_shrink,
)
from inkwell.serving.native.lora import ExpertLora, LoraSlots, SlotBuffer, StackedBuffer
from inkwell.serving.native.state import ATTN_SITE, KV_SITE, MLP_SITE, StatePool
from inkwell.serving.native.streams import SideStream
from inkwell.serving.slot_copy import QKVR_STACK

CONV_NAMES = ("self_attn.k_sconv", "self_attn.v_sconv", "attn_sconv", "mlp_sconv")
# The weights of the ShortConv sites, in `StatePool.conv`'s order (KV_SITE, ATTN_SITE, MLP_SITE); k and v sit
# side by side in the q/k/v/r output, so their convs run as one.
SCONV_SITES = ("self_attn.kv_sconv", "attn_sconv", "mlp_sconv")
PAD_POSITION = 2**40  # the position of a padding key: later than any query, so the causal mask hides it


@dataclass(frozen=True)
class Segment:
    """A chunk of one sequence: `length` tokens starting at position `start`, state in `seq_slot`."""

    seq_slot: int
    start: int
    length: int


@dataclass(frozen=True)
class Singles:
    """The one-token segments of a batch (decode steps), handled together: rows, state slots, positions."""

    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    max_position: int


def segment_columns(segments: list[tuple[int, Segment]]) -> tuple[torch.Tensor, ...]:
    """Host tensors [n] of the (batch row, segment) pairs' first rows, state slots, starts and lengths, each
    contiguous (a kernel reads them by flat index, and `.to` keeps a strided column strided on the CPU)."""
    columns = torch.tensor([(row, seg.seq_slot, seg.start, seg.length) for row, seg in segments])
    return columns.t().contiguous().unbind(0)


@dataclass(frozen=True)
class Chunks:
    """A group of a batch's multi-token segments (prefill), each with its first row, and the same as padded
    [B, L] tables, so that ShortConv and attention run once for the group. Padding goes on the right, where
    neither a causal conv nor a causal query of a real token looks. A group of chunks of one length back to back in
    the batch is flat: its table is a view of the batch's rows."""

    segments: list[tuple[int, Segment]]
    rows: torch.Tensor  # [B, L] long: the batch row of chunk b's token j (padding repeats the chunk's last row)
    positions: torch.Tensor  # [B, L] long: the token's position in its sequence (padding counts on)
    real: torch.Tensor  # [n] long: the real tokens' places in the flattened [B*L] table
    real_rows: torch.Tensor  # [n] long: their batch rows
    slots: torch.Tensor  # [B] long: state slots
    starts: torch.Tensor  # [B] long: each chunk's first position
    lengths: torch.Tensor  # [B] long: its real tokens
    first: int | None  # where the group is flat, its first batch row
    _cache_index: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, segments: list[tuple[int, Segment]], device: torch.device) -> "Chunks":
        """The group of `segments` (batch row, segment); its index tables built on the host by tensor ops (a prefill
        of 8 x 1,024 tokens took ~25 ms of the host in Python lists) and copied over."""
        segments = sorted(segments, key=lambda segment: segment[0])  # in batch order, so that a flat group is a view
        firsts, slots, starts, lengths = segment_columns(segments)
        width = int(lengths.max())
        j = torch.arange(width)
        rows = firsts[:, None] + torch.minimum(j, lengths[:, None] - 1)
        real = (j < lengths[:, None]).flatten().nonzero()[:, 0]
        back_to_back = firsts == firsts[0] + width * torch.arange(len(segments))
        flat = bool((lengths == width).all()) and bool(back_to_back.all())
        tables = dict(rows=rows, positions=starts[:, None] + j, real=real, real_rows=rows.flatten()[real])
        columns = dict(slots=slots, starts=starts, lengths=lengths)
        return cls(
            segments=segments,
            **{name: t.to(device) for name, t in (tables | columns).items()},
            first=int(firsts[0]) if flat else None,
        )

    def history(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(state slots, cache places, positions), each [B, H], of the cached keys each chunk sees before its
        own: all earlier positions, or with a sliding `window` the last window-1. None when no chunk has any."""
        return self._memo(("history", window), lambda: self._history(window))

    def stored(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch rows, state slots, positions) of the tokens whose keys and values a cache keeps: every token,
        or with a sliding `window` each chunk's last `window` (their ring places are then distinct)."""
        return self._memo(("stored", window), lambda: tuple(t.to(self.rows.device) for t in self._kept(window)))

    def kept(self, x: torch.Tensor, window: int | None) -> torch.Tensor:
        """The rows of per-token x [T, ...] that `stored(window)` lists, in its order: a view where the group is flat
        and keeps every token (no window, or chunks no longer than it)."""
        if self.first is not None and (window is None or self.rows.shape[1] <= window):
            return x[self.first : self.first + self.rows.numel()]
        return x[self.stored(window)[0]]

    def conv_tail(self, keep: int) -> torch.Tensor:
        """[B, keep]: where each chunk's last `keep` inputs sit in its ShortConv window (saved inputs, then the
        chunk), the state the conv carries to the sequence's next step."""
        return self._memo(
            ("conv_tail", keep),
            lambda: torch.tensor(
                [[seg.length + i for i in range(keep)] for _, seg in self.segments], device=self.rows.device
            ),
        )

    def _kept(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        firsts, slots, starts, lengths = segment_columns(self.segments)
        j = torch.arange(int(lengths.max()))
        kept = j < lengths[:, None]
        if window is not None:
            kept &= j >= lengths[:, None] - window
        chunk, j = kept.nonzero(as_tuple=True)
        return firsts[chunk] + j, slots[chunk], starts[chunk] + j

    def _history(self, window: int | None) -> tuple[torch.Tensor, ...] | None:
        firsts = [0 if window is None else max(0, seg.start - (window - 1)) for _, seg in self.segments]
        depth = max(seg.start - first for first, (_, seg) in zip(firsts, self.segments, strict=True))
        if depth == 0:
            return None
        rows = []
        for first, (_, seg) in zip(firsts, self.segments, strict=True):
            seen = range(first, seg.start)
            places = [p % window if window else p for p in seen] + [0] * (depth - len(seen))
            rows.append(([seg.seq_slot] * depth, places, [*seen] + [PAD_POSITION] * (depth - len(seen))))
        return self._columns(rows)

    def _columns(self, rows: list[tuple]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.tensor(column, device=self.rows.device) for column in zip(*rows, strict=True))

    def _memo[T](self, key: tuple, build: Callable[[], T]) -> T:
        """Index tensors are built on the host once per batch, not once per layer."""
        if key not in self._cache_index:
            self._cache_index[key] = build()
        return self._cache_index[key]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token rows x [T, ...] as the padded table [B, L, ...] (a view of x where the group is flat)."""
        if self.first is not None:
            return x[self.first : self.first + self.rows.numel()].unflatten(0, tuple(self.rows.shape))
        return x[self.rows]

    def scatter(self, table: torch.Tensor, out: torch.Tensor) -> None:
        """Write the real tokens of a padded table [B, L, ...] to their rows of out [T, ...]."""
        if self.first is not None:
            out[self.first : self.first + self.rows.numel()] = table.flatten(0, 1)
        else:
            out[self.real_rows] = table.flatten(0, 1)[self.real]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    lora_slots: torch.Tensor  # [T] long, -1 = base model
    segments: list[Segment]  # in the order of their tokens in input_ids
    logit_rows: torch.Tensor  # [N] long: rows whose next-token logits are returned

    @cached_property
    def split(self) -> tuple[Singles | None, list[Chunks]]:
        """One-token segments as one vectorized group, and the longer chunks in padded groups."""
        rows, singles, chunks, row = [], [], [], 0
        for seg in self.segments:
            if seg.length == 1:
                rows.append(row)
                singles.append(seg)
            else:
                chunks.append((row, seg))
            row += seg.length
        device = self.input_ids.device
        groups = [Chunks.of(group, device) for group in padded_groups(chunks)]
        if not singles:
            return None, groups
        group = Singles(
            rows=torch.tensor(rows, device=device),
            slots=torch.tensor([s.seq_slot for s in singles], device=device),
            positions=torch.tensor([s.start for s in singles], device=device),
            max_position=max(s.start for s in singles),
        )
        return group, groups

    @cached_property
    def whole(self) -> Chunks | None:
        """The batch's one group where that group is flat and holds every row (prompts of one length, no decode
        rows): the kernels' [B, L] outputs are then the batch's rows, with nothing to scatter."""
        singles, groups = self.split
        if singles is None and len(groups) == 1 and groups[0].first == 0:
            return groups[0] if groups[0].rows.numel() == self.input_ids.shape[0] else None
        return None


def padded_groups(chunks: list[tuple[int, Segment]], waste: float = 2.0) -> list[list[tuple[int, Segment]]]:
    """Chunks in groups that run padded together, each padded to its longest chunk and deepest history at no more
    than `waste` times the group's real tokens and attention cells, so one long chunk among short ones (or one
    with a long history among new prompts) is not copied out to every row of the group."""
    groups: list[list[tuple[int, Segment]]] = []
    for chunk in sorted(chunks, key=lambda c: (-(c[1].start + c[1].length), -c[1].length)):
        group = [*groups[-1], chunk] if groups else []
        segs = [seg for _, seg in group]
        length, keys = max((s.length for s in segs), default=0), max((s.start + s.length for s in segs), default=0)
        tokens, cells = sum(s.length for s in segs), sum(s.length * (s.start + s.length) for s in segs)
        if group and len(segs) * length <= waste * tokens and len(segs) * length * keys <= waste * cells:
            groups[-1] = group
        else:
            groups.append([chunk])
    return groups


def few_tokens(x: torch.Tensor) -> bool:
    """Whether the experts' GEMMs over tokens x run as `expert_matmul`'s kernel (CUDA, decode-sized batches): the
    eager forward and the captured ones take the same kernels, so they round alike."""
    return x.is_cuda and x.shape[0] <= EXPERT_MATMUL_MAX_TOKENS


def expert_gemm(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """Dispatched rows [M, K] sorted by expert times their expert's weight [E, N, K]: one grouped GEMM over the
    row counts `ends` (cumulative per expert), or with the same counts on the host (`bounds`) one GEMM per
    expert, for rows torch._grouped_mm cannot take (not 16-byte aligned)."""
    if bounds is None:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    for expert, (start, end) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
    return out


@dataclass(frozen=True)
class Dispatch:
    """(token, expert) rows sorted by expert: each row's place in the token-major order, token, expert, weight
    and LoRA slot, where each expert's rows end, and where each token-major row went. Shared experts are experts
    too (ids after the routed ones, weight = their gamma)."""

    order: torch.Tensor
    tokens: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor
    ends: torch.Tensor  # int32 [experts]: ends[e] = rows of experts <= e (grouped GEMM offsets)
    places: torch.Tensor  # [T*k]: the sorted place of token-major row i (the inverse of `order`)

    @classmethod
    def of(cls, index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, num_experts: int) -> "Dispatch":
        """From each token's expert ids (0 .. num_experts - 1; larger ids sort last, as one) and weights [T, k] and
        the tokens' LoRA slots [T], with no host sync: one Triton program on CUDA (`kernels.moe_dispatch`)."""
        return cls(*moe_dispatch(index, weights, slots, num_experts))

    def head(self, count: int) -> "Dispatch":
        """The first `count` rows (those of the first experts), for running them alone; `order` and `places` stay
        all rows'."""
        return replace(
            self,
            tokens=self.tokens[:count],
            experts=self.experts[:count],
            weights=self.weights[:count],
            slots=self.slots[:count],
        )

    def combine(
        self, out: torch.Tensor, tokens: int, dtype: torch.dtype = torch.float32, down: RowExpand | None = None
    ) -> torch.Tensor:
        """Each token's rows of `out` [M, H] with the experts' `down` LoRA of them (`InklingModel.down_lora`),
        weighted and summed in fp32 in the token's own order (deterministic, unlike an index_add): [T, H] in
        `dtype`."""
        return moe_combine(out, self.weights, self.places, tokens, dtype, down)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Inkling RMSNorm: normalized in fp32, rounded to x's dtype, then scaled by the weight.

    On CUDA one Triton kernel (`kernels.triton_rms_norm`: one pass where the torch ops take four); on the CPU the
    plain ops (torch.rms_norm's composite is up to 2.8x slower there, bitwise the same result)."""
    if x.is_cuda:
        from inkwell.kernels.triton_rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps)
    xf = x.float()
    normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


class InklingModel:
    """Base weights of one Inkling model and its forward over a `ForwardBatch`.

    Its per-layer parts (`linear`, `qkvr`, `attend`, `dense_mlp`, `route`, the experts' LoRA steps, `sconv_weight`)
    are public: the eager `forward` and the capturable decode forward (`decode.DecodeForward`) are both built
    from them."""

    def __init__(
        self,
        config: InklingTextConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.w: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():  # one at a time: a BaseCheckpoint reads each only here
            keep_fp32 = any(f".{conv}." in name for conv in CONV_NAMES)
            self.w[name] = tensor.to(device=self.device, dtype=torch.float32 if keep_fp32 else dtype)
        # Shared experts are experts E .. E+n-1 after the routed ones, so one grouped GEMM serves both:
        # all_experts.gate_up_proj [E+n, 2F, H] (gate rows, then up) and all_experts.down_proj [E+n, H, F].
        for layer in range(config.num_hidden_layers):
            if config.mlp_layer_types[layer] == "dense":
                continue
            p = f"model.layers.{layer}.mlp"
            shared = [self.w.pop(f"{p}.shared_experts.{proj}") for proj in ("gate_proj", "up_proj", "down_proj")]
            gate_up = torch.cat([self.w.pop(f"{p}.experts.gate_up_proj"), torch.cat(shared[:2], dim=1)])
            self.w[f"{p}.all_experts.gate_up_proj"] = gate_up
            self.w[f"{p}.all_experts.down_proj"] = torch.cat([self.w.pop(f"{p}.experts.down_proj"), shared[2]])
        self.num_experts = config.n_routed_experts + config.n_shared_experts  # routed, then shared
        # q, k, v and r as one weight: one GEMM, whose output columns split as views into q, k and v together,
        # and r; k and v then share one ShortConv (their weights back to back, like their channels).
        self.qkvr_splits: list[list[int]] = []
        self.kv_splits: list[list[int]] = []
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}"
            names = [f"{p}.{proj}.weight" for proj in QKVR_STACK]
            q, k, v, r = (self.w[n].shape[0] for n in names)
            self.qkvr_splits.append([q, k + v, r])
            self.kv_splits.append([k, v])
            self.w[f"{p}.self_attn.qkvr_proj.weight"] = torch.cat([self.w.pop(n) for n in names])
            kv_convs = [self.w.pop(f"{p}.{site}.conv1d.weight") for site in CONV_NAMES[:2]]
            self.w[f"{p}.{SCONV_SITES[KV_SITE]}.conv1d.weight"] = torch.cat(kv_convs)
        self.eps = config.rms_norm_eps
        # The experts' gate/up and down as one grouped GEMM each over the dispatched rows, where rows are 16-byte
        # aligned as torch._grouped_mm wants; otherwise one GEMM per expert.
        self.grouped_mm = config.hidden_size % 8 == 0 and config.moe_intermediate_size % 8 == 0
        # CUDA only: where set, each projection's LoRA runs beside its base GEMM (see `linear`).
        self.lora_stream: SideStream | None = None

    # ---- projections with LoRA -------------------------------------------------------------

    def linear(self, x: torch.Tensor, module: str, slots: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
        """x @ W^T plus each token's LoRA delta."""
        buf = lora.buffers.get(module) if lora is not None else None
        return self._project(x, self.w[f"{module}.weight"], slots, buf)

    def qkvr(self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None) -> list[torch.Tensor]:
        """q, k and v together, and r: column views of `qkvr_proj`'s one output."""
        return self.qkvr_proj(x, layer, slots, lora).split(self.qkvr_splits[layer], dim=-1)

    def qkvr_proj(self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
        """The q, k, v and r projections as one GEMM and one sliced LoRA launch: [T, q | k | v | r] columns."""
        p = f"model.layers.{layer}"
        modules = tuple(f"{p}.{proj}" for proj in QKVR_STACK)
        stack = lora.stacks.get(modules) if lora is not None else None  # None: attn not adapted
        return self._project(x, self.w[f"{p}.self_attn.qkvr_proj.weight"], slots, stack)

    def _project(
        self, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, buf: SlotBuffer | StackedBuffer | None
    ) -> torch.Tensor:
        """x @ W^T plus each token's (sliced) LoRA delta from `buf`.

        At decode sizes on CUDA (`one_launch_projection`) this is one Triton GEMM: the shrink beside it, the
        expand in its epilogue. Otherwise, with `lora_stream`, the shrink runs on the side stream while the base
        GEMM runs, and after the join the expand adds into the GEMM's output in place: the same kernels in the
        same order on each output as `lora_linear`'s, so the result is bitwise its.
        """
        if buf is None:
            return linear(x, weight)
        offsets = buf.slice_offsets
        if self.lora_stream is None or one_launch_projection(x, weight.shape[0]):
            return lora_linear(x, weight, buf.a, buf.b, slots, buf.scalings, offsets)
        with self.lora_stream.fork():
            shrunk = lora_shrink(x, buf.a, slots)
        y = F.linear(x, weight)
        self.lora_stream.join()
        return lora_expand_sliced(shrunk, buf.b, slots, buf.scalings, y, offsets)

    # ---- experts with LoRA: routed and shared experts as one id space ---------------------------

    @staticmethod
    def expert_shrink(x: torch.Tensor, slots: torch.Tensor, experts: ExpertLora | None) -> torch.Tensor | None:
        """The tokens' x @ A of every expert group's gate and up (shared A), in one launch: [T, 2*G*R]."""
        return None if experts is None else lora_shrink(x, experts.gate_up.a, slots)

    @staticmethod
    def gate_up_act(
        gate_up: torch.Tensor, shrunk: torch.Tensor | None, rows: Dispatch, experts: ExpertLora | None
    ) -> torch.Tensor:
        """silu(gate) * up of the dispatched rows, each row's gate/up LoRA (its expert's B over its token's `shrunk`
        row) added as silu * up reads the rows, where an in-place expand would read and write every row once more
        (49,152 x 1,024 a MoE layer at 8 x 1,024 tokens)."""
        if experts is None:
            return silu_mul(gate_up)
        buf = experts.gate_up
        expand = RowExpand(shrunk, buf.b, rows.slots, rows.experts, buf.scalings, experts.groups)
        return silu_mul(gate_up, expand, rows.tokens)

    @staticmethod
    def down_lora(act: torch.Tensor, rows: Dispatch, experts: ExpertLora | None) -> RowExpand | None:
        """The down LoRA of the dispatched rows over their `act`, left for the combine (`Dispatch.combine`): each
        row's act shrunk by its expert's A here; its group's B, shared by the group's experts, then expands each
        token's weighted sum of its rows' y once instead of every row's (a sixth of the rows at prefill, and no
        in-place pass over them)."""
        if experts is None:
            return None
        buf = experts.down
        y = expert_lora_shrink(act, buf.a, rows.slots, rows.experts, experts.groups)
        return RowExpand(y, buf.b, rows.slots, rows.experts, buf.scalings, experts.groups)

    # ---- ShortConv and attention, per sequence ----------------------------------------------

    def sconv_weight(self, layer: int, site: int) -> torch.Tensor:
        """The depthwise conv weight [C, 1, kernel] of ShortConv site `site` (KV_SITE, ATTN_SITE, MLP_SITE)."""
        return self.w[f"model.layers.{layer}.{SCONV_SITES[site]}.conv1d.weight"]

    @property
    def log_scaling(self) -> tuple[float, float] | None:
        """(n_floor, alpha) of the full layers' log scaling, as the attention kernels take it; None: none."""
        cfg = self.config
        return None if cfg.log_scaling_n_floor is None else (cfg.log_scaling_n_floor, cfg.log_scaling_alpha)

    def _sconv(self, x: torch.Tensor, layer: int, site: int, batch: ForwardBatch, state: StatePool) -> torch.Tensor:
        """Causal depthwise conv over each sequence's chunk continuing its saved inputs, plus the residual (fp32);
        on CUDA a Triton kernel for the one-token rows and one for each padded group of chunks."""
        if x.is_cuda:
            return self._sconv_kernels(x, layer, site, batch, state)[0]
        weight = self.sconv_weight(layer, site)
        saved = state.conv[layer][site]
        xf = x.float()
        out = torch.empty_like(xf)
        singles, groups = batch.split
        if singles is not None:
            seq = torch.cat([saved[singles.slots], xf[singles.rows, :, None]], dim=-1)  # [D, C, kernel]
            out[singles.rows] = F.conv1d(seq, weight, groups=seq.shape[1])[:, :, 0]
            saved[singles.slots] = seq[:, :, 1:]
        for chunks in groups:  # all chunks at once, padded on the right (a causal conv never reads ahead)
            seq = torch.cat([saved[chunks.slots], chunks.gather(xf).transpose(1, 2)], dim=-1)  # [B, C, keep + L]
            chunks.scatter(F.conv1d(seq, weight, groups=seq.shape[1]).transpose(1, 2), out)
            tail = chunks.conv_tail(saved.shape[-1])[:, None, :].expand(-1, seq.shape[1], -1)
            saved[chunks.slots] = seq.gather(-1, tail)
        return (out + xf).to(x.dtype)

    def sconv_add_norm(
        self, x: torch.Tensor, h: torch.Tensor, layer: int, site: int, batch: ForwardBatch, state: StatePool, norm: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h plus the site's ShortConv of the block output x, and that sum's RMSNorm by weight
        `norm` (the next block's input). On CUDA the ShortConv kernels add and normalize as they write their rows,
        so the stream is read and written once where torch's add and norm take five passes."""
        if not x.is_cuda:
            h = h + self._sconv(x, layer, site, batch, state)
            return h, rms_norm(h, self.w[norm], self.eps)
        h_out, out = self._sconv_kernels(x, layer, site, batch, state, h, norm)
        return h_out, out

    def _sconv_kernels(
        self,
        x: torch.Tensor,
        layer: int,
        site: int,
        batch: ForwardBatch,
        state: StatePool,
        residual: torch.Tensor | None = None,
        norm: str | None = None,
    ) -> list[torch.Tensor]:
        """The site's ShortConv over every row of the batch as Triton kernels (CUDA): one launch for the one-token
        rows, one per group of chunks (a batch that is one flat group is read and written in place). [conv + x];
        with the `residual` h and the name of the `norm` weight, [h + that, its RMSNorm]."""
        from inkwell.kernels.triton_short_conv import short_conv_chunks, short_conv_step

        weight, saved = self.sconv_weight(layer, site), state.conv[layer][site]
        fused = {} if residual is None else dict(norm_weight=self.w[norm], eps=self.eps)

        def run(kernel: Callable, rows_of: Callable, *index: torch.Tensor) -> list[torch.Tensor]:
            """`kernel` over the rows `rows_of` takes from x (and the residual); its outputs as a list."""
            h = None if residual is None else rows_of(residual)
            result = kernel(rows_of(x), saved, *index, weight, h, **fused)
            return [result] if residual is None else list(result)

        whole = batch.whole
        if whole is not None:
            return [t.flatten(0, 1) for t in run(short_conv_chunks, whole.gather, whole.slots, whole.lengths)]
        outs = [torch.empty_like(x) for _ in range(1 if residual is None else 2)]
        singles, groups = batch.split
        if singles is not None:
            parts = run(short_conv_step, lambda t: t[singles.rows], singles.slots)
            for out, part in zip(outs, parts, strict=True):
                out[singles.rows] = part
        for chunks in groups:
            parts = run(short_conv_chunks, chunks.gather, chunks.slots, chunks.lengths)
            for out, part in zip(outs, parts, strict=True):
                chunks.scatter(part, out)
        return outs

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rel: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Eager attention: q [B,L,h,d], keys/values [B,P,kv,d], rel [B,L,h,d_rel], positions [B,L] and [B,P],
        `valid` [B,P] marks real keys among padding. Returns [B,L,h,d]."""
        cfg = self.config
        sliding = cfg.layer_types[layer] == "hybrid_sliding"
        heads, head_dim = q.shape[2], q.shape[3]
        groups = heads // keys.shape[2]
        qh = q.transpose(1, 2)
        kh = keys.transpose(1, 2).repeat_interleave(groups, dim=1)
        vh = values.transpose(1, 2).repeat_interleave(groups, dim=1)
        proj = self.w[f"model.layers.{layer}.self_attn.rel_logits_proj.proj"]
        extent = proj.shape[1]
        rel_logits = (rel @ proj).transpose(1, 2)  # [B, h, L, extent]
        distance = q_pos[:, :, None] - k_pos[:, None, :]  # [B, L, P]
        index = distance.clamp(0, extent - 1)[:, None].expand(-1, heads, -1, -1)
        bias = rel_logits.gather(-1, index).masked_fill(((distance < 0) | (distance >= extent))[:, None], 0.0)
        if not sliding and cfg.log_scaling_n_floor is not None:
            n = ((q_pos + 1).float() / cfg.log_scaling_n_floor).clamp(min=1.0)
            tau = (1.0 + cfg.log_scaling_alpha * torch.log(n))[:, None, :, None]
            qh = (qh.float() * tau).to(qh.dtype)
            bias = (bias.float() * tau).to(bias.dtype)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / head_dim) + bias
        allowed = distance >= 0
        if sliding:
            allowed &= distance < cfg.sliding_window_size
        if valid is not None:
            allowed &= valid[:, None, :]
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qh.dtype)
        return torch.matmul(probs, vh).transpose(1, 2)

    def attend_chunks(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        r: torch.Tensor,
        seq_slots: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        state: StatePool,
    ) -> torch.Tensor:
        """`attend` of B chunks [B, L, ...] continuing their sequences as one Triton kernel (CUDA): each chunk's
        history read in place from `state`'s cache, its own keys and values k, v (not stored yet). [B, L, h, d]."""
        from inkwell.kernels.triton_prefill_attention import prefill_attention

        proj = self.w[f"model.layers.{layer}.self_attn.rel_logits_proj.proj"]
        window = state.window if state.sliding[layer] else None
        keys, values = state.keys[layer], state.values[layer]
        return prefill_attention(q, k, v, r, proj, keys, values, seq_slots, starts, lengths, window, self.log_scaling)

    def _attend_singles(self, layer: int, q, k, v, r, singles: Singles, state: StatePool) -> torch.Tensor:
        """One query per sequence, all sequences at once, over keys padded to the longest history."""
        slots, pos = singles.slots, singles.positions
        if state.sliding[layer]:
            window = state.window
            state.keys[layer][slots, pos % window] = k
            state.values[layer][slots, pos % window] = v
            keys, values = state.keys[layer][slots], state.values[layer][slots]
            ring = torch.arange(window, device=pos.device)
            k_pos = pos[:, None] - (pos[:, None] - ring[None]) % window
        else:
            state.keys[layer][slots, pos] = k
            state.values[layer][slots, pos] = v
            length = singles.max_position + 1
            keys, values = state.keys[layer][slots, :length], state.values[layer][slots, :length]
            k_pos = torch.arange(length, device=pos.device)[None].expand(len(pos), -1)
        out = self.attend(layer, q[:, None], keys, values, r[:, None], pos[:, None], k_pos, valid=k_pos >= 0)
        return out[:, 0]

    def _attention(
        self, h: torch.Tensor, layer: int, batch: ForwardBatch, state: StatePool, lora: LoraSlots | None
    ) -> torch.Tensor:
        cfg = self.config
        p = f"model.layers.{layer}.self_attn"
        slots = batch.lora_slots
        sliding = cfg.layer_types[layer] == "hybrid_sliding"
        head_dim = cfg.swa_head_dim if sliding else cfg.head_dim
        tokens = h.shape[0]
        q, kv, r = self.qkvr(h, layer, slots, lora)
        k, v = self._sconv(kv, layer, KV_SITE, batch, state).split(self.kv_splits[layer], dim=-1)
        q = rms_norm(q.view(tokens, -1, head_dim), self.w[f"{p}.q_norm.weight"], self.eps)
        k = rms_norm(k.view(tokens, -1, head_dim), self.w[f"{p}.k_norm.weight"], self.eps)
        v = v.view(tokens, -1, head_dim)
        r = r.view(tokens, q.shape[1], -1)
        whole = batch.whole
        out = torch.empty_like(q) if whole is None else None  # else the one group's output is every row
        singles, groups = batch.split
        if singles is not None:
            rows = singles.rows
            out[rows] = self._attend_singles(layer, q[rows], k[rows], v[rows], r[rows], singles, state)
        for chunks in groups:  # all chunks at once: each one's cached history, then its own keys
            q_b, keys, values, r_b = (chunks.gather(t) for t in (q, k, v, r))
            window = state.window if sliding else None
            if q.is_cuda:
                lengths = chunks.lengths
                out_b = self.attend_chunks(layer, q_b, keys, values, r_b, chunks.slots, chunks.starts, lengths, state)
            else:
                k_pos = chunks.positions
                past = chunks.history(window)
                if past is not None:
                    seqs, places, past_pos = past
                    keys = torch.cat([state.keys[layer][seqs, places], keys], dim=1)
                    values = torch.cat([state.values[layer][seqs, places], values], dim=1)
                    k_pos = torch.cat([past_pos, k_pos], dim=1)
                out_b = self.attend(layer, q_b, keys, values, r_b, chunks.positions, k_pos)
            if whole is not None:
                out = out_b.flatten(0, 1)
            else:
                chunks.scatter(out_b, out)
            _, seq_slots, positions = chunks.stored(window)  # after the history is read
            state.store(layer, seq_slots, positions, chunks.kept(k, window), chunks.kept(v, window))
        return self.linear(out.reshape(tokens, -1), f"{p}.o_proj", slots, lora)

    # ---- MLPs --------------------------------------------------------------------------------

    def dense_mlp(self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp"
        gate = self.linear(x, f"{p}.gate_proj", slots, lora)
        up = self.linear(x, f"{p}.up_proj", slots, lora)
        out = self.linear(F.silu(gate) * up, f"{p}.down_proj", slots, lora)
        return out * self.w[f"{p}.global_scale"]

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `ids` [T] into the residual stream h (each one's embedding row, RMS-normed) and the first layer's
        input x = RMSNorm(h) [T, H]; on CUDA one Triton kernel (`kernels.triton_embed`) in place of a gather and
        two norms."""
        table, embed_norm = self.w["model.embed_tokens.weight"], self.w["model.embed_tokens.embed_norm.weight"]
        input_norm = self.w["model.layers.0.input_layernorm.weight"]
        if ids.is_cuda:
            from inkwell.kernels.triton_embed import embed_norms

            return embed_norms(ids, table, embed_norm, input_norm, self.eps)
        h = rms_norm(F.embedding(ids, table), embed_norm, self.eps)
        return h, rms_norm(h, input_norm, self.eps)

    def router(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A MoE layer's gate weight [E + n, H], its correction bias [E] and its global scale [1]."""
        p = f"model.layers.{layer}.mlp.gate"
        return self.w[f"{p}.weight"], self.w[f"{p}.e_score_correction_bias"], self.w[f"{p}.global_scale"]

    def route(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights [T, k + n]: the top-k routed ones, then the shared experts (the
        sink) weighted by their gammas (`kernels.gate_route`), without the dispatch `route_and_dispatch` adds: an
        expert-parallel rank dispatches its own experts' rows."""
        cfg = self.config
        k, n = cfg.num_experts_per_tok, cfg.n_shared_experts
        return gate_route(x, *self.router(layer), k, n, cfg.route_scale)

    def route_and_dispatch(
        self, x: torch.Tensor, layer: int, slots: torch.Tensor, experts: ExpertLora | None = None
    ) -> tuple[torch.Tensor, Dispatch, torch.Tensor | None]:
        """Each token's experts [T, k + n] (as `route` picks them), their rows grouped by expert, with the tokens'
        LoRA `slots`, and at decode sizes (`few_tokens`), where `experts` is given, the tokens' gate/up LoRA shrink
        (`expert_shrink`; else None); on CUDA at decode sizes the gate GEMM, the routing, the dispatch and the shrink
        are one Triton kernel (`kernels.gate_route_dispatch`)."""
        cfg = self.config
        k, n = cfg.num_experts_per_tok, cfg.n_shared_experts
        a = experts.gate_up.a if experts is not None and few_tokens(x) else None
        index, _, rows, shrunk = gate_route_dispatch(x, *self.router(layer), k, n, cfg.route_scale, slots, a)
        return index, Dispatch(*rows), shrunk

    def routing_table(self, ids: list[torch.Tensor], rows: int) -> torch.Tensor:
        """The routed ids [rows, top_k] of each MoE layer (as `forward` appends them) as one [rows, layers, top_k]."""
        if not ids:  # a model of dense MLPs only
            return torch.empty(rows, 0, self.config.num_experts_per_tok, dtype=torch.long, device=self.device)
        return torch.stack(ids, dim=1)

    def _moe(
        self, x: torch.Tensor, layer: int, slots: torch.Tensor, lora: LoraSlots | None, routing: list[torch.Tensor]
    ) -> torch.Tensor:
        """Routed and shared experts on their dispatched rows; the routed ids [T, top_k] are appended to `routing`."""
        experts = lora.experts.get(layer) if lora is not None else None
        index, rows, shrunk = self.route_and_dispatch(x, layer, slots, experts)
        routing.append(index[:, : self.config.num_experts_per_tok])
        down, down_lora = self.run_experts(x, layer, slots, rows, experts, shrunk)
        return rows.combine(down, x.shape[0], x.dtype, down_lora)

    def run_experts(
        self,
        x: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        rows: Dispatch,
        experts: ExpertLora | None,
        shrunk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RowExpand | None]:
        """The down outputs [M, H] of the dispatched `rows` of tokens x [T, H], each through its expert, in the rows'
        order, and their down LoRA where the combine is to add it (`down_lora`; None: none, or added already).
        `shrunk`: the tokens' gate/up shrink where `route_and_dispatch` computed it (decode sizes)."""
        if few_tokens(x):
            return self.few_experts(x, layer, rows, slots, experts, shrunk)
        bounds = None if self.grouped_mm else rows.ends.tolist()

        def gemm(inputs: torch.Tensor, weight: torch.Tensor, gather: bool) -> torch.Tensor:
            return expert_gemm(inputs[rows.tokens] if gather else inputs, weight, rows.ends, bounds)

        return self.experts_then_lora(x, layer, rows, self.expert_shrink(x, slots, experts), experts, gemm)

    def experts_then_lora(
        self,
        x: torch.Tensor,
        layer: int,
        rows: Dispatch,
        shrunk: torch.Tensor | None,
        experts: ExpertLora | None,
        gemm: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
        join: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, RowExpand | None]:
        """The dispatched rows' experts with each LoRA kernel after its GEMM: gemm(x, gate/up weight, True) (its
        rows gathered from tokens x), then (after `join`, where `shrunk` came from a side stream) silu * up with the
        gate/up LoRA of the tokens' `shrunk` (`gate_up_act`), gemm(act, down weight, False) and the down LoRA
        (`down_lora`): the down rows [M, H] and their down LoRA where the combine is to add it."""
        p = f"model.layers.{layer}.mlp.all_experts"
        gate_up = gemm(x, self.w[f"{p}.gate_up_proj"], True)
        if join is not None:
            join()
        act = self.gate_up_act(gate_up, shrunk, rows, experts)
        down = gemm(act, self.w[f"{p}.down_proj"], False)
        return down, self.down_lora(act, rows, experts)

    def few_experts(
        self,
        x: torch.Tensor,
        layer: int,
        rows: Dispatch,
        slots: torch.Tensor,
        experts: ExpertLora | None,
        shrunk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RowExpand | None]:
        """`run_experts` at decode sizes (`few_tokens`) of tokens x with LoRA `slots`: three kernels, the experts'
        GEMMs and silu * up; each expand rides in its GEMM's epilogue and the down LoRA's shrink in silu * up (which
        holds each row's activations). The gate/up shrink is `shrunk` (the MoE head's), else one more kernel, which
        runs beside the gate/up GEMM (`TokenShrink`)."""
        tokens, every_token_from = x.shape[0], self.config.n_routed_experts  # the shared experts' ids follow the routed
        p = f"model.layers.{layer}.mlp.all_experts"
        gate_up_w, down_w = self.w[f"{p}.gate_up_proj"], self.w[f"{p}.down_proj"]
        gate_up_expand = down_expand = None
        if experts is not None:
            buf = experts.gate_up
            shrink = TokenShrink(buf.a, slots) if shrunk is None else shrunk
            gate_up_expand = RowExpand(shrink, buf.b, rows.slots, rows.experts, buf.scalings, experts.groups)
        gate_up = expert_matmul(x, gate_up_w, rows.ends, rows.tokens, tokens, gate_up_expand, every_token_from)
        if experts is None:
            act = silu_mul(gate_up)
        else:
            buf = experts.down
            act, y = silu_mul_shrink(gate_up, buf.a, rows.slots, rows.experts, experts.groups)
            down_expand = RowExpand(y, buf.b, rows.slots, rows.experts, buf.scalings, experts.groups)
        return expert_matmul(act, down_w, rows.ends, None, tokens, down_expand, every_token_from), None

    # ---- the whole model ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        state: StatePool,
        lora: LoraSlots | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Next-token logits [N, vocab] at `batch.logit_rows` in the model's dtype (`sampling.greedy_scores` makes
        them fp32 with each row's greedy token); updates every sequence's state. Each MoE layer's routed expert ids
        [T, top_k] of every row are appended to `routing` where one is given (in layer order)."""
        routing = [] if routing is None else routing
        cfg = self.config
        slots = batch.lora_slots
        if lora is not None and not bool((slots >= 0).any()):
            lora = None
        h, x = self.embed(batch.input_ids)
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}"
            out = self._attention(x, layer, batch, state, lora)
            h, x = self.sconv_add_norm(out, h, layer, ATTN_SITE, batch, state, f"{p}.post_attention_layernorm.weight")
            if cfg.mlp_layer_types[layer] == "dense":
                out = self.dense_mlp(x, layer, slots, lora)
            else:
                out = self._moe(x, layer, slots, lora, routing)
            last = layer + 1 == cfg.num_hidden_layers
            norm = "model.norm.weight" if last else f"model.layers.{layer + 1}.input_layernorm.weight"
            h, x = self.sconv_add_norm(out, h, layer, MLP_SITE, batch, state, norm)
        h = x[batch.logit_rows] / cfg.logits_mup_width_multiplier
        logits = self.linear(h, "lm_head", slots[batch.logit_rows], lora)
        if cfg.unpadded_vocab_size is not None and cfg.unpadded_vocab_size < logits.shape[-1]:
            logits = logits[:, : cfg.unpadded_vocab_size]
        return logits
