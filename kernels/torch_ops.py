"""Pure-torch reference ops: multi-LoRA segmented shrink/expand over a per-token adapter slot index, and Inkling's
shared-sink router.

One batch mixes tokens of different adapters (and of the base model, slot -1). Each op groups rows
by slot (or by slot and expert) and runs one GEMM per group, the SGMV formulation the Triton twins
implement in a single launch. Slot buffers are preallocated at the maximum rank; an adapter of a
smaller rank is zero-padded, so padding rows contribute nothing. Signatures are the contract the
Triton twins in this package match.
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


def _groups(keys: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(key, row indices) for each distinct non-negative key, in ascending key order."""
    valid = keys >= 0
    if not bool(valid.any()):
        return []
    rows = valid.nonzero().squeeze(1)
    picked = keys[rows]
    order = torch.argsort(picked, stable=True)
    rows, picked = rows[order], picked[order]
    uniq, counts = torch.unique_consecutive(picked, return_counts=True)
    out, start = [], 0
    for key, count in zip(uniq.tolist(), counts.tolist(), strict=True):
        out.append((key, rows[start : start + count]))
        start += count
    return out


def check_token_slots(token_slots: torch.Tensor, tokens: int) -> None:
    """Each of the T tokens has a slot, in a contiguous [T] tensor: the Triton kernels read slot t at token_slots + t,
    so a strided or broadcast view would hand them other values. Refused here, on every device, so the CPU tests see
    what the GPU kernels would misread."""
    if token_slots.shape != (tokens,):
        raise ValueError(f"token_slots must be [T={tokens}], got {tuple(token_slots.shape)}")
    if not token_slots.is_contiguous():
        raise ValueError(
            f"token_slots must be contiguous (the kernels read it with stride 1), got strides {token_slots.stride()}"
        )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x[T,K] @ A[slot]^T -> [T,R]; rows of slot -1 are zero."""
    check_token_slots(token_slots, x.shape[0])
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in _groups(token_slots):
        out[rows] = x[rows] @ lora_a[slot].to(x.dtype).t()
    return out


def lora_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[T,N] += scaling[slot] * y[T,R] @ B[slot]^T, in place; rows of slot -1 are untouched."""
    check_token_slots(token_slots, y.shape[0])
    for slot, rows in _groups(token_slots):
        delta = (y[rows].float() @ lora_b[slot].float().t()) * scalings[slot]
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


@dataclass(frozen=True)
class ExpertGroups:
    """Which expert ids of dispatched rows a LoRA covers, when routed and shared experts share one id space.

    Ids first .. first+count-1 have factors, indexed from `first`; rows of other experts are left alone
    (like slot -1). With `split` the ids form two groups, ids >= split (the shared experts) the second;
    each group has its own shared factor (gate/up: A, down: B), and its own scalings.
    """

    first: int
    count: int
    split: int | None = None

    @property
    def groups(self) -> int:
        return 1 if self.split is None else 2

    def group_of(self, expert: int) -> int:
        return int(self.split is not None and expert >= self.split)


