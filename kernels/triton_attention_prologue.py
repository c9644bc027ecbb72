"""The decode attention's prologue as one Triton kernel: the K and V ShortConv step, the Q and K RMSNorms and the
KV-cache write (the sliding ring or the full cache), between the q/k/v/r projection and the attention.

In torch that is the conv step over the k and v columns, a norm of four launches for q and for k (cast, rms_norm,
cast, weight), the ring place and two cache scatters: about a dozen latency-bound launches per layer of a few KB
each. Here one program per (row, kv head) does its head's part with the same arithmetic: the conv in fp32 over the
saved inputs and the new one, plus that input, rounded to the model's dtype (`triton_short_conv.conv_step`); k's
and each of the head group's q heads' RMSNorm as transformers computes it (`rms_norm_rows`); k and v stored at the
row's cache place. Sums run in another order than torch's, so results agree to fp32 rounding, not bitwise.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.triton_pdl import chain_launch, chain_start
from inkwell.kernels.triton_short_conv import conv_step, rms_norm_rows


@triton.jit
def _decode_prologue_kernel(
    qkvr_ptr, state_ptr, seq_ptr, pos_ptr, conv_w_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    eps, ring,
    stride_xb, stride_ss, stride_sc, stride_sk, stride_wc, stride_wk, stride_cs, stride_cl, stride_ch,
    stride_ob, stride_oh,
    Q_COLS, KV_COLS, head_dim,
    GROUPS: tl.constexpr, KERNEL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """Row b, kv head g: k and v of head g through their conv step (kv channels g*D.. and KV_COLS + g*D..), k
    normalized, both stored at the row's place; q heads g*GROUPS .. normalized into q_out."""
    chain_start(CHAINED)
    b = tl.program_id(0)
    g = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    seq = tl.load(seq_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    place = pos % ring if SLIDING else pos
    d = tl.arange(0, BLOCK_D)
    in_d = d < head_dim
    row = qkvr_ptr + b * stride_xb
    state_row = state_ptr + seq * stride_ss
    cache = seq * stride_cs + place * stride_cl + g * stride_ch + d
    c_k = g * head_dim + d
    k_in = tl.load(row + Q_COLS + c_k, mask=in_d, other=0.0).to(tl.float32)
    k = conv_step(k_in, c_k, in_d, state_row, conv_w_ptr, stride_sc, stride_sk, stride_wc, stride_wk, KERNEL, BLOCK_W)
    k_weight = tl.load(k_norm_ptr + d, mask=in_d, other=0.0).to(tl.float32)
    k = rms_norm_rows(k.to(dtype).to(tl.float32)[None, :], k_weight, head_dim, eps, dtype)
    tl.store(k_cache_ptr + cache, tl.reshape(k, (BLOCK_D,)), mask=in_d)
    c_v = KV_COLS + c_k
    v_in = tl.load(row + Q_COLS + c_v, mask=in_d, other=0.0).to(tl.float32)
    v = conv_step(v_in, c_v, in_d, state_row, conv_w_ptr, stride_sc, stride_sk, stride_wc, stride_wk, KERNEL, BLOCK_W)
    tl.store(v_cache_ptr + cache, v.to(dtype), mask=in_d)
    heads = g * GROUPS + tl.arange(0, BLOCK_G)
    in_q = (tl.arange(0, BLOCK_G) < GROUPS)[:, None] & in_d[None, :]
    q = tl.load(row + heads[:, None] * head_dim + d[None, :], mask=in_q, other=0.0).to(tl.float32)
    q_weight = tl.load(q_norm_ptr + d, mask=in_d, other=0.0).to(tl.float32)
    q = rms_norm_rows(q, q_weight, head_dim, eps, dtype)
    tl.store(q_out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], q, mask=in_q)


def decode_attention_prologue(
    qkvr: torch.Tensor,
    heads: int,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_slots: torch.Tensor,
    positions: torch.Tensor,
    ring: int | None,
) -> torch.Tensor:
    """From each row's q/k/v/r projection qkvr [B, H*D + 2*KV*D + ...] (q heads, k heads, v heads, then r; rows may
    be strided): k and v through one ShortConv step of the row's sequence `seq_slots[b]` (fp32 state [S, 2*KV*D,
    kernel-1] updated in place, depthwise `conv_weight` [2*KV*D, 1, kernel]), k normalized by `k_norm` [D] and
    both written to keys / values [S, L, KV, D] at the row's place: `positions[b]`, or `positions[b] % ring` for a
    sliding layer's ring. Returns q normalized by `q_norm` [D]: [B, H, D] in qkvr's dtype. Rows sharing a
    sequence slot (padding) race on its state and cache place: give real rows distinct slots."""
    rows = qkvr.shape[0]
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    kv_cols = kv_heads * head_dim
    kernel = conv_weight.shape[-1]
    if (
        heads % kv_heads
        or qkvr.shape[1] < (heads + 2 * kv_heads) * head_dim
        or qkvr.stride(1) != 1
        or keys.shape != values.shape
        or keys.stride() != values.stride()
        or keys.stride(3) != 1
        or conv_weight.shape != (2 * kv_cols, 1, kernel)
        or conv_state.shape[1:] != (2 * kv_cols, kernel - 1)
        or q_norm.shape != (head_dim,)
        or k_norm.shape != (head_dim,)
    ):
        raise ValueError(
            f"decode_attention_prologue needs qkvr [B, >= (H + 2*KV)*D] with unit column stride, keys = values "
            f"[S, L, KV, D], conv weight [2*KV*D, 1, k], conv state [S, 2*KV*D, k-1], norms [D]; got qkvr "
            f"{list(qkvr.shape)}, H {heads}, keys {list(keys.shape)}, values {list(values.shape)}, conv weight "
            f"{list(conv_weight.shape)}, conv state {list(conv_state.shape)}, norms {list(q_norm.shape)} and "
            f"{list(k_norm.shape)}"
        )
    if conv_state.dtype != torch.float32:
        raise ValueError(f"the ShortConv state is fp32, got {conv_state.dtype}")
    q = torch.empty(rows, heads, head_dim, dtype=qkvr.dtype, device=qkvr.device)
    groups = heads // kv_heads
    _decode_prologue_kernel[(rows, kv_heads)](
        qkvr, conv_state, seq_slots, positions, conv_weight, q_norm, k_norm, q, keys, values,
        eps, ring or 1,
        qkvr.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_weight.stride(0), conv_weight.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        q.stride(0), q.stride(1),
        heads * head_dim, kv_cols, head_dim,
        GROUPS=groups, KERNEL=kernel, SLIDING=ring is not None, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_W=triton.next_power_of_2(kernel), num_warps=4,
        **chain_launch(qkvr),
    )  # fmt: skip
    return q
