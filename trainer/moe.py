"""Inkling's MoE: sigmoid top-k router with score-correction bias and the shared-expert sink,
expert-parallel routed experts and always-on shared experts, each with shared-outer LoRA.

Routed experts are split over the EP group (E/ep per rank) and their intermediate size over
the TP group. Dispatch all-gathers the EP group's tokens, each rank runs its local experts on
the tokens routed to them, and a reduce-scatter returns the sums (fp32) to their owners.
LoRA shared-outer factors: gate/up A [r, H] shared by the experts (applied once per token,
before dispatch), B [E, F, r] per expert; down A [E, r, F] per expert, B [H, r] shared (applied
once per token after the combine). Routing replay: `replay_ids` replaces the top-k choice (of the
tokens whose row is not -1) while the weights are still recomputed from the current router.
The combine follows the serving engine's arithmetic, so that a sampler and this trainer in bf16 round alike: each
expert's output is weighted in fp32 (a shared expert by its gamma after its down projection) and summed in fp32.

Under sequence parallelism the layer all-gathers the tokens first (routing sees every token, as at
TP=1) and reduce-scatters the result after its ShortConv, so the MoE returns this rank's partial
sum (fp32) and leaves the input gradients partial for the gather's backward to sum.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from inkwell.trainer.lora import LoraSettings, lora_dropout, lora_param, mark
from inkwell.trainer.parallel import (
    ep_group,
    gather_tokens,
    gather_tokens_nograd,
    scatter_tokens,
    tp_group,
    tp_share,
    tp_share_grad,
)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row group g of x (rows offsets[g-1]:offsets[g]) times weight[g]^T, one grouped GEMM for all groups.

    Grouped GEMM kernels want 16-byte aligned rows, so a small inner or outer size (a LoRA rank) is
    zero-padded to a multiple of 8 and the padding is sliced off.
    """
    out_features, in_features = weight.shape[1], weight.shape[2]
    pad_in, pad_out = -in_features % 8, -out_features % 8
    if pad_in:
        x = F.pad(x, (0, pad_in))
        weight = F.pad(weight, (0, pad_in))
    if pad_out:
        weight = F.pad(weight, (0, 0, 0, pad_out))
    y = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    return y[:, :out_features] if pad_out else y


class TopKRouter(nn.Module):
    """transformers' InklingTopkRouter (frozen), with a routing replay hook."""

    def __init__(self, build, prefix: str):
        super().__init__()
        cfg = build.hf
        self.num_experts, self.n_shared = cfg.n_routed_experts, cfg.n_shared_experts
        self.top_k = cfg.num_experts_per_tok
        self.route_scale = cfg.route_scale
        kw = {"dtype": build.dtype, "device": build.device}
        self.weight = nn.Parameter(torch.zeros(self.num_experts + self.n_shared, cfg.hidden_size, **kw), False)
        self.global_scale = nn.Parameter(torch.ones(1, **kw), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, **kw))
        mark(self.weight, f"{prefix}.weight")
        mark(self.global_scale, f"{prefix}.global_scale")
        mark(self.e_score_correction_bias, f"{prefix}.e_score_correction_bias")
        self.replay_ids: torch.Tensor | None = None
        self.last_ids: torch.Tensor | None = None

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(flat, self.weight)
        routed_logits, shared_logits = logits[..., : -self.n_shared], logits[..., -self.n_shared :]
        with torch.no_grad():
            choice = routed_logits.sigmoid() + self.e_score_correction_bias
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        if self.replay_ids is not None:
            replay = self.replay_ids.to(flat.device)
            if replay.shape != ids.shape:
                need = tuple(ids.shape)
                raise ValueError(f"routing replay ids have shape {tuple(replay.shape)}; need {need} (tokens, top_k)")
            ids = torch.where(replay[:, :1] >= 0, replay, ids)  # a row of -1: the token routes itself
        self.last_ids = ids.detach()
        topk_log_probs = F.logsigmoid(torch.cat([routed_logits.gather(-1, ids), shared_logits], dim=-1))
        weights = torch.exp(topk_log_probs - torch.logsumexp(topk_log_probs, dim=-1, keepdim=True))
        weights = weights * self.route_scale * self.global_scale
        return ids, weights[..., : self.top_k], weights[..., self.top_k :]


@dataclass
class ExpertLora:
    """Shared-outer LoRA factors of one expert bank (routed or shared)."""

    settings: LoraSettings
    gate_A: nn.Parameter
    gate_B: nn.Parameter
    up_A: nn.Parameter
    up_B: nn.Parameter
    down_A: nn.Parameter
    down_B: nn.Parameter


