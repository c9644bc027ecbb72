"""Inkling's ShortConv as Triton kernels, optionally with the residual add and RMSNorm after it: one decode step
(`short_conv_step`) and prefill chunks (`short_conv_chunks`).

A decode step runs a ShortConv at three sites per layer. In torch each is a gather of the saved inputs, a concat,
a depthwise conv, a scatter of the shifted window, the residual and a cast; the attention and MLP sites are then
added to the residual stream and normalized for the next block. Those are about a dozen latency-bound launches of
a few KB each, ~40% of a CUDA-graph decode step's launches. Here one program per row does all of it with the
same arithmetic: the conv in fp32 over the row's saved inputs and its new one, plus that input, rounded to the
model's dtype; then (with `residual`) the residual add in the model's dtype and transformers' RMSNorm (normalized
in fp32, rounded, times the weight). Sums run in another order than torch's conv and norm, so results agree to
fp32 rounding, not bitwise.

Over prefill chunks (B chunks padded to L tokens, each continuing its sequence's state) torch casts to fp32,
concatenates the saved inputs, runs an fp32 conv and gathers the new tail: several launches and fp32 copies of a
memory-bound op. `short_conv_chunks` reads x once and writes the output once, in one launch: a program per run of
a chunk's tokens and a block of channels loads the weights once and loops over token blocks, whose earlier taps
are shifted reloads of rows it has just read (L1). Only a chunk's first kernel-1 tokens reach back into the saved
inputs: the chunk's first program does those row by row, before its loop, and then writes the new state, behind a
barrier after its reads of the old one; the loop leaves those tokens out and no other program touches the state,
so no order between programs matters.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_lora.common import processors
from inkwell.kernels.triton_moe import combine_row
from inkwell.kernels.triton_pdl import chain_launch, chain_start


@triton.jit
def conv_step(
    xf, c, in_c, state_row, w_ptr, stride_sc, stride_sk, stride_wc, stride_wk,
    KERNEL: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One causal-conv step of channels `c` (mask `in_c`): the window [saved taps of `state_row`, new input xf]
    (fp32) times the depthwise weights, plus xf -> fp32; the saved taps shift by one to end at xf."""
    j = tl.arange(0, BLOCK_W)
    taps = state_row + c[:, None] * stride_sc + j[None, :] * stride_sk  # [BLOCK_C, BLOCK_W]
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
    return conv + xf


@triton.jit
def rms_norm_rows(hf, weight, n, eps, dtype: tl.constexpr):
    """transformers' RMSNorm of each row of hf [R, BLOCK] (fp32 holding `dtype` values; n real columns, the rest
    0): normalized in fp32, rounded to `dtype`, times the fp32 `weight` [BLOCK], rounded -> [R, BLOCK] `dtype`."""
    normalized = (hf * tl.rsqrt(tl.sum(hf * hf, axis=1) / n + eps)[:, None]).to(dtype)
    return (weight[None, :] * normalized.to(tl.float32)).to(dtype)


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
    mix_ptr,
    places_ptr,
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
    COMBINE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHAINED: tl.constexpr,
):
    """Row b: window = [state[seq_b], x_b] (KERNEL taps), conv + x_b -> out (or, with NORM, h_b + that -> h_out
    and its RMSNorm -> out); state[seq_b] <- the window's last KERNEL-1 taps. With COMBINE (k > 0), x holds the
    MoE's dispatched rows and x_b is row b's combine of its k rows (`triton_moe.combine_row`), rounded as
    `moe_combine` rounds it."""
    chain_start(CHAINED)
    b = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    in_c = c < C
    seq = tl.load(seq_ptr + b).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    if COMBINE > 0:
        mixed = combine_row(x_ptr, mix_ptr, places_ptr, b.to(tl.int64), c, in_c, stride_xb, COMBINE)
        xf = mixed.to(dtype).to(tl.float32)
    else:
        xf = tl.load(x_ptr + b * stride_xb + c, mask=in_c, other=0.0).to(tl.float32)
    state_row = state_ptr + seq * stride_ss
    conv = conv_step(xf, c, in_c, state_row, w_ptr, stride_sc, stride_sk, stride_wc, stride_wk, KERNEL, BLOCK_W)
    y = conv.to(dtype)
    if NORM:
        h = tl.load(h_ptr + b * stride_hb + c, mask=in_c, other=0.0).to(tl.float32)
        h = (h + y.to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + b * stride_hob + c, h, mask=in_c)
        weight = tl.load(norm_ptr + c, mask=in_c, other=0.0).to(tl.float32)
        y = tl.reshape(rms_norm_rows(h.to(tl.float32)[None, :], weight, C, eps, dtype), (BLOCK_C,))
    tl.store(out_ptr + b * stride_ob + c, y, mask=in_c)


