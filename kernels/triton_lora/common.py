"""What the Triton LoRA kernels share: jit helpers, host-side tiling and checks, and the limits that pick a kernel.

The jit helpers locate slices and (slot, expert) groups and add a delta in place, as the torch twins round it;
the host helpers turn shapes into tile sizes and check them.
"""

import torch
import triton
import triton.language as tl

from inkwell.kernels.torch_ops import ExpertGroups

SENTINEL = tl.constexpr(2**30)  # above every group key and local expert id: "no row left", "no second group"
MAX_SLICES = 4
# Above this many tokens a program walks its token tile's slots (prefill: long runs of one slot); up to it the shrink
# runs one program per (tile, slot), its K loop split too, and so does the expand of a narrow one-slice projection
# (`expand.walks`: sliced and wide ones walk, with programs enough). Decode batches of 64-256 sequences hold every
# slot in each tile, and a few programs walking 8 slots each left most of the GPU idle.
SLOT_LOOP_MIN_TOKENS = 256


@triton.jit
def slice_of(n, o1, o2, o3):
    """Slice index of output column(s) n, given the slice starts o1 <= o2 <= o3 (N where unused)."""
    return (n >= o1).to(tl.int32) + (n >= o2).to(tl.int32) + (n >= o3).to(tl.int32)


@triton.jit
def row_slots(slot_ptr, expert_ptr, rt, in_t, first, E, HAS_EXPERTS: tl.constexpr):
    """Each row's slot and expert - first; rows of experts outside first .. first+E-1 get slot -1."""
    slots = tl.load(slot_ptr + rt, mask=in_t, other=-1)
    if HAS_EXPERTS:
        local = tl.load(expert_ptr + rt, mask=in_t, other=0).to(tl.int32) - first
        slots = tl.where((local >= 0) & (local < E), slots, -1)
    else:
        local = tl.zeros_like(rt)
    return slots, local


@triton.jit
def row_keys(rows, slots, local, E):
    """Group key slot * E + local expert of each selected row; SENTINEL elsewhere."""
    return tl.where(rows, slots.to(tl.int32) * E + local, SENTINEL)


@triton.jit
def expand_acc(
    y_ptr,
    rt,
    sel,
    stride_yt,
    stride_yr,
    b_base,
    b_cols,
    stride_br,
    part,
    r_lo,
    r_hi,
    R,
    in_n,
    acc,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """acc (fp32 [T, N]) plus the selected rows' y rank blocks (virtual ranks r_lo .. r_hi-1) times B^T, each
    column reading only its slice's block (see `_expand_kernel`). Rows not selected add exact zeros, so one acc
    gathers a tile's groups, each row its own group's product, as a fresh acc of its own would hold it."""
    for r0 in range(r_lo, r_hi, BLOCK_R):
        rj = r0 + tl.arange(0, BLOCK_R)
        yt = tl.load(
            y_ptr + rt[:, None] * stride_yt + rj[None, :] * stride_yr,
            mask=sel[:, None] & (rj[None, :] < r_hi),
            other=0.0,
        )
        local = rj[:, None] - (part * R)[None, :]  # rank inside column n's slice
        bt = tl.load(
            b_base + b_cols[None, :] + local * stride_br, mask=(local >= 0) & (local < R) & in_n[None, :], other=0.0
        )
        acc = lora_dot(yt, bt, acc, DOT_FP32, PRECISION)
    return acc


@triton.jit
def lora_dot(yt, bt, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + yt @ bt (acc None: a fresh fp32 product) with the operands `dot_operands` chose: both in fp32
    (DOT_FP32), else B in y's dtype."""
    if DOT_FP32:
        return tl.dot(yt.to(tl.float32), bt.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(yt, bt.to(yt.dtype), acc, input_precision=PRECISION)


@triton.jit
def plus_delta(old, acc, scale, dtype: tl.constexpr):
    """old + acc * scale in `dtype`, the delta rounded to it first, as the torch twins add it."""
    delta = (acc * scale).to(dtype).to(tl.float32)
    return (old.to(tl.float32) + delta).to(dtype)


@triton.jit
def add_delta(out_ptr, rt, rn, stride_ot, stride_on, sel, in_n, acc, scale):
    """out[rows, columns] += acc * scale (see `plus_delta`)."""
    out_ptrs = out_ptr + rt[:, None] * stride_ot + rn[None, :] * stride_on
    m = sel[:, None] & in_n[None, :]
    old = tl.load(out_ptrs, mask=m, other=0.0)
    tl.store(out_ptrs, plus_delta(old, acc, scale, out_ptr.dtype.element_ty), mask=m)


# ---- host side: tile sizes and shape checks -------------------------------------------------------


def pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, triton.next_power_of_2(max(n, 1)))
    return p if hi is None else min(p, hi)


def dot_precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 operands (the torch twins do not use TF32); tensor-core default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_operands(a_dtype: torch.dtype, b_dtype: torch.dtype) -> dict[str, bool | str]:
    """The tl.dot kernels' DOT_FP32 and PRECISION for operands of these dtypes: both in fp32 with full fp32
    products where either is fp32 or the dtypes differ, else both in their own dtype."""
    fp32 = a_dtype == torch.float32 or a_dtype != b_dtype
    return {"DOT_FP32": fp32, "PRECISION": "ieee" if fp32 else "tf32"}


def token_block(tokens: int) -> int:
    return pow2(tokens, 16, 64)


def processors(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's GPU, which a launch of more programs runs in several waves; 1 for a CPU
    tensor (Triton's interpreter), where every tile shape is a choice of the tests'."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 1


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def parse_slices(slice_offsets: tuple[int, ...] | None, n: int) -> tuple[int, int, int, int]:
    """(P, o1, o2, o3) from slice start offsets (0, ..., N); unused starts are N."""
    offsets = (0, n) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    p = len(offsets) - 1
    require(
        1 <= p <= MAX_SLICES and offsets[0] == 0 and offsets[-1] == n,
        f"slice_offsets must run from 0 to N={n} with 1..{MAX_SLICES} slices, got {offsets}",
    )
    require(all(a < b for a, b in zip(offsets, offsets[1:], strict=False)), f"slice_offsets must increase: {offsets}")
    starts = list(offsets[1:-1]) + [n] * (MAX_SLICES - p)
    return p, starts[0], starts[1], starts[2]


def local_split(groups: ExpertGroups) -> int:
    """The kernels' `split`: the second group's first expert counted from `first`; SENTINEL with one group."""
    return SENTINEL.value if groups.split is None else groups.split - groups.first


def scale_strides(scalings: torch.Tensor, slots: int, parts: int) -> tuple[int, int]:
    """The slot and part strides of scalings [S] (part stride 0) or [S, parts]."""
    shape = tuple(scalings.shape)
    message = f"scalings must be [S={slots}] or [S, {parts}], got {shape}"
    if scalings.dim() == 1:
        require(shape[0] == slots, message)
        return scalings.stride(0), 0
    require(shape == (slots, parts), message)
    return scalings.stride(0), scalings.stride(1)