def _expert_keys(slots: torch.Tensor, expert_ids: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """slot * count + (expert - first) for rows with a slot and a covered expert; -1 elsewhere."""
    local = expert_ids - groups.first
    covered = (slots >= 0) & (local >= 0) & (local < groups.count)
    return torch.where(covered, slots * groups.count + local, torch.full_like(slots, -1))


def _expert_row_groups(
    slots: torch.Tensor, expert_ids: torch.Tensor, groups: ExpertGroups
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """(slot, expert - first, its group, row indices) of each (slot, covered expert) pair, in key order."""
    for key, rows in _groups(_expert_keys(slots, expert_ids, groups)):
        slot, local = divmod(key, groups.count)
        yield slot, local, groups.group_of(groups.first + local), rows


def expert_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """Dispatched rows x[M,K] @ A[slot, expert - first]^T -> [M,R] (A: [S,E,R,K]); uncovered rows are zero."""
    groups = groups or ExpertGroups(0, lora_a.shape[1])
    out = x.new_zeros(x.shape[0], lora_a.shape[2])
    for slot, local, _, rows in _expert_row_groups(slots, expert_ids, groups):
        out[rows] = x[rows] @ lora_a[slot, local].to(x.dtype).t()
    return out


def expert_in_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    token_of_row: torch.Tensor,
    groups: ExpertGroups,
) -> torch.Tensor:
    """Per-expert B of P projections that read one input (gate/up), in place on the dispatched rows.

    y [T, P*G*R] is the tokens' shrink over each group's shared A, block p*G+g for projection p of
    group g; lora_b [S, P, E, N, R]; scalings [S, P*G]; out [M, P*N]. Row i (token token_of_row[i],
    expert e of group g) adds scaling[slot, p*G+g] * y[token, block p*G+g] @ B[slot, p, e - first]^T
    to its columns p*N .. (p+1)*N.
    """
    _, parts, _, n, rank = lora_b.shape
    for slot, local, g, rows in _expert_row_groups(slots, expert_ids, groups):
        src = y[token_of_row[rows]].float()
        for p in range(parts):
            block = p * groups.groups + g
            delta = src[:, block * rank : (block + 1) * rank] @ lora_b[slot, p, local].float().t()
            out[rows, p * n : (p + 1) * n] += (delta * scalings[slot, block]).to(out.dtype)
    return out


def expert_out_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    groups: ExpertGroups,
) -> torch.Tensor:
    """Each group's shared B of a down projection, in place: out[M,N] += scaling[slot, g] * y[M,R] @ B[slot, g]^T
    (lora_b [S, G, N, R], scalings [S, G]) for rows whose expert the groups cover."""
    for slot, _, g, rows in _expert_row_groups(slots, expert_ids, groups):
        delta = (y[rows].float() @ lora_b[slot, g].float().t()) * scalings[slot, g]
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


@dataclass(frozen=True)
class TokenShrink:
    """A gate/up `RowExpand`'s y left for `expert_matmul` to compute, the tokens' x @ A[slot]^T (`lora_shrink`): on
    CUDA it launches the shrink right before the GEMM, which starts beside it (programmatic dependent launch) and
    waits for it only where its epilogue needs y."""

    a: torch.Tensor  # [S, P*G*R, K], each group's gate and up A
    token_slots: torch.Tensor  # [T]


@dataclass(frozen=True)
class RowExpand:
    """A LoRA expand that `expert_matmul` adds to its output rows, in its epilogue on CUDA: output row i (x's row
    `tokens[i]`, or i) adds scalings[slot, block] * y[that row of x, block] @ B^T, rounded as `expert_in_lora_expand`
    and `expert_out_lora_expand` add it. B is per expert, [S, P, E, N, R] (the gate/up: y [T, P*G*R] the tokens'
    shrink, block p*G+g for projection p of group g), or per group, [S, G, N, R] (the down: y [M, R], block g).
    Rows of slot -1, or of an expert the groups do not cover, get nothing."""

    y: torch.Tensor | TokenShrink
    b: torch.Tensor
    slots: torch.Tensor  # [M], each output row's slot
    experts: torch.Tensor  # [M], each output row's expert id (sorted: the kernel reads it from its grid)
    scalings: torch.Tensor  # [S, P*G] or [S, G]
    groups: ExpertGroups

    @property
    def per_expert(self) -> bool:
        return self.b.dim() == 5


def shared_sink_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    top_k: int,
    n_shared: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights [T, k + n] from its router logits [T, E + n] (routed, then shared): the
    top-k routed experts by sigmoid + bias, then the shared ones (the sink, ids E .. E+n-1), all weighted by a
    softmax of their log-sigmoids times route_scale * global_scale. transformers' InklingTopkRouter step by step."""
    routed = logits[:, :-n_shared]
    choice = routed.sigmoid() + bias
    index = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    picked = torch.cat([routed.gather(-1, index), logits[:, -n_shared:]], dim=-1)
    log_probs = F.logsigmoid(picked)
    weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
    weights = weights * route_scale * global_scale
    first = routed.shape[1]
    shared = torch.arange(first, first + n_shared, device=logits.device).expand(logits.shape[0], -1)
    return torch.cat([index, shared], dim=1), weights