def short_conv_step(
    x: torch.Tensor,
    state: torch.Tensor,
    seq_slots: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    combine: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One ShortConv step of rows x [B, C] (rows may be strided), each continuing the fp32 state [S, C, kernel-1]
    of its sequence `seq_slots` [B] (updated in place), with the depthwise conv `weight` [C, 1, kernel].

    Returns conv + x in x's dtype; with `residual` h [B, C] and `norm_weight` [C], returns (h + that, its RMSNorm
    with `eps`). Rows sharing a sequence slot (padding) race on its state: give real rows distinct slots.
    With `combine` (weights [B*k], places [B*k]), x is the MoE's dispatched rows [B*k, C] and row b's input their
    `moe_combine` (no combine kernel of its own: one launch fewer per MoE layer at decode).
    """
    rows, channels = seq_slots.shape[0], x.shape[1]
    kernel = weight.shape[-1]
    k = 0
    if combine is not None:
        k = x.shape[0] // max(rows, 1)
        if x.shape[0] != rows * k or any(t.shape != (x.shape[0],) for t in combine):
            raise ValueError(
                f"a combined input needs x [B*k, C] and weights and places [B*k] for B = {rows} sequence slots; got "
                f"x {list(x.shape)}, {[list(t.shape) for t in combine]}"
            )
    elif x.shape[0] != rows:
        raise ValueError(f"x has {x.shape[0]} rows for {rows} sequence slots")
    if weight.shape != (channels, 1, kernel) or state.shape[1:] != (channels, kernel - 1) or x.stride(1) != 1:
        raise ValueError(
            f"short_conv_step needs x [B, C] with unit column stride, weight [C, 1, k] and state [S, C, k-1]; got "
            f"x {list(x.shape)} (strides {x.stride()}), weight {list(weight.shape)}, state {list(state.shape)}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the ShortConv state is fp32, got {state.dtype}")
    norm = residual is not None
    if norm and (norm_weight is None or residual.shape != (rows, channels) or residual.stride(1) != 1):
        raise ValueError("a residual needs norm_weight [C] and the shape [B, C] of the output, with unit column stride")
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(out) if norm else out
    h = residual if norm else out
    mix, places = combine if combine is not None else (weight, seq_slots)  # unread without COMBINE
    _short_conv_step_kernel[(rows,)](
        x,
        state,
        seq_slots,
        weight,
        out,
        h,
        h_out,
        norm_weight if norm else weight,
        mix,
        places,
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
        COMBINE=k,
        BLOCK_C=triton.next_power_of_2(channels),
        BLOCK_W=triton.next_power_of_2(kernel),
        num_warps=8 if channels >= 1024 else 4,
        **chain_launch(x),
    )
    return (h_out, out) if norm else out


@triton.jit
def _tap(tile, taps, j: tl.constexpr):
    """Row j of a [BLOCK_W, BLOCK_C] tile of taps, as a [BLOCK_C] vector."""
    return tl.sum(tl.where((taps == j)[:, None], tile, 0.0), axis=0)


@triton.jit
def _finish(
    acc, i, start, c, in_c, out_ptr, h_row, h_out_ptr, norm_w, out_first, L, C, eps, stride_hl, NORM: tl.constexpr
):
    """Conv + x in fp32 `acc` [R, BLOCK_C] of tokens `i` [R] -> out in its dtype (or, with NORM, h + that -> h_out
    and its RMSNorm -> out), for the tokens start <= i < L."""
    in_tile = ((i >= start) & (i < L))[:, None] & in_c[None, :]
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    out_rows = (out_first + i)[:, None] * C + c[None, :]  # out and h_out are contiguous [B, L, C]
    if NORM:
        h = tl.load(h_row + i.to(tl.int64)[:, None] * stride_hl + c[None, :], mask=in_tile, other=0.0)
        h = (h.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + out_rows, h, mask=in_tile)
        y = rms_norm_rows(h.to(tl.float32), norm_w, C, eps, dtype)
    tl.store(out_ptr + out_rows, y, mask=in_tile)


@triton.jit
def _short_conv_chunks_kernel(
    x_ptr,
    state_ptr,
    seq_ptr,
    len_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    h_out_ptr,
    norm_ptr,
    L,
    C,
    eps,
    stride_xb,
    stride_xl,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_hb,
    stride_hl,
    KERNEL: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Chunk b, channels cb*BLOCK_C .. +BLOCK_C, ITERS blocks of BLOCK_L tokens from lb*ITERS*BLOCK_L: each token's
    conv over the KERNEL inputs ending at it in [state[seq_b], x_b], + x -> `_finish`.

    Only tokens 0 .. KERNEL-2 have inputs before the chunk: the chunk's first program (lb = 0) does them first, row
    by row with the saved inputs, then writes the new state (behind a barrier after every read of the old one);
    the loop over token blocks leaves them out. No other program touches the chunk's state."""
    lb = tl.program_id(0)
    cb = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < C
    x_row = x_ptr + b * stride_xb
    h_row = h_ptr + b * stride_hb
    norm_w = tl.load(norm_ptr + c, mask=in_c, other=0.0).to(tl.float32)  # unused without NORM
    if lb == 0:
        saved = state_ptr + tl.load(seq_ptr + b).to(tl.int64) * stride_ss + c[None, :] * stride_sc  # [1, BLOCK_C]
        # token r's tap j is saved input r + j while r + j < KERNEL-1, else token r + j - (KERNEL-1)
        for r in tl.static_range(KERNEL - 1):
            token = tl.full([1], r, tl.int32)
            acc = tl.zeros([1, BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KERNEL):
                w = tl.load(w_ptr + c[None, :] * stride_wc + j * stride_wk, mask=in_c[None, :], other=0.0)
                if r + j < KERNEL - 1:
                    before = tl.load(saved + (r + j) * stride_sk, mask=in_c[None, :], other=0.0)
                else:
                    before = tl.load(
                        x_row + (r + j - (KERNEL - 1)) * stride_xl + c[None, :],
                        mask=(token < L)[:, None] & in_c[None, :],
                        other=0.0,
                    ).to(tl.float32)
                acc += before * w.to(tl.float32)
            x_r = tl.load(x_row + r * stride_xl + c[None, :], mask=(token < L)[:, None] & in_c[None, :], other=0.0)
            acc += x_r.to(tl.float32)
            _finish(acc, token, 0, c, in_c, out_ptr, h_row, h_out_ptr, norm_w, b * L, L, C, eps, stride_hl, NORM)
        # the new state: inputs length + t (t < KERNEL-1) of [saved (KERNEL-1), chunk]. Step t reads input
        # length + t > t and writes place t, a barrier between: no read of a place already written
        length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int64), 0), L)
        for t in tl.static_range(KERNEL - 1):
            place = length + t
            in_saved = place < KERNEL - 1
            from_saved = tl.load(saved + place * stride_sk, mask=in_c[None, :] & in_saved, other=0.0)
            from_x = tl.load(
                x_row + (place - (KERNEL - 1)) * stride_xl + c[None, :], mask=in_c[None, :] & ~in_saved, other=0.0
            )
            tail = tl.where(in_saved, from_saved, from_x.to(tl.float32))
            tl.debug_barrier()
            tl.store(saved + t * stride_sk, tail, mask=in_c[None, :] & (length > 0))
    # the weights [BLOCK_W, BLOCK_C], taps first like the token tiles, loaded once for all the program's tokens
    taps = tl.arange(0, BLOCK_W)
    weights = tl.load(
        w_ptr + taps[:, None] * stride_wk + c[None, :] * stride_wc,
        mask=(taps < KERNEL)[:, None] & in_c[None, :],
        other=0.0,
    ).to(tl.float32)
    newest = _tap(weights, taps, KERNEL - 1)[None, :]
    rows = tl.arange(0, BLOCK_L)
    for it in range(ITERS):
        i = (lb * ITERS + it) * BLOCK_L + rows
        in_tile = (i < L)[:, None] & in_c[None, :]
        xf = tl.load(x_row + i.to(tl.int64)[:, None] * stride_xl + c[None, :], mask=in_tile, other=0.0)
        xf = xf.to(tl.float32)
        acc = xf + xf * newest  # x itself, then the taps from the newest back
        for j in tl.static_range(KERNEL - 1):  # earlier tokens: shifted reloads of rows just read (L1)
            src = i - (KERNEL - 1 - j)
            x_tap = tl.load(
                x_row + src.to(tl.int64)[:, None] * stride_xl + c[None, :],
                mask=(src >= 0)[:, None] & in_tile,
                other=0.0,
            )
            acc += x_tap.to(tl.float32) * _tap(weights, taps, j)[None, :]
        _finish(acc, i, KERNEL - 1, c, in_c, out_ptr, h_row, h_out_ptr, norm_w, b * L, L, C, eps, stride_hl, NORM)


