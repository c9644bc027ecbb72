"""exp, log and log1p inside Triton kernels as torch's CUDA kernels compute them, for kernels that must round where
a torch composite rounds (the router, silu * up).

With PRECISE (a CUDA launch) they call libdevice, whose expf/logf/log1pf torch's kernels call; Triton's own tl.exp
and tl.log are faster approximations that can differ in the last bit, which moves a bf16 rounding or a top-k tie.
Triton's CPU interpreter has no libdevice: there numpy's, through tl.exp and tl.log.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    return libdevice.exp(x) if PRECISE else tl.exp(x)


@triton.jit
def log(x, PRECISE: tl.constexpr):
    return libdevice.log(x) if PRECISE else tl.log(x)


@triton.jit
def log1p(x, PRECISE: tl.constexpr):
    return libdevice.log1p(x) if PRECISE else tl.log(1.0 + x)
