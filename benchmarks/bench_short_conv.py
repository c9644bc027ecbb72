"""ShortConv over prefill chunks on one GPU: the Triton kernel (`inkwell.kernels.triton_short_conv.short_conv_chunks`)
against the torch ops of the engine's capturable chunk path (`ExtendForward._sconv`: fp32 cast, concat after the
saved inputs, fp32 depthwise F.conv1d, gather of the new tail, + x, cast; with the norm, the residual add and
`model.rms_norm` after it, as `_sconv_add_norm`), at inkling-small's ShortConv sites: k+v (C = 2 * 4 * 128 = 1024),
attention/MLP alone (C = 2048) and with the residual add + RMSNorm (C = 2048, the norm variant). B chunks of L
tokens (8 x 1,024 by default, every chunk full), the conv kernel size from the preset's config, fp32 conv weights
and state as the engine keeps them.

Timing: CUDA events around ITERS back-to-back calls after a warmup, median of REPEATS, in ms per call; the calls
cycle over enough input sets (x, residual, state) that they are not served from L2. The `graph` columns replay the
same calls captured in one CUDA graph, as the engine runs them. GB/s counts the bytes the op has to move: x read
and the output written (with the norm also the residual read and h + y written), the state read and written and
the weights (an H200's HBM3e peaks at 4.8 TB/s). max|err| is the largest difference from the torch ops' output
(both outputs with the norm) on the same inputs, and `state` whether the new state is bitwise torch's.

--sweep also times the kernel's launch shapes around its default (block_tokens, block_channels, token_blocks,
num_warps) with CUDA events and prints the fastest, to retune `chunk_launch` on other hardware.
Run: python benchmarks/bench_short_conv.py [--batch 8] [--length 1024] [--dtypes bf16,fp32] [--sweep] [--out f.json]
"""

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from bench_lora_kernels import time_graph

from inkwell.kernels.triton_short_conv import chunk_launch, short_conv_chunks
from inkwell.models.presets import preset_config
from inkwell.serving.native.model import rms_norm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WARMUP, ITERS, REPEATS = 5, 20, 9


def torch_sconv(x, saved, seq_slots, lengths, weight, offsets):
    """`ExtendForward._sconv`'s ops: x flat rows [B*L, C]; `saved` [S, C, k-1] is updated in place."""
    batch = seq_slots.shape[0]
    xf = x.float()
    channels = xf.shape[1]
    length = xf.shape[0] // batch
    seq = torch.cat([saved[seq_slots], xf.view(batch, length, channels).transpose(1, 2)], dim=-1)
    out = F.conv1d(seq, weight, groups=channels).transpose(1, 2).reshape(batch * length, channels)
    keep = saved.shape[-1]
    tail = lengths[:, None] + offsets[None, :keep]  # [B, keep]: in seq, the inputs carried on
    saved[seq_slots] = seq.gather(-1, tail[:, None, :].expand(-1, channels, -1))
    return (out + xf).to(x.dtype)


def torch_sconv_add_norm(x, h, saved, seq_slots, lengths, weight, offsets, norm_weight, eps):
    """`ExtendForward._sconv_add_norm`'s ops: (h + ShortConv(x), its RMSNorm)."""
    h = h + torch_sconv(x, saved, seq_slots, lengths, weight, offsets)
    return h, rms_norm(h, norm_weight, eps)


def time_events(fn: Callable[[int], object], sets: int) -> float:
    """ms per call of fn(i) (i picks the input set): CUDA events around ITERS calls, median of REPEATS."""
    for i in range(WARMUP):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(ITERS):
            fn(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / ITERS)
    return statistics.median(times)


def graph_ms(fn: Callable[[int], object], sets: int) -> float:
    """ms per call of fn(i) (i picks the input set) from CUDA-graph replays (`bench_lora_kernels.time_graph`)."""
    return time_graph(lambda i: fn(i % sets)) / 1000


class Case:
    """One ShortConv site's inputs, in as many sets as keep a cycle of calls out of L2."""

    def __init__(self, batch, length, channels, kernel, dtype, norm, gen, device="cuda"):
        self.batch, self.length, self.channels, self.norm = batch, length, channels, norm
        es = torch.tensor([], dtype=dtype).element_size()
        rows = batch * length
        self.bytes = rows * channels * es * (4 if norm else 2) + 2 * batch * channels * (kernel - 1) * 4
        self.bytes += channels * kernel * 4 + (channels * es if norm else 0)
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 * 2**20) if device == "cuda" else 0
        self.sets = max(2, math.ceil(3 * l2 / self.bytes))
        self.weight = (torch.randn(channels, 1, kernel, generator=gen) / kernel).to(device)
        self.norm_weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(device=device, dtype=dtype)
        self.eps = 1e-6

        def inputs(*shape):
            return [torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for _ in range(self.sets)]

        self.xs = inputs(rows, channels)
        self.hs = inputs(rows, channels) if norm else []
        slots = batch + 1  # and a scratch slot, as the engine's pool has
        self.states = [torch.randn(slots, channels, kernel - 1, generator=gen).to(device) for _ in range(self.sets)]
        self.seq_slots = torch.arange(batch, device=device)
        self.lengths = torch.full((batch,), length, device=device)
        self.offsets = torch.arange(max(length, kernel), device=device)

    def torch_op(self, i, state=None):
        state = self.states[i] if state is None else state
        args = (self.seq_slots, self.lengths, self.weight, self.offsets)
        if self.norm:
            return torch_sconv_add_norm(self.xs[i], self.hs[i], state, *args, self.norm_weight, self.eps)
        return torch_sconv(self.xs[i], state, *args)

    def kernel_op(self, i, state=None, **launch):
        state = self.states[i] if state is None else state
        shape = (self.batch, self.length, self.channels)
        residual = self.hs[i].view(shape) if self.norm else None
        got = short_conv_chunks(
            self.xs[i].view(shape),
            state,
            self.seq_slots,
            self.lengths,
            self.weight,
            residual,
            self.norm_weight if self.norm else None,
            self.eps,
            **launch,
        )
        return tuple(t.view(-1, self.channels) for t in got) if self.norm else got.view(-1, self.channels)

    def check(self) -> tuple[float, bool]:
        """(largest difference from the torch ops' outputs, whether the new states are bitwise equal)."""
        want_state, got_state = self.states[0].clone(), self.states[0].clone()
        want, got = self.torch_op(0, want_state), self.kernel_op(0, got_state)
        pairs = zip(want, got, strict=True) if self.norm else [(want, got)]
        err = max(float((g.float() - w.float()).abs().max()) for w, g in pairs)
        return err, torch.equal(want_state, got_state)


