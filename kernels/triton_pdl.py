"""The decode step's chain of programmatic dependent launches: what a chained kernel may do before it waits.

A kernel launched with `launch_pdl` starts as soon as every program of the kernel before it has called
`gdc_launch_dependents`, which chained kernels do first thing. Until its `gdc_wait` it may only read what no kernel
of the step before it writes (weights; the decode attention also reads the cache entries of earlier steps) and
write nothing; after the wait every kernel before it in the stream has finished and its writes are visible. Every
chained kernel waits, so one wait covers the whole chain before it. A decode step is ~230 launches of a few µs,
most of it latency: chained, a GEMM streams its weight into L2 while the kernel before it still runs, and a
launch's start overlaps its predecessor's tail.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def chain_launch(t: torch.Tensor, chained: bool = True) -> dict:
    """A chained kernel's CHAINED and launch options over tensors on t's device, from one rule, so no kernel launched
    early lacks its wait: Triton's CPU interpreter has no programmatic launch, so there the kernels run one after
    another with their waits compiled out. `chained` False (a kernel that chains only at some call sites): a plain
    launch."""
    return {"CHAINED": True, "launch_pdl": True} if chained and t.is_cuda else {"CHAINED": False}


def pair_launch(t: torch.Tensor) -> dict:
    """The launch of a LoRA pair's GEMM, the kernel after a chained shrink (`wait_then_trigger`): early on CUDA, but
    not CHAINED, since it reads x before any wait of its own and waits for the shrink's y in its epilogue."""
    return {"CHAINED": False, "launch_pdl": True} if t.is_cuda else {"CHAINED": False}


@triton.jit
def chain_start(CHAINED: tl.constexpr):
    """A chained kernel's first step: let the next kernel launch, then wait for every kernel before this one."""
    if CHAINED:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def wait_then_trigger():
    """Wait for every kernel before this one, then let the next kernel launch: a LoRA pair's shrink, so its GEMM
    (`pair_launch`) starts only once x is written, and that GEMM after its wait for y."""
    gdc_wait()
    gdc_launch_dependents()


def rows_prefetchable(weight: torch.Tensor) -> bool:
    """Whether each [N, K] matrix of `weight` (its last two dims) holds its rows as one 16-byte-aligned run of bytes,
    so `prefetch_rows_l2` may ask L2 for a block of rows in bulk."""
    k = weight.shape[-1]
    contiguous = weight.stride(-1) == 1 and weight.stride(-2) == k
    return contiguous and weight.data_ptr() % 16 == 0 and (k * weight.element_size()) % 16 == 0


@triton.jit
def prefetch_rows_l2(w_ptr, n0, N, K, stride_wn, BLOCK_N: tl.constexpr):
    """Ask L2 for rows n0 .. n0 + BLOCK_N (those below N) of the [N, K] weight at `w_ptr` (`rows_prefetchable`)."""
    width = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    prefetch_l2(w_ptr + n0 * stride_wn, tl.minimum(N - n0, BLOCK_N) * K * width, 128)


@triton.jit
def prefetch_l2(base, nbytes, CHUNKS: tl.constexpr):
    """Ask L2 for `nbytes` (a multiple of 16) from `base` (16-byte aligned) in CHUNKS bulk prefetches: hints on sm_90
    with nothing to wait for, so the program goes on at once."""
    chunk = tl.cdiv(tl.cdiv(nbytes, CHUNKS), 16) * 16
    start = tl.arange(0, CHUNKS) * chunk
    size = tl.maximum(tl.minimum(chunk, nbytes - start), 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base.to(tl.pointer_type(tl.int8)) + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
