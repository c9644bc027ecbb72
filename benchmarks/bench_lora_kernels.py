"""Multi-LoRA kernel timings on one GPU: inkwell's Triton kernels vs torch gather/bmm vs the base GEMM.

Rank 16, hidden 2048, bf16; projections qkvr (N=3328, 4 slices), o (2048), gate_up (11264, 2 slices),
lm_head (32000); decode (8, 32, 64 and 128 tokens, one per sequence) and prefill (8 sequences x 512 tokens); 1, 4, 8
distinct adapters in 8 slots. Every figure is µs per op from CUDA-graph replays (each graph runs the op
REPS times, cycling over SETS weight sets so weights are not served from L2), median of replays.
Columns:
  base       the projection's bf16 GEMM alone (torch.mm into the output buffer)
  torch      per-token gather + bmm shrink and expand (the torch multi-LoRA baseline)
  sglang     SGLang 0.5.23's Triton pair sgemm_lora_a + sgemm_lora_b (when --sglang is given)
  ours       inkwell: one rank-16 LoRA over all N (FACTS.md's problem); fused launch at decode
  ours_2l    inkwell: shrink + expand as two launches
  sliced     inkwell fused projection: one rank-16 LoRA per slice (q/k/v/r or gate/up), P x the rank
  per_slot   the sliced expand alone, each adapter slot with programs of its own (decode and short prefill steps)
  walk       the same, one program per tile walking its slots (`expand.walks` picks one of the two)
  serial     base GEMM then the sliced LoRA, on one stream
  side       base GEMM on the main stream, LoRA shrink on a side stream, expand after the join
  side_fused fused LoRA delta on a side stream into a zeroed buffer, added after the join
  linear     inkwell lora_linear: base GEMM plus one rank-16 LoRA over all N in one launch (decode only);
             linear - base is the LoRA's own cost in the projection, set against the SGLang pair
  linear_sl  lora_linear of the real sliced projection: the projection with LoRA, set against base
  floor      the bytes the LoRA op must move (x, the adapters' A and B, the output read and written) at the card's
             peak bandwidth (`byte_floor.PEAK_BYTES_S`)
Run: python benchmarks/bench_lora_kernels.py [--sglang DIR] [--out results.json] [--sweep]
"""

import argparse
import datetime
import json
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from byte_floor import peak_bytes_s

from inkwell.kernels import dispatch
from inkwell.kernels.triton_lora import dense, expand
from inkwell.kernels.triton_lora.common import SLOT_LOOP_MIN_TOKENS

HIDDEN, RANK, SLOTS = 2048, 16, 8
PROJECTIONS = {
    "qkvr": (0, 2048, 2560, 3072, 3328),
    "o": (0, 2048),
    "gate_up": (0, 5632, 11264),
    "lm_head": (0, 32000),  # inkling-small's vocabulary
}
CASES = {"decode8": (8, 1), "decode32": (32, 1), "decode64": (64, 1), "decode128": (128, 1), "prefill8x512": (8, 512)}
REPS, SETS, REPLAYS = 20, 8, 30
FUSED_SWEEP = [
    (128, 256, 4, 3),
    (256, 256, 4, 3),
    (256, 256, 8, 3),
    (256, 256, 4, 1),
    (256, 256, 4, 4),
    (256, 512, 4, 3),
    (256, 512, 8, 3),
    (512, 256, 4, 3),
    (512, 256, 8, 3),
    (512, 512, 8, 3),
]


