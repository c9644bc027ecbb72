"""Decode GEMMs computed transposed (swap-AB): out^T = W x^T, the weight's rows the tensor cores' M side (64 or 128 a
tile) and the few tokens of decode their N side, the weight streamed by TMA. Candidate kernels, timed against what
the decode step runs today on inkling-small's shapes, bf16:

  dense   q/k/v/r (3,328 x 2,048) and o (2,048 x 2,048): cuBLAS, main's Triton GEMM (`dense.linear`) and its
          `lora_linear` with 1 and 8 rank-16 adapters, against the swap-AB GEMM (x by TMA too) over its tiles
  experts gate/up [18, 1,024, 2,048] and down [18, 2,048, 512] on dispatched rows: `expert_matmul`, against the
          swap-AB GEMM (the rows gathered by pointer, each expert's weight rows by TMA from its [E x N, K] view)

No LoRA in the candidates: they say what the GEMM can reach, not what a LoRA epilogue costs in it (docs/benchmarks.md,
"The decode GEMMs with the weight on the tensor cores' M side"). Every figure is µs per call from CUDA-graph
replays over SETS weight sets (`bench_lora_kernels.time_graph`), so weights come from HBM; each candidate's output is
checked against main's (its largest difference printed).
Each tile compiles once per token count (~200 compiles for the four defaults, a few minutes).
Run: python benchmarks/bench_swap_ab.py [--tokens 8 32 64 128] [--out swap_ab.json]
"""

import argparse
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_expert_matmul import rows_of
from bench_lora_kernels import SETS, time_graph, write_rows
from triton.tools.tensor_descriptor import TensorDescriptor

from inkwell.kernels import expert_matmul, triton_moe
from inkwell.kernels.triton_lora import dense
from inkwell.kernels.triton_lora.common import pow2
from inkwell.models.presets import preset_config

PROJECTIONS = {"qkvr": (3328, (0, 2048, 2560, 3072, 3328)), "o": (2048, None)}  # columns, slices; K = 2,048
# (BLOCK_N, BLOCK_K, stages): every best tile of the H200 sweep had 4-6 stages
TILES = list(itertools.product((64, 128), (64, 128, 256), (4, 6)))
SHARED_MEMORY = 220_000  # bytes a tile's pipeline may take of the SM's 227 KB