def sweep(case: Case) -> list[dict]:
    """Kernel ms for launch shapes around the default: token blocks of 1-8 rows, 1-16 of them a program, 4-16
    warps, 512-channel blocks too without the norm; shapes of under 2 or over 64 elements a thread left out."""
    es = case.xs[0].element_size()
    widths = [triton.next_power_of_2(case.channels)]
    if not case.norm and case.channels > 512:
        widths.append(512)
    rows = []
    for block_c, block_l, blocks, warps in itertools.product(widths, (1, 2, 4, 8), (1, 2, 4, 8, 16), (4, 8, 16)):
        per_thread = block_l * block_c / (32 * warps)
        if not 2 <= per_thread <= 64 or block_l * blocks > 64:
            continue
        launch = dict(block_tokens=block_l, block_channels=block_c, token_blocks=blocks, num_warps=warps)
        try:
            ms = time_events(lambda i, launch=launch: case.kernel_op(i, **launch), case.sets)
        except Exception as err:  # a shape that does not compile or launch here must not end the sweep
            print(f"  {launch}: {type(err).__name__}: {str(err)[:120]}")
            continue
        rows.append({**launch, "ms": ms, "gbs": case.bytes / ms / 1e6, "bytes_per_thread": per_thread * es})
    return sorted(rows, key=lambda r: r["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp16, fp32")
    ap.add_argument("--preset", default="inkling-small")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's launch shapes")
    ap.add_argument("--out", type=argparse.FileType("w"))
    args = ap.parse_args()
    cfg = preset_config(args.preset)
    kernel = cfg.conv_kernel_size
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim
    sites = [("k+v", kv, False), ("attn/mlp", cfg.hidden_size, False), ("attn/mlp + add + norm", cfg.hidden_size, True)]
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; {args.preset} "
        f"ShortConv (k = {kernel}) over {args.batch} chunks x {args.length} tokens, ms per call\n"
    )
    print(
        "| site | C | dtype | torch | kernel | speedup | torch graph | kernel graph | speedup | kernel GB/s "
        "| graph GB/s | max abs err | state | launch (L, C, blocks, warps) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for site, channels, norm in sites:
            case = Case(args.batch, args.length, channels, kernel, dtype, norm, gen)
            err, state_equal = case.check()
            es = case.xs[0].element_size()
            launch = chunk_launch(args.batch, args.length, channels, norm, es, processors)
            row = {
                "site": site,
                "channels": channels,
                "dtype": name,
                "norm": norm,
                "bytes": case.bytes,
                "max_abs_err": err,
                "state_equal": state_equal,
                "launch": launch,
                "torch": time_events(case.torch_op, case.sets),
                "kernel": time_events(case.kernel_op, case.sets),
                "torch_graph": graph_ms(case.torch_op, case.sets),
                "kernel_graph": graph_ms(case.kernel_op, case.sets),
            }
            gbs, gbs_graph = case.bytes / row["kernel"] / 1e6, case.bytes / row["kernel_graph"] / 1e6
            print(
                f"| {site} | {channels} | {name} | {row['torch']:.4f} | {row['kernel']:.4f} "
                f"| {row['torch'] / row['kernel']:.1f}x | {row['torch_graph']:.4f} | {row['kernel_graph']:.4f} "
                f"| {row['torch_graph'] / row['kernel_graph']:.1f}x | {gbs:.0f} | {gbs_graph:.0f} | {err:.1e} "
                f"| {'equal' if state_equal else 'DIFFERS'} | {launch} |",
                flush=True,
            )
            if args.sweep:
                row["sweep"] = sweep(case)
            results.append(row)
            del case
            torch.cuda.empty_cache()
    if args.sweep:
        for row in results:
            print(f"\nsweep, {row['site']} C={row['channels']} {row['dtype']} (default {row['kernel']:.4f} ms):")
            for r in row["sweep"][:6]:
                print(
                    f"  {r['ms']:.4f} ms  {r['gbs']:.0f} GB/s  block_tokens={r['block_tokens']} "
                    f"block_channels={r['block_channels']} token_blocks={r['token_blocks']} num_warps={r['num_warps']}"
                )
    if args.out is not None:
        json.dump(results, args.out, indent=2)


if __name__ == "__main__":
    main()