def moe_dispatch(
    index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, ...]:
    """The (token, expert) rows of each token's experts index [T, k] and weights [T, k], sorted by expert (stably:
    a token's rows keep their order; ids >= `num_experts` sort last, as one): each row's place in the token-major
    order, its token, expert id, weight and LoRA slot (of `slots` [T]); ends [num_experts] int32 (rows of experts
    <= e); and places [T*k], where each token-major row went (the inverse of the first)."""
    keys = index.reshape(-1).clamp(max=num_experts)
    order = torch.argsort(keys, stable=True)
    tokens = order // index.shape[1]
    experts = index.reshape(-1)[order]
    ids = torch.arange(num_experts, device=index.device)
    ends = torch.searchsorted(keys[order], ids, right=True, out_int32=True)
    places = torch.empty_like(order)
    places[order] = torch.arange(order.numel(), device=order.device)
    return order, tokens, experts, weights.reshape(-1)[order], slots[tokens], ends, places


def moe_combine(
    out: torch.Tensor,
    weights: torch.Tensor,
    places: torch.Tensor,
    tokens: int,
    dtype: torch.dtype,
    down: RowExpand | None = None,
) -> torch.Tensor:
    """Each token's dispatched rows of out [T*k, H] (at `places`, in the token's own order) times their weights
    [T*k], summed in fp32 (deterministic, unlike an index_add): [T, H] in `dtype`. With `down`, the experts' down
    LoRA over out's rows (a per-group `RowExpand`, y [T*k, R]), each row's delta joins it in fp32 first."""
    rows = out.to(torch.promote_types(out.dtype, torch.float32), copy=down is not None)  # float64 stays (tests)
    if down is not None:
        expert_out_lora_expand(down.y, down.b, down.slots, down.experts, down.scalings, rows, down.groups)
    weighted = rows * weights[:, None].to(rows.dtype)
    return weighted[places].view(tokens, -1, out.shape[1]).sum(1).to(dtype)


def expert_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    tokens: torch.Tensor | None,
    max_rows: int,
    expand: RowExpand | None = None,
    every_token_from: int | None = None,
) -> torch.Tensor:
    """Dispatched rows sorted by expert (expert e's end at `ends` [E], cumulative), each times its expert's weight
    [E, N, K]: row r is x[tokens[r]], or with `tokens` None x[r]; plus `expand`'s LoRA. `max_rows` bounds any
    expert's rows (the kernels size their grid by it) and `every_token_from` names the experts every token routes
    to (the CUDA kernel prefetches their weights); both unused here. [rows, N]."""
    rows = x[tokens] if tokens is not None else x
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    for expert, (start, end) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
    if expand is None:
        return out
    e = expand
    if isinstance(e.y, TokenShrink):
        e = replace(e, y=lora_shrink(x, e.y.a, e.y.token_slots))
    if e.per_expert:
        sources = tokens if tokens is not None else torch.arange(out.shape[0], device=out.device)
        return expert_in_lora_expand(e.y, e.b, e.slots, e.experts, e.scalings, out, sources, e.groups)
    y = e.y[tokens] if tokens is not None else e.y
    return expert_out_lora_expand(y, e.b, e.slots, e.experts, e.scalings, out, e.groups)


def silu_mul(
    gate_up: torch.Tensor, expand: RowExpand | None = None, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [M, 2F] -> [M, F] in the input's dtype; with `expand`, the rows' gate/up
    LoRA over their tokens `tokens` (`expert_in_lora_expand`) added to a copy of them first."""
    if expand is not None:
        e = expand
        gate_up = expert_in_lora_expand(e.y, e.b, e.slots, e.experts, e.scalings, gate_up.clone(), tokens, e.groups)
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]) * gate_up[:, half:]


def silu_mul_shrink(
    gate_up: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, expert_ids: torch.Tensor, groups: ExpertGroups
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul` and the down LoRA's shrink of its rows (`expert_lora_shrink` over per-expert A [S, E, R, F]):
    (act [M, F], y [M, R]), the y that a down `RowExpand` takes."""
    act = silu_mul(gate_up)
    return act, expert_lora_shrink(act, lora_a, slots, expert_ids, groups)