def chunk_launch(
    batch: int,
    length: int,
    channels: int,
    norm: bool,
    element_size: int,
    processors: int,
    block_tokens: int | None = None,
    block_channels: int | None = None,
    token_blocks: int | None = None,
    num_warps: int | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_L, BLOCK_C, ITERS, num_warps), each as given or: whole rows of up to 2048 channels (all of them with
    the norm) in token blocks of ~8K elements, a warp per 2 KB of x (16 bytes a thread in each of 4 rows); each
    program loops over blocks of up to 32 tokens in all, for which it loads the weights once, as long as every one
    of the device's `processors` still gets a program. (At inkling-small's widths in bf16, 8 x 1,024 tokens: tiles
    of 4 x 2048 or 8 x 1024 tokens x channels, 8 warps, 8 blocks or 4 a program; ptxas for sm_90 gives them
    100-128 registers, so 2 programs fit on a processor. Untimed: benchmarks/bench_short_conv.py --sweep.)"""
    block_c = block_channels or (
        triton.next_power_of_2(channels) if norm else min(triton.next_power_of_2(channels), 2048)
    )
    block_l = block_tokens or max(1, min(8192 // block_c, triton.next_power_of_2(length), 64))
    if block_l & (block_l - 1) or block_c & (block_c - 1) or (norm and block_c < channels):
        raise ValueError(
            f"block_tokens and block_channels must be powers of two, block_channels >= C with a residual; got "
            f"{block_l} and {block_c} for C = {channels}"
        )
    iters = token_blocks
    if iters is None:
        blocks = triton.cdiv(length, block_l) * triton.cdiv(channels, block_c) * batch
        iters = max(1, 32 // block_l)
        while iters > 1 and blocks // iters < processors:
            iters //= 2
    warps = num_warps or min(16, max(4, block_l * block_c * element_size // 2048))
    return block_l, block_c, iters, warps


def short_conv_chunks(
    x: torch.Tensor,
    state: torch.Tensor,
    seq_slots: torch.Tensor,
    lengths: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    block_tokens: int | None = None,
    block_channels: int | None = None,
    token_blocks: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ShortConv over B chunks padded to L tokens, x [B, L, C] (unit column stride; rows may be strided, e.g. a
    view of flat rows [B*L, C]): chunk b continues the fp32 state [S, C, kernel-1] of its sequence `seq_slots[b]`
    with `lengths[b]` real tokens (0 <= length <= L; 0 = a padding chunk, which changes no state), through the
    depthwise conv `weight` [C, 1, kernel]. The state is updated in place to the last kernel-1 inputs up to the
    chunk's real length. `seq_slots` and `lengths` are device integer tensors [B]: nothing here waits on the
    device, and the grid depends on shapes only.

    Returns conv + x [B, L, C] in x's dtype; with `residual` h [B, L, C] (unit column stride) and `norm_weight` [C],
    returns (h + that, its RMSNorm with `eps`), both [B, L, C]. Outputs at padding places (j >= length) are
    computed as if the chunk went on. Chunks sharing a slot race on it: give real chunks distinct slots (padding
    chunks never write). `block_tokens`, `block_channels`, `token_blocks` (blocks a program loops over) and
    `num_warps` override the launch shape (tuning, tests).
    """
    if x.dim() != 3:
        raise ValueError(f"short_conv_chunks needs x [B, L, C], got {list(x.shape)}")
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    if (
        kernel < 2
        or weight.shape != (channels, 1, kernel)
        or state.dim() != 3
        or state.shape[1:] != (channels, kernel - 1)
        or x.stride(2) != 1
    ):
        raise ValueError(
            f"short_conv_chunks needs x [B, L, C] with unit column stride, weight [C, 1, k] (k >= 2) and state "
            f"[S, C, k-1]; got x {list(x.shape)} (strides {x.stride()}), weight {list(weight.shape)}, state "
            f"{list(state.shape)}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the ShortConv state is fp32, got {state.dtype}")
    if seq_slots.shape != (batch,) or lengths.shape != (batch,):
        raise ValueError(
            f"seq_slots and lengths need one entry per chunk ({batch}); got {list(seq_slots.shape)} and "
            f"{list(lengths.shape)}"
        )
    norm = residual is not None
    if norm and (
        norm_weight is None or norm_weight.shape != (channels,) or residual.shape != x.shape or residual.stride(2) != 1
    ):
        raise ValueError("a residual needs norm_weight [C] and the shape of x, with unit column stride")
    block_l, block_c, iters, warps = chunk_launch(
        batch,
        length,
        channels,
        norm,
        x.element_size(),
        processors(x),
        block_tokens,
        block_channels,
        token_blocks,
        num_warps,
    )
    out = torch.empty(batch, length, channels, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(out) if norm else out
    if out.numel() == 0:
        return (h_out, out) if norm else out
    h = residual if norm else x
    grid = (triton.cdiv(length, block_l * iters), triton.cdiv(channels, block_c), batch)
    _short_conv_chunks_kernel[grid](
        x,
        state,
        seq_slots,
        lengths,
        weight,
        out,
        h,
        h_out,
        norm_weight if norm else weight,
        length,
        channels,
        eps,
        x.stride(0),
        x.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        weight.stride(0),
        weight.stride(2),
        h.stride(0),
        h.stride(1),
        KERNEL=kernel,
        NORM=norm,
        BLOCK_L=block_l,
        BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(kernel),
        ITERS=iters,
        num_warps=warps,
    )
    return (h_out, out) if norm else out