@triton.jit
def _dense_swap_kernel(
    w_desc, x_desc, out_ptr, T, N, stride_ot, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    t0 = tl.program_id(1) * BLOCK_T
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(w_desc.load([n0, k0]), x_desc.load([t0, k0]).T, acc)
    rn = n0 + tl.arange(0, BLOCK_N)
    rt = t0 + tl.arange(0, BLOCK_T)
    mask = (rn < N)[:, None] & (rt < T)[None, :]
    tl.store(out_ptr + rt[None, :] * stride_ot + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expert_swap_kernel(
    x_ptr, w_desc, ends_ptr, tokens_ptr, out_ptr, N, stride_xm, stride_om, K: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n_block, m_block, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first_row, end = triton_moe.expert_row_block(ends_ptr, e, m_block, BLOCK_M)
    if first_row >= end:
        return
    r = first_row + tl.arange(0, BLOCK_M)
    in_r = r < end
    src = tl.load(tokens_ptr + r, mask=in_r, other=0).to(tl.int64) if GATHER else r
    x_ptrs = x_ptr + src[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]
    row0 = e * N + n_block * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(w_desc.load([row0, k0]), tl.load(x_ptrs + k0, mask=in_r[None, :], other=0.0), acc)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + r[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=in_r[None, :])


def timed(call, want: torch.Tensor, out: torch.Tensor) -> tuple[float, float] | None:
    """(µs, largest difference from `want`) of call(i), or None where the tile does not compile or fit."""
    try:
        call(0)
        torch.cuda.synchronize()
    except (triton.CompilationError, triton.runtime.errors.OutOfResources):
        return None
    return time_graph(call), float((out.float() - want.float()).abs().max())


def dense_row(name: str, tokens: int, gen: torch.Generator) -> dict:
    n, offsets = PROJECTIONS[name]
    k, dev = 2048, dict(device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(**dev) for _ in range(SETS)]
    parts = 1 if offsets is None else len(offsets) - 1
    a = (torch.randn(8, parts * 16, k, generator=gen) / k**0.5).to(**dev)
    b = (torch.randn(8, n, 16, generator=gen) / 4).to(**dev)
    x = torch.randn(tokens, k, generator=gen).to(**dev)
    out = torch.empty(tokens, n, **dev)
    row = dict(projection=name, tokens=tokens, cublas=time_graph(lambda i: torch.mm(x, ws[i].T, out=out)))
    row["main_gemm"] = time_graph(lambda i: dense.linear(x, ws[i]))
    ones = torch.ones(8, device="cuda")
    for adapters in (1, 8):
        slots = torch.arange(tokens, device="cuda", dtype=torch.int32) % adapters
        row[f"main_lora_{adapters}"] = time_graph(
            lambda i, s=slots: dense.lora_linear(x, ws[i], a, b, s, ones, offsets)
        )
    want = x @ ws[0].T
    block_t = pow2(tokens, 16, 128)
    row["swap"] = {}
    for block_n, block_k, stages in TILES:
        if (block_n + block_t) * block_k * 2 * stages > SHARED_MEMORY:
            continue
        x_desc = TensorDescriptor.from_tensor(x, [block_t, block_k])
        w_descs = [TensorDescriptor.from_tensor(w, [block_n, block_k]) for w in ws]
        grid = (triton.cdiv(n, block_n), triton.cdiv(tokens, block_t))

        def call(i, w_descs=w_descs, x_desc=x_desc, grid=grid, block_n=block_n, block_k=block_k, stages=stages):
            _dense_swap_kernel[grid](
                w_descs[i], x_desc, out, tokens, n, out.stride(0), K=k, BLOCK_N=block_n, BLOCK_T=block_t,
                BLOCK_K=block_k, num_warps=4, num_stages=stages,
            )  # fmt: skip

        result = timed(call, want, out)
        if result is not None:
            row["swap"][f"{block_n}x{block_k}x{stages}"] = result
    return row


def expert_row(name: str, tokens: int, gen: torch.Generator) -> dict:
    cfg = preset_config("inkling-small")
    count, hidden, ffn = cfg.n_routed_experts + cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dev = dict(device="cuda", dtype=torch.bfloat16)
    row_tokens, ends, _, _ = rows_of(tokens, cfg, gen)
    if name == "gate_up":
        inp, tok, (n, k) = torch.randn(tokens, hidden, generator=gen).to(**dev), row_tokens, (2 * ffn, hidden)
    else:
        inp, tok, (n, k) = torch.randn(row_tokens.shape[0], ffn, generator=gen).to(**dev), None, (hidden, ffn)
    ws = [(torch.randn(count, n, k, generator=gen) / k**0.5).to(**dev) for _ in range(SETS)]
    want = expert_matmul(inp, ws[0], ends, tok, tokens)
    row = dict(gemm=name, tokens=tokens, rows=int(ends[-1]))
    row["main"] = time_graph(lambda i: expert_matmul(inp, ws[i], ends, tok, tokens))
    out = torch.empty_like(want)
    block_m = triton_moe.expert_row_tile(tokens)
    row["swap"] = {}
    for block_n, block_k, stages in TILES:
        if block_k > k or (block_n + block_m) * block_k * 2 * stages > SHARED_MEMORY:
            continue
        w_descs = [TensorDescriptor.from_tensor(w.view(count * n, k), [block_n, block_k]) for w in ws]
        grid = (n // block_n, triton.cdiv(tokens, block_m), count)

        def call(i, w_descs=w_descs, grid=grid, block_n=block_n, block_k=block_k, stages=stages):
            _expert_swap_kernel[grid](
                inp, w_descs[i], ends, ends if tok is None else tok, out, n, inp.stride(0), out.stride(0), K=k,
                GATHER=tok is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                num_stages=stages,
            )  # fmt: skip

        result = timed(call, want, out)
        if result is not None:
            row["swap"][f"{block_n}x{block_k}x{stages}"] = result
    return row


def best(row: dict) -> str:
    tile, (us, diff) = min(row["swap"].items(), key=lambda kv: kv[1][0])
    return f"swap-AB {us:6.2f} ({tile}, max diff {diff:.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--out", type=Path, help="write every row as JSON here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in args.tokens:
        for name in PROJECTIONS:
            row = dense_row(name, tokens, gen)
            rows.append(row)
            mains = " / ".join(f"{row[f'main_lora_{a}']:.2f}" for a in (1, 8))
            print(
                f"{row['projection']:>5} {tokens:>4} tokens: cuBLAS {row['cublas']:6.2f}, main's GEMM "
                f"{row['main_gemm']:6.2f}, main's lora_linear 1 / 8 adapters {mains}; {best(row)}",
                flush=True,
            )
        for name in ("gate_up", "down"):
            row = expert_row(name, tokens, gen)
            rows.append(row)
            print(f"{name:>7} {tokens:>4} tokens ({row['rows']} rows): expert_matmul {row['main']:6.2f}; {best(row)}")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
