"""One decode step of Inkling's ShortConv as one Triton kernel, optionally with the residual add and RMSNorm after it.

A decode step runs a ShortConv at three sites per layer. In torch each is a gather of the saved inputs, a concat,
a depthwise conv, a scatter of the shifted window, the residual and a cast; the attention and MLP sites are then
added to the residual stream and normalized for the next block. Those are about a dozen latency-bound launches of
a few KB each, ~40% of a CUDA-graph decode step's launches. Here one program per row does all of it with the
same arithmetic: the conv in fp32 over the row's saved inputs and its new one, plus that input, rounded to the
model's dtype; then (with `residual`) the residual add in the model's dtype and transformers' RMSNorm (normalized
in fp32, rounded, times the weight). Sums run in another order than torch's conv and norm, so results agree to
fp32 rounding, not bitwise.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _short_conv_step_kernel(
    x_ptr,
    state_ptr,
    seq_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    h_out_ptr,
    norm_ptr,
    C,
    eps,
    stride_xb,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_ob,
    stride_hb,
    stride_hob,
    KERNEL: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Row b: window = [state[seq_b], x_b] (KERNEL taps), conv + x_b -> out (or, with NORM, h_b + that -> h_out
    and its RMSNorm -> out); state[seq_b] <- the window's last KERNEL-1 taps."""
    b = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    in_c = c < C
    seq = tl.load(seq_ptr + b).to(tl.int64)
    xf = tl.load(x_ptr + b * stride_xb + c, mask=in_c, other=0.0).to(tl.float32)
    taps = state_ptr + seq * stride_ss + c[:, None] * stride_sc + j[None, :] * stride_sk  # [BLOCK_C, BLOCK_W]
    saved = tl.load(taps, mask=in_c[:, None] & (j < KERNEL - 1)[None, :], other=0.0)
    window = tl.where((j == KERNEL - 1)[None, :], xf[:, None], saved)
    w = tl.load(
        w_ptr + c[:, None] * stride_wc + j[None, :] * stride_wk, mask=in_c[:, None] & (j < KERNEL)[None, :], other=0.0
    )
    conv = tl.sum(window * w.to(tl.float32), axis=1)
    # the window shifted by one: taps 1 .. KERNEL-2 of the state, then x (both loaded before the store below)
    later = tl.load(taps + stride_sk, mask=in_c[:, None] & (j < KERNEL - 2)[None, :], other=0.0)
    shifted = tl.where((j == KERNEL - 2)[None, :], xf[:, None], later)
    tl.store(taps, shifted, mask=in_c[:, None] & (j < KERNEL - 1)[None, :])
    dtype = out_ptr.dtype.element_ty
    y = (conv + xf).to(dtype)
    if NORM:
        h = tl.load(h_ptr + b * stride_hb + c, mask=in_c, other=0.0).to(tl.float32)
        h = (h + y.to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + b * stride_hob + c, h, mask=in_c)
        hf = h.to(tl.float32)
        normalized = (hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / C + eps)).to(dtype)
        weight = tl.load(norm_ptr + c, mask=in_c, other=0.0).to(tl.float32)
        y = (weight * normalized.to(tl.float32)).to(dtype)
    tl.store(out_ptr + b * stride_ob + c, y, mask=in_c)


def short_conv_step(
    x: torch.Tensor,
    state: torch.Tensor,
    seq_slots: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One ShortConv step of rows x [B, C] (rows may be strided), each continuing the fp32 state [S, C, kernel-1]
    of its sequence `seq_slots` [B] (updated in place), with the depthwise conv `weight` [C, 1, kernel].

    Returns conv + x in x's dtype; with `residual` h [B, C] and `norm_weight` [C], returns (h + that, its RMSNorm
    with `eps`). Rows sharing a sequence slot (padding) race on its state: give real rows distinct slots.
    """
    rows, channels = x.shape
    kernel = weight.shape[-1]
    if weight.shape != (channels, 1, kernel) or state.shape[1:] != (channels, kernel - 1) or x.stride(1) != 1:
        raise ValueError(
            f"short_conv_step needs x [B, C] with unit column stride, weight [C, 1, k] and state [S, C, k-1]; got "
            f"x {list(x.shape)} (strides {x.stride()}), weight {list(weight.shape)}, state {list(state.shape)}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the ShortConv state is fp32, got {state.dtype}")
    norm = residual is not None
    if norm and (norm_weight is None or residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError("a residual needs norm_weight [C] and the shape of x, with unit column stride")
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(out) if norm else out
    h = residual if norm else x
    _short_conv_step_kernel[(rows,)](
        x,
        state,
        seq_slots,
        weight,
        out,
        h,
        h_out,
        norm_weight if norm else weight,
        channels,
        eps,
        x.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        weight.stride(0),
        weight.stride(2),
        out.stride(0),
        h.stride(0),
        h_out.stride(0),
        KERNEL=kernel,
        NORM=norm,
        BLOCK_C=triton.next_power_of_2(channels),
        BLOCK_W=triton.next_power_of_2(kernel),
        num_warps=8 if channels >= 1024 else 4,
    )
    return (h_out, out) if norm else out