def write_rows(path: Path, rows: list[dict]) -> None:
    """A kernel benchmark's rows as JSON, with the date, GPU and torch version."""
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
    path.write_text(json.dumps({**meta, "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))


def time_graph(fn: Callable[[int], None], reps: int = REPS, replays: int = REPLAYS) -> float:
    """µs per call of fn(i) (i picks the weight set), from replays of a graph holding `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % SETS)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def measure(row: dict, name: str, fn: Callable[[int], None]) -> None:
    """row[name] = time_graph(fn); a failure is recorded in the row instead of ending the run."""
    try:
        row[name] = time_graph(fn)
    except Exception as err:  # one broken variant must not lose the figures of the others
        row.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:300]


def load_sglang(root: str) -> types.ModuleType:
    """SGLang's dense LoRA kernels from its wheel's files under `root`, without the rest of SGLang.

    Their only other import is the LoRABatchInfo type (an annotation); a namespace stands in for it.
    """
    sys.path.insert(0, root)
    stub = types.ModuleType("sglang.srt.lora.utils")
    stub.LoRABatchInfo = types.SimpleNamespace
    sys.modules["sglang.srt.lora.utils"] = stub
    from sglang.kernels.ops.lora.dense import sgemm_lora_a, sgemm_lora_b

    return types.SimpleNamespace(a=sgemm_lora_a.sgemm_lora_a_fwd, b=sgemm_lora_b.sgemm_lora_b_fwd)


def torch_gather_bmm(x, a, b, slots, scalings, out):
    """Per-token gather of each token's A and B, then batched GEMVs (all tokens carry an adapter here)."""
    y = torch.bmm(a[slots], x.unsqueeze(2))  # [T,R,1]
    delta = torch.bmm(b[slots], y).squeeze(2) * scalings[slots, None]
    out.add_(delta.to(out.dtype))


def bench_case(case: str, proj: str, adapters: int, sgl, gen: torch.Generator, sweep: bool) -> dict:
    seqs, seq_len = CASES[case]
    tokens, offsets = seqs * seq_len, PROJECTIONS[proj]
    n, parts = offsets[-1], len(offsets) - 1
    dev = dict(device="cuda", dtype=torch.bfloat16)
    seq_slots = torch.arange(seqs) % adapters
    slots = seq_slots.repeat_interleave(seq_len).cuda()
    x = torch.randn(tokens, HIDDEN, generator=gen).to(**dev)
    out = torch.randn(tokens, n, generator=gen).to(**dev)
    delta = torch.empty_like(out)
    w = [torch.randn(n, HIDDEN, generator=gen).div(HIDDEN**0.5).to(**dev) for _ in range(SETS)]
    a = [torch.randn(SLOTS, RANK, HIDDEN, generator=gen).div(HIDDEN**0.5).to(**dev) for _ in range(SETS)]
    a_stk = [torch.randn(SLOTS, parts * RANK, HIDDEN, generator=gen).div(HIDDEN**0.5).to(**dev) for _ in range(SETS)]
    b = [torch.randn(SLOTS, n, RANK, generator=gen).div(RANK**0.5).to(**dev) for _ in range(SETS)]
    scal = torch.full((SLOTS,), 2.0, device="cuda")
    scal_p = torch.full((SLOTS, parts), 2.0, device="cuda")
    side, fork, join = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()

    def side_stream(i: int) -> None:
        fork.record()
        with torch.cuda.stream(side):
            side.wait_event(fork)
            y = dense.lora_shrink(x, a_stk[i], slots)
            join.record()
        torch.mm(x, w[i].t(), out=out)
        torch.cuda.current_stream().wait_event(join)
        dense.lora_expand_sliced(y, b[i], slots, scal_p, out, offsets)

    def side_fused(i: int) -> None:
        fork.record()
        with torch.cuda.stream(side):
            side.wait_event(fork)
            delta.zero_()
            dense.lora_shrink_expand(x, a_stk[i], b[i], slots, scal_p, delta, offsets)
            join.record()
        torch.mm(x, w[i].t(), out=out)
        torch.cuda.current_stream().wait_event(join)
        out.add_(delta)

    def serial(i: int) -> None:
        torch.mm(x, w[i].t(), out=out)
        dense.lora_shrink_expand(x, a_stk[i], b[i], slots, scal_p, out, offsets)

    row = {"case": case, "proj": proj, "N": n, "adapters": adapters, "tokens": tokens}
    measure(row, "base", lambda i: torch.mm(x, w[i].t(), out=out))
    if tokens <= 64:  # the per-token gather of B is T*N*R elements: at prefill it is GBs
        measure(row, "torch", lambda i: torch_gather_bmm(x, a[i], b[i], slots, scal, out))
    if sgl is not None:
        info = types.SimpleNamespace(
            bs=seqs,
            max_len=seq_len,
            seg_lens=torch.full((seqs,), seq_len, dtype=torch.int32, device="cuda"),
            seg_indptr=torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda"),
            weight_indices=seq_slots.to(torch.int32).cuda(),
            lora_ranks=torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda"),
            scalings=scal,
            permutation=None,
        )
        measure(row, "sglang", lambda i: sgl.b(sgl.a(x, a[i], info), b[i], info, out))
    measure(row, "ours", lambda i: dense.lora_shrink_expand(x, a[i], b[i], slots, scal, out))
    measure(
        row,
        "ours_2l",
        lambda i: dense.lora_expand(dense.lora_shrink(x, a[i], slots), b[i], slots, scal, out),
    )
    measure(row, "sliced", lambda i: dispatch.lora_shrink_expand(x, a_stk[i], b[i], slots, scal_p, out, offsets))
    if tokens <= SLOT_LOOP_MIN_TOKENS:  # where the expand's launcher picks each slot's programs or the walk
        y_stk = dense.lora_shrink(x, a_stk[0], slots)
        for name, walk in (("per_slot", False), ("walk", True)):
            measure(
                row,
                name,
                lambda i, w=walk: expand.launch_expand(y_stk, b[i][:, None], slots, scal_p, out, offsets, walk=w),
            )
    measure(row, "serial", serial)
    measure(row, "side", side_stream)
    measure(row, "side_fused", side_fused)
    if tokens <= dispatch.FUSED_NARROW_MAX_TOKENS:  # where lora_linear is one GEMM (narrow N only past 32)
        measure(row, "linear", lambda i: dispatch.lora_linear(x, w[i], a[i], b[i], slots, scal))
        measure(row, "linear_sl", lambda i: dispatch.lora_linear(x, w[i], a_stk[i], b[i], slots, scal_p, offsets))
    if sweep and tokens <= 64:  # tile sweep of the fused decode kernel: (BLOCK_N, BLOCK_K, warps, stages)
        for cfg in FUSED_SWEEP:
            measure(
                row,
                "fused_bn{}_bk{}_w{}_s{}".format(*cfg),
                lambda i, c=cfg: dense.launch_fused(
                    x, a[i], b[i], slots, scal, out, None, block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3]
                ),
            )
    bytes_moved = (tokens * HIDDEN + adapters * RANK * (HIDDEN + n) + 2 * tokens * n) * 2
    peak = peak_bytes_s(torch.cuda.get_device_name())
    if peak is not None:  # a card byte_floor does not list gets no floor column
        row["floor"] = bytes_moved / peak * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang", help="folder holding sglang/kernels/ops/lora/dense/ from SGLang's wheel")
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time the fused kernel at other tile shapes")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    args = parser.parse_args()
    sgl = load_sglang(args.sglang) if args.sglang else None
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(sys.argv),
    }
    print(json.dumps(meta))
    rows = []
    for case in args.cases.split(","):
        for proj in PROJECTIONS:
            for adapters in (1, 4, 8):
                rows.append(bench_case(case, proj, adapters, sgl, gen, args.sweep))
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cols = ["base", "torch", "sglang", "ours", "ours_2l", "sliced", "per_slot", "walk", "serial", "side"]
    cols += ["side_fused", "linear", "linear_sl", "floor"]
    print("\nµs per op (CUDA-graph replays); ratios: ours/sglang, (linear - base)/sglang, best with-LoRA/base")
    ratios = f"{'o/sgl':>7}{'lin/sgl':>8}{'proj/b':>7}"
    print(f"{'case':<13}{'proj':<8}{'ad':>3}" + "".join(f"{c:>11}" for c in cols) + ratios)
    for r in rows:
        vals = "".join(f"{r[c]:>11.1f}" if c in r else f"{'-':>11}" for c in cols)
        vs_sgl = f"{r['ours'] / r['sglang']:>7.2f}" if "sglang" in r and "ours" in r else f"{'-':>7}"
        has_lin = "sglang" in r and "linear" in r and "base" in r
        lin_sgl = f"{(r['linear'] - r['base']) / r['sglang']:>8.2f}" if has_lin else f"{'-':>8}"
        with_lora = [r[c] for c in ("serial", "side", "side_fused", "linear_sl") if c in r]
        best = f"{min(with_lora) / r['base']:>7.2f}" if with_lora and "base" in r else f"{'-':>7}"
        print(f"{r['case']:<13}{r['proj']:<8}{r['adapters']:>3}{vals}{vs_sgl}{lin_sgl}{best}")
    for r in rows:
        if "errors" in r:
            print(r["case"], r["proj"], r["adapters"], r["errors"])


if __name__ == "__main__":
    main()
