"""Inkling's own building blocks, written to compute exactly what transformers' modules compute.

RMSNorm, the segment-aware ShortConv and the relative-logits bias. Packing is handled through
`Packing`: per-token positions that restart in every sample and segment ids; no conv state and
no attention crosses a segment boundary.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inkwell.trainer.lora import mark


@dataclass
class Packing:
    """Per-batch layout shared by every layer: positions restart per sample; masks are derived once.

    Every tensor has a shape fixed by (batch, seq), whatever the packing, and building it never waits
    on the device, so a compiled layer sees the same shapes every step.
    """

    positions: torch.Tensor  # [b, s] long
    segments: torch.Tensor  # [b, s] long
    taps: torch.Tensor  # [b, s, kernel] fp32: 1 where conv tap j of token t stays inside t's sample
    masks: dict[int | None, torch.Tensor]  # window (None: full) -> keys each query may attend [b, 1, s, s]

    @classmethod
    def build(cls, segments: torch.Tensor, conv_kernel: int, windows: tuple[int | None, ...] = (None,)) -> "Packing":
        b, s = segments.shape
        idx = torch.arange(s, device=segments.device)
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        start_pos = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)).expand(b, s), dim=1).values
        positions = idx - start_pos
        taps = (positions[..., None] >= torch.arange(conv_kernel, device=segments.device)).float()
        return cls(positions, segments, taps, {w: dense_mask(segments, w) for w in windows})


def dense_mask(segments: torch.Tensor, window: int | None) -> torch.Tensor:
    """[b, 1, s, s] keys each query may attend: causal within its segment, and within `window` if given."""
    idx = torch.arange(segments.shape[1], device=segments.device)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    return allowed[:, None]


class RMSNorm(nn.Module):
    """transformers' InklingRMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, size: int, eps: float, hf_name: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        mark(self.weight, f"{hf_name}.weight")
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ShortConv(nn.Module):
    """Depthwise causal conv plus residual in fp32, reset at every segment start.

    With `shard_tp` set the conv runs on a column-parallel stream (K/V) and its channels are split.
    """

    def __init__(self, channels: int, kernel: int, hf_name: str, shard_tp: int | None = None, device=None):
        super().__init__()
        self.kernel = kernel
        local = channels // (shard_tp or 1)
        self.weight = nn.Parameter(torch.zeros(local, 1, kernel, device=device), requires_grad=False)
        mark(self.weight, f"{hf_name}.conv1d.weight", tp_dim=0 if shard_tp else None)

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """transformers' causal conv1d (zero history) as a sum of shifted taps, each cut at sample starts; the
        residual is added last, as the serving engine adds it."""
        h, s, k = x.float(), x.shape[1], self.kernel
        w = self.weight[:, 0, :]  # out[t] = sum_j w[k-1-j] * x[t-j]
        out = h * w[:, k - 1]
        for j in range(1, k):
            earlier = F.pad(h, (0, 0, j, 0))[:, :s]
            out = out + earlier * w[:, k - 1 - j] * packing.taps[..., j : j + 1]
        return (out + h).to(x.dtype)


def causal_skew(rel: torch.Tensor) -> torch.Tensor:
    """[..., s, s] by (query, distance) -> [..., s, s] by (query, key): out[q, k] = rel[q, q - k] for k <= q.

    Pure data movement (flip, pad, reshape), so its backward is a copy too, unlike a gather whose
    backward scatter-adds every masked pair onto one column. Entries with k > q hold other rows'
    values; attention masks them.
    """
    s = rel.shape[-1]
    flipped = torch.nn.functional.pad(rel.flip(-1), (0, 1))  # [..., s, s + 1], last column zero
    flat = flipped.flatten(-2)
    return flat[..., s - 1 : s - 1 + s * s].unflatten(-1, (s, s))


class RelativeLogits(nn.Module):
    """Per-head bias by causal distance, zero outside [0, extent).

    Returns the (query, distance) table, which the attention skews into a (query, key) bias
    (`causal_skew`). Within a packed segment the distance of two tokens is the difference of their
    indices; pairs across segments are masked.
    """

    def __init__(self, d_rel: int, extent: int, hf_name: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.zeros(d_rel, extent, dtype=dtype, device=device), requires_grad=False)
        mark(self.proj, f"{hf_name}.proj")

    def forward(self, relative_states: torch.Tensor, tau: torch.Tensor | None = None) -> torch.Tensor:
        """relative_states [b, s, h, d_rel], tau [b, 1, s, 1] (log scaling) -> [b, h, s, min(extent, s)]."""
        s = relative_states.shape[1]
        proj = self.proj[:, :s] if self.extent > s else self.proj
        rel = (relative_states @ proj).transpose(1, 2)
        if tau is not None:
            rel = (rel.float() * tau).to(rel.dtype)
        return rel