class ExpertBank(nn.Module):
    """Expert weights [E_local, F/tp, H] (+ LoRA) under one HF prefix; routed or shared."""

    def __init__(self, build, prefix: str, count: int, lora: LoraSettings | None, routed: bool):
        super().__init__()
        cfg, tp = build.hf, build.tp
        ep = build.ep if routed else 1
        h, f = cfg.hidden_size, cfg.moe_intermediate_size
        self.local, self.f_local = count // ep, f // tp
        ep_dim = 0 if routed else None
        kw = {"dtype": build.dtype, "device": build.device}
        self.gate = nn.Parameter(torch.zeros(self.local, self.f_local, h, **kw), requires_grad=False)
        self.up = nn.Parameter(torch.zeros(self.local, self.f_local, h, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.zeros(self.local, h, self.f_local, **kw), requires_grad=False)
        if routed:
            mark(self.gate, f"{prefix}.gate_up_proj", tp_dim=1, ep_dim=0, chunk=(1, 0, 2))
            mark(self.up, f"{prefix}.gate_up_proj", tp_dim=1, ep_dim=0, chunk=(1, 1, 2))
            mark(self.down, f"{prefix}.down_proj", tp_dim=2, ep_dim=0)
        else:
            mark(self.gate, f"{prefix}.gate_proj", tp_dim=1)
            mark(self.up, f"{prefix}.up_proj", tp_dim=1)
            mark(self.down, f"{prefix}.down_proj", tp_dim=2)
        self.lora = lora
        self.sequence_parallel = build.sequence_parallel
        if lora is not None:
            r, dev = lora.rank, build.device
            self.gate_A = lora_param((r, h), f"{prefix}.gate_proj.lora_A", device=dev)
            self.gate_B = lora_param((self.local, self.f_local, r), f"{prefix}.gate_proj.lora_B", 1, ep_dim, dev)
            self.up_A = lora_param((r, h), f"{prefix}.up_proj.lora_A", device=dev)
            self.up_B = lora_param((self.local, self.f_local, r), f"{prefix}.up_proj.lora_B", 1, ep_dim, dev)
            self.down_A = lora_param((self.local, r, self.f_local), f"{prefix}.down_proj.lora_A", 2, ep_dim, dev)
            self.down_B = lora_param((h, r), f"{prefix}.down_proj.lora_B", device=dev)

    def lora_in(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank-r gate|up activations of the shared A factors, full gradient over TP."""
        if self.lora is None:
            return None
        xd = lora_dropout(tp_share_grad(x) if self.sequence_parallel else x, self.lora.dropout, self.training)
        u = torch.cat([F.linear(xd, self.gate_A.to(x.dtype)), F.linear(xd, self.up_A.to(x.dtype))], dim=-1)
        return tensor_parallel.copy_to_tensor_model_parallel_region(u, group=tp_group())

    def activation(self, x: torch.Tensor, u: torch.Tensor | None, offsets: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows grouped by local expert (offsets: cumulative group ends), LoRA included."""
        gate = grouped_linear(x, self.gate, offsets)
        up = grouped_linear(x, self.up, offsets)
        if u is not None:
            r, s = self.lora.rank, self.lora.scaling
            gate = gate + s * grouped_linear(u[:, :r], self.gate_B.to(x.dtype), offsets)
            up = up + s * grouped_linear(u[:, r:], self.up_B.to(x.dtype), offsets)
        return F.silu(gate) * up

    def lora_out(self, v: torch.Tensor) -> torch.Tensor:
        return self.lora.scaling * F.linear(v, self.down_B.to(v.dtype))


class InklingMoE(nn.Module):
    """Router + routed experts (EP) + shared experts with gammas from the sink."""

    def __init__(self, build, layer: int):
        super().__init__()
        cfg = build.hf
        prefix = f"model.layers.{layer}.mlp"
        self.router = TopKRouter(build, f"{prefix}.gate")
        self.experts = ExpertBank(build, f"{prefix}.experts", cfg.n_routed_experts, build.lora_for("experts"), True)
        self.shared = ExpertBank(
            build, f"{prefix}.shared_experts", cfg.n_shared_experts, build.lora_for("shared_experts"), False
        )
        self.first_expert = build.ep_rank * self.experts.local
        self.sequence_parallel = build.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE output in x's dtype, or under sequence parallelism this rank's partial sum in fp32."""
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, shape[-1])
        ids, weights, gammas = self.router(flat)
        tpg = tp_group()
        x_tp = flat
        if not self.sequence_parallel:  # under SP the layer's all-gather sums the input gradients
            x_tp = tensor_parallel.copy_to_tensor_model_parallel_region(flat, group=tpg)
            weights = tensor_parallel.copy_to_tensor_model_parallel_region(weights, group=tpg)
            gammas = tensor_parallel.copy_to_tensor_model_parallel_region(gammas, group=tpg)

        routed, v_routed = self._routed(flat, x_tp, ids, weights)
        shared, v_shared = self._shared(flat, x_tp, gammas)
        out = routed + shared
        # one all-reduce: the rank-r LoRA activations, and the output unless it stays partial (SP)
        parts = [v for v in (v_routed, v_shared) if v is not None]
        if not self.sequence_parallel:
            parts.insert(0, out)
        pieces = []
        if parts:
            summed = tensor_parallel.reduce_from_tensor_model_parallel_region(torch.cat(parts, dim=-1), group=tpg)
            pieces = list(torch.split(summed, [p.shape[-1] for p in parts], dim=-1))
        if not self.sequence_parallel:
            out = pieces.pop(0)
        for bank, v in ((self.experts, v_routed), (self.shared, v_shared)):
            if v is not None:
                delta = bank.lora_out(pieces.pop(0))
                out = out + (tp_share(delta) if self.sequence_parallel else delta)
        return out.view(shape) if self.sequence_parallel else out.to(dtype).view(shape)

    def _routed(self, flat, x_tp, ids, weights):
        """This rank's experts over the EP group's tokens; fp32 sums scattered back to the owners."""
        epg = ep_group()
        bank = self.experts
        u = bank.lora_in(flat)
        x_all = gather_tokens(x_tp, epg)
        ids_all = gather_tokens_nograd(ids, epg)
        w_all = gather_tokens(weights, epg)
        u_all = gather_tokens(u, epg) if u is not None else None
        rows, offsets = self._dispatch(ids_all)
        tok = rows // ids_all.shape[1]
        w = w_all.flatten()[rows].unsqueeze(-1)
        act = bank.activation(x_all[tok], None if u_all is None else u_all[tok], offsets)
        out = torch.zeros(x_all.shape, dtype=torch.float32, device=x_all.device)
        out.index_add_(0, tok, grouped_linear(act, bank.down, offsets).float() * w.float())
        v = None
        if u is not None:
            v = torch.zeros((x_all.shape[0], bank.lora.rank), dtype=torch.float32, device=x_all.device)
            v.index_add_(0, tok, grouped_linear(act, bank.down_A.to(act.dtype), offsets).float() * w.float())
        out = scatter_tokens(out, epg)
        return out, (scatter_tokens(v, epg) if v is not None else None)

    def _dispatch(self, ids_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (token, slot) indices routed to this rank's experts, sorted by expert, and group ends.

        Without expert parallelism every choice is local and nothing waits on the device; with it,
        selecting this rank's share costs one synchronising `nonzero`.
        """
        local = ids_all.flatten() - self.first_expert
        if self.experts.local == self.router.num_experts:
            rows = local.argsort(stable=True)
        else:
            rows = ((local >= 0) & (local < self.experts.local)).nonzero().squeeze(1)
            rows = rows[local[rows].argsort(stable=True)]
        counts = torch.zeros(self.experts.local, dtype=torch.int32, device=ids_all.device)
        counts.scatter_add_(0, local[rows], torch.ones_like(rows, dtype=torch.int32))
        return rows, counts.cumsum(0, dtype=torch.int32)

    def _shared(self, flat, x_tp, gammas):
        """All shared experts on every token, weighted by their sink gammas."""
        bank = self.shared
        u = bank.lora_in(flat)
        n = flat.shape[0]
        hs = x_tp.unsqueeze(0).expand(bank.local, n, -1)
        gate = torch.bmm(hs, bank.gate.transpose(1, 2))
        up = torch.bmm(hs, bank.up.transpose(1, 2))
        if u is not None:
            r, s = bank.lora.rank, bank.lora.scaling
            gate = gate + s * torch.einsum("nr,efr->enf", u[:, :r], bank.gate_B.to(u.dtype))
            up = up + s * torch.einsum("nr,efr->enf", u[:, r:], bank.up_B.to(u.dtype))
        act = F.silu(gate) * up
        g = gammas.t().unsqueeze(-1).float()
        out = (torch.bmm(act, bank.down.transpose(1, 2)).float() * g).sum(dim=0)
        v = None
        if u is not None:
            v = (torch.bmm(act, bank.down_A.to(act.dtype).transpose(1, 2)).float() * g).sum(dim=0)
        return out, v
