"""Prefill attention on one GPU: the Triton kernel (`inkwell.kernels.triton_prefill_attention`) against the model's
eager attention (`InklingModel.attend`, fed as the chunk forward feeds it), at inkling-small's attention sizes
(16 query heads on 4 kv heads of 128, d_rel and the bias extent from the preset), `--batch` chunks of `--length`
tokens, bf16 by default.

Cases: a full layer with no history, a full layer continuing `--history` cached tokens, and a sliding layer
(the preset's window, a ring of 512) continuing `--history` cached tokens (add --log-floor N to run the full
layers with log scaling). For each: ms per call (CUDA events around `--iters` calls after `--warmup` calls,
median of `--repeats`), of the kernel (the r @ proj GEMM included; it is also timed alone) and of eager torch
(gathering the history out of the cache included, as the engine does it), the speedup, the kernel's TFLOP/s
(4 * D FLOPs per query-key pair a query sees: q.k and p.v), and the largest absolute difference of the kernel from
eager (both in the run's dtype) over the real rows, beside each one's difference from eager in fp32.
`--sweep` times the kernel under other block configurations too (block_m,block_n,num_warps,num_stages;...).
Run: python benchmarks/bench_prefill_attention.py [--batch 8] [--length 1024] [--history 512] [--sweep]
CPU smoke run: TRITON_INTERPRET=1 python benchmarks/bench_prefill_attention.py --device cpu --batch 1 --length 64
  --history 32 --warmup 0 --iters 1 --repeats 1
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import triton

from inkwell.kernels.triton_prefill_attention import default_blocks, prefill_attention
from inkwell.models.presets import preset_config
from inkwell.serving.native.model import InklingModel

SWEEP = "128,64,8,2;128,64,8,3;128,32,8,2;128,32,8,3;64,64,8,2;64,64,4,2;64,32,4,2;128,128,8,2"
PROJ = "model.layers.{}.self_attn.rel_logits_proj.proj"


def time_ms(fn, warmup: int, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean ms per call of `iters` back-to-back calls, after `warmup` calls (CUDA
    events; the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            times.append((time.perf_counter() - began) * 1000 / iters)
    return statistics.median(times)


def make_case(cfg, args, sliding: bool, history: int, dtype: torch.dtype, gen: torch.Generator, device) -> dict:
    """Inputs as the chunk forward holds them: q contiguous, r a column slice, k/v [B, L, KV, D], the cache with
    `history` positions per chunk on distinct slots (a full layer's from place 0, a sliding layer's in its ring)."""
    batch, length = args.batch, args.length
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    d_rel, extent, window = cfg.d_rel, cfg.rel_extent, cfg.sliding_window_size
    dev = dict(device=device, dtype=dtype)
    wide = torch.randn(batch, length, heads, head_dim + d_rel, generator=gen).to(**dev)
    q, r = wide[..., :head_dim].contiguous(), wide[..., head_dim:]
    k, v = (torch.randn(batch, length, kv_heads, head_dim, generator=gen).to(**dev) for _ in range(2))
    proj = (torch.randn(d_rel, extent, generator=gen) / d_rel**0.5).to(**dev)
    places = window if sliding else history + length
    cache_k, cache_v = (torch.randn(batch + 1, places, kv_heads, head_dim, generator=gen).to(**dev) for _ in range(2))
    seq = torch.randperm(batch + 1, generator=gen)[:batch].to(device)
    starts = torch.full((batch,), history, device=device)
    lengths = torch.full((batch,), length, device=device)
    return dict(
        q=q, k=k, v=v, r=r, proj=proj, cache_k=cache_k, cache_v=cache_v, seq=seq, starts=starts, lengths=lengths,
        window=window if sliding else None, history=history,
    )  # fmt: skip


def eager(c: dict, config, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`InklingModel.attend` (of a stand-in model: `attend` reads only its config and the bias projection) over
    the history gathered out of the cache and the chunk's own keys, as `ExtendForward._attention` feeds it (a full
    layer's context, read back from the cache after the chunk's keys are written, is the same keys); `dtype` runs
    it in another dtype. Layer 0 is full, layer 1 sliding."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    q, k, v, r, proj = (cast(c[name]) for name in ("q", "k", "v", "r", "proj"))
    model = SimpleNamespace(config=config, w={PROJ.format(0): proj, PROJ.format(1): proj})
    seq, history, window, device = c["seq"], c["history"], c["window"], q.device
    length = q.shape[1]
    positions = c["starts"][:, None] + torch.arange(length, device=device)[None, :]
    if window is not None:
        last = (c["starts"] - 1)[:, None]
        ring_pos = last - (last - torch.arange(window, device=device)[None, :]) % window
        keys, values = torch.cat([cast(c["cache_k"][seq]), k], 1), torch.cat([cast(c["cache_v"][seq]), v], 1)
        k_pos = torch.cat([ring_pos, positions], dim=1)
        return InklingModel.attend(model, 1, q, keys, values, r, positions, k_pos, valid=k_pos >= 0)
    keys = torch.cat([cast(c["cache_k"][seq, :history]), k], 1)
    values = torch.cat([cast(c["cache_v"][seq, :history]), v], 1)
    k_pos = torch.arange(history + length, device=device)[None].expand(len(seq), -1)
    return InklingModel.attend(model, 0, q, keys, values, r, positions, k_pos)


def kernel(c: dict, log_scaling, **blocks) -> torch.Tensor:
    return prefill_attention(
        c["q"], c["k"], c["v"], c["r"], c["proj"], c["cache_k"], c["cache_v"], c["seq"], c["starts"], c["lengths"],
        c["window"], log_scaling, **blocks,
    )  # fmt: skip


def flops(c: dict) -> int:
    """4 * D per (query, visible key) pair, over every head."""
    batch, length, heads, head_dim = c["q"].shape
    t = c["history"] + torch.arange(length, dtype=torch.float64)  # every chunk starts at `history`
    seen = t + 1 if c["window"] is None else torch.clamp(t + 1, max=c["window"])
    return int(4 * head_dim * heads * batch * seen.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--history", type=int, default=512)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--log-floor", type=float, default=None, help="log scaling's n_floor on full layers")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", nargs="?", const=SWEEP, default=None, help="block configs m,n,warps,stages;...")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cfg = preset_config("inkling-small")
    floor, alpha = args.log_floor, cfg.log_scaling_alpha
    log_scaling = (floor, alpha) if floor is not None else None

    config = SimpleNamespace(  # what `attend` reads of the model's config
        layer_types=["hybrid", "hybrid_sliding"], log_scaling_n_floor=floor, log_scaling_alpha=alpha,
        sliding_window_size=cfg.sliding_window_size,
    )  # fmt: skip
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"{device_name}, torch {torch.__version__}, triton {triton.__version__}; inkling-small "
        f"attention: {cfg.num_attention_heads} heads on {cfg.num_key_value_heads} kv heads of {cfg.head_dim}, d_rel "
        f"{cfg.d_rel}, extent {cfg.rel_extent}, window {cfg.sliding_window_size}; {args.batch} chunks x "
        f"{args.length} tokens, {args.dtype}, log scaling {log_scaling}; default blocks "
        f"{default_blocks(dtype, args.length)}\n"
    )
    gen = torch.Generator().manual_seed(0)
    timing = (args.warmup, args.iters, args.repeats)
    for name, sliding, history in [
        ("full, no history", False, 0),
        (f"full, {args.history} cached", False, args.history),
        (f"sliding {cfg.sliding_window_size}, {args.history} cached", True, args.history),
    ]:
        case = make_case(cfg, args, sliding, history, dtype, gen, args.device)
        layer_log = None if sliding else log_scaling
        got, want, exact = kernel(case, layer_log), eager(case, config), eager(case, config, torch.float32)
        err = (got.float() - want.float()).abs().max().item()
        err_eager, err_kernel = ((t.float() - exact).abs().max().item() for t in (want, got))
        del exact
        ms_kernel = time_ms(lambda c=case, lg=layer_log: kernel(c, lg), *timing)
        ms_rel = time_ms(lambda c=case: c["r"] @ c["proj"], *timing)
        ms_eager = time_ms(lambda c=case: eager(c, config), *timing)
        tflops = flops(case) / ms_kernel / 1e9
        print(
            f"{name:>24}: kernel {ms_kernel:7.3f} ms (r@proj {ms_rel:.3f}) | eager {ms_eager:7.3f} ms | "
            f"{ms_eager / ms_kernel:5.1f}x | {tflops:6.1f} TFLOP/s | max|kernel - eager| {err:.2e} "
            f"(vs fp32 eager: kernel {err_kernel:.2e}, eager {err_eager:.2e})",
            flush=True,
        )
        if args.sweep:
            for spec in args.sweep.split(";"):
                block_m, block_n, num_warps, num_stages = map(int, spec.split(","))
                blocks = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                try:
                    sweep_err = (kernel(case, layer_log, **blocks).float() - want.float()).abs().max().item()
                    ms = time_ms(lambda c=case, lg=layer_log, b=blocks: kernel(c, lg, **b), *timing)
                except Exception as e:  # a config the compiler or the GPU refuses (shared memory)
                    print(f"{'':>26}{spec:>14}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                print(
                    f"{'':>26}{spec:>14}: {ms:7.3f} ms | {flops(case) / ms / 1e9:6.1f} TFLOP/s | max|diff| "
                    f"{sweep_err:.2e}",
                    flush=True,
                )
        del case, got, want
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
