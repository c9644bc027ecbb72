"""A step's last op as one Triton kernel: the LM head's logits to fp32 and each row's greedy token.

A step returns fp32 logits (the sampler's and logprobs' input) and the greedy token of every row; in torch that is
a cast then an argmax, two launches: ~13 µs of a batch-8 decode step on an H100 (the argmax 10), for 8 rows of
64 KB. Here a program per row reads its logits once, writes them as fp32 and keeps a running maximum per lane. The
token is torch's `argmax`: the first index of the greatest value, a NaN counting as greater than any number (the
first NaN wins), so the two agree on every input, ties included (bf16 logits tie often).
"""

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _logits_greedy_kernel(logits_ptr, out_ptr, greedy_ptr, vocab, stride_row, BLOCK_V: tl.constexpr):
    """Row program_id(0): out[row] = float(logits[row]) and greedy[row] = its argmax."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK_V,), tl.int32)  # the first index holding `best` among the lane's columns
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        in_v = v < vocab
        x = tl.load(logits_ptr + row * stride_row + v, mask=in_v, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * vocab + v, x, mask=in_v)
        # strictly greater: a lane sees its columns in order, so it keeps the first of equal values; a NaN beats a
        # number, and no later value beats a NaN
        better = (x > best) | ((x != x) & (best == best))
        best = tl.where(better, x, best)
        where = tl.where(better, v, where)
    nan = best != best
    held = tl.where(tl.max(nan.to(tl.int32), 0) > 0, nan, best == tl.max(best, 0))  # the row's NaNs, else its max
    tl.store(greedy_ptr + row, tl.min(tl.where(held, where, vocab), 0).to(tl.int64))


def logits_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits.float(), logits.argmax(-1)) of logits [N, V] (rows may be strided, columns unit-stride): fp32
    [N, V] contiguous and long [N]."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(
            f"logits_greedy needs logits [N, V] with V > 0 and unit last stride; got {list(logits.shape)} "
            f"(strides {logits.stride()})"
        )
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    greedy = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        _logits_greedy_kernel[(rows,)](logits, out, greedy, vocab, logits.stride(0), BLOCK_V=BLOCK_V, num_warps=8)
    return out, greedy
