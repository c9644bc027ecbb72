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
    """Per-batch layout shared by every layer: positions restart per sample; masks are derived once."""

    positions: torch.Tensor  # [b, s] long
    segments: torch.Tensor  # [b, s] long
    causal: torch.Tensor  # [b, s, s] bool: same segment and k <= q
    leaks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (row, t, j): a conv tap t-j in an earlier sample

    @classmethod
    def build(cls, segments: torch.Tensor, conv_kernel: int) -> "Packing":
        b, s = segments.shape
        idx = torch.arange(s, device=segments.device)
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        start_pos = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)).expand(b, s), dim=1).values
        positions = idx - start_pos
        same = segments[:, :, None] == segments[:, None, :]
        causal = same & (idx[None, :, None] >= idx[None, None, :])
        taps = torch.arange(1, conv_kernel, device=segments.device)[:, None, None]
        leaking = (positions[None] < taps) & (idx[None, None] >= taps)  # [K-1, b, s]
        j, row, t = leaking.nonzero(as_tuple=True)
        return cls(positions, segments, causal, (row, t, j + 1))

    def allowed(self, window: int | None) -> torch.Tensor:
        """[b, 1, s, s] keys each query may attend: causal within its segment, and within `window` if given."""
        if window is None:
            return self.causal[:, None]
        idx = torch.arange(self.causal.shape[-1], device=self.causal.device)
        return (self.causal & (idx[:, None] - idx[None, :] < window))[:, None]

    @classmethod
    def single(cls, batch: int, seq: int, conv_kernel: int, device) -> "Packing":
        return cls.build(torch.zeros(batch, seq, dtype=torch.long, device=device), conv_kernel)


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
        """transformers' causal conv1d over the whole row, minus the taps that reach into an earlier sample."""
        dtype, s, k = x.dtype, x.shape[1], self.kernel
        h = x.float()
        out = F.conv1d(h.transpose(1, 2), self.weight, padding=k - 1, groups=h.shape[-1])[..., :s].transpose(1, 2)
        row, t, j = packing.leaks
        if row.numel():
            taps = self.weight[:, 0, :].t()[k - 1 - j]  # out[t] = sum_j w[k-1-j] * x[t-j]
            out = out.index_put((row, t), -(h[row, t - j] * taps), accumulate=True)
        return (out + h).to(dtype)


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

    Within a packed segment the distance of two tokens is the difference of their indices, so the
    bias is the (query, distance) table skewed into (query, key) layout; pairs across segments are
    masked by the attention.
    """

    def __init__(self, d_rel: int, extent: int, hf_name: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.zeros(d_rel, extent, dtype=dtype, device=device), requires_grad=False)
        mark(self.proj, f"{hf_name}.proj")

    def forward(self, relative_states: torch.Tensor, tau: torch.Tensor | None = None) -> torch.Tensor:
        """relative_states [b, s, h, d_rel], tau [b, 1, s, 1] (log scaling) -> bias [b, h, s, s]."""
        rel = (relative_states @ self.proj).transpose(1, 2)
        if tau is not None:
            rel = (rel.float() * tau).to(rel.dtype)
        s = rel.shape[-2]
        rel = rel[..., :s] if self.extent >= s else torch.nn.functional.pad(rel, (0, s - self.extent))
        return causal_skew(rel)
