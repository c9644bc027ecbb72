"""Decode throughput of the native engine: eager steps vs CUDA-graph replays, synchronous or overlapped steps.

A batch of `--batch` prompts of `--prompt` random tokens, `--new` greedy tokens each (or sampled, with
`--temperature` > 0 and `--top-p`, seeded per request), with no adapter and with 1, 4 and 8 distinct adapters
(rank `--rank`, 16) over every target group (request i uses adapter i mod n); `--adapters 0 1 8` runs only those
counts (0 always), for a shorter A/B. Decode = every
step after the first (which prefills every prompt); each case is timed `--repeats` times after a warm-up run
(Triton compiles, graphs are captured) and the median is kept.
  eager         cuda_graphs=False: every step runs InklingModel.forward (one stream)
  graphs-sync   pure decode steps replay a captured decode graph (StepGraphs), each step waits for its tokens
                before the next is launched (overlap_decode=False)
  graphs        the same, overlapped: the next step is queued before this one's tokens reach the host (default)
  graphs+side   graphs, with LoRA work on a side stream (EngineConfig.lora_side_stream; off by default)
Targets (issue 7): adapter decode >= 0.90 of no-adapter decode; 8 adapters < 1% slower than 1.
With --profile (CUDA), one more batch per adapter count runs under torch.profiler: the GPU kernel time and kernel
count per decode step, steadier than tok/s for small differences, and the kernels whose own share of the step
(`own_time`: chained kernels start early and wait, so their profiled durations overlap) moves most with adapters;
then the batch's captured step graph is replayed alone and timed (GPU time per step, without the host's work), and
set against the step's byte floor (`byte_floor`: the weights, state and adapters it must read, over the card's peak
bandwidth).
With --timeline N (CUDA), one more batch per adapter count lists the first N kernels of one decode step in the
order they ran, with each one's start, duration and own time (a layer's kernels one after another).
Run: python benchmarks/bench_decode_graphs.py [--preset inkling-small] [--profile] [--timeline 40] [--out f.json]
[--targets attn mlp experts shared_experts lm_head] (the adapters' target groups; default: LoraSpec's, no LM head)
CPU smoke run (graph modes are skipped off CUDA): python benchmarks/bench_decode_graphs.py --preset inkling-tiny
--device cpu --prompt 16 --new 8 --repeats 1
"""

import dataclasses
import datetime
import json
import platform
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from bench_serving import (
    COUNTS,
    Clock,
    adapter_keys,
    engine_batch,
    engine_parser,
    make_engine,
    make_prompts,
    parse_engine_args,
    random_adapters,
    rates,
    submit,
)
from byte_floor import decode_step_bytes, peak_bytes_s
from torch.profiler import ProfilerActivity, profile

from inkwell.adapters.spec import TARGET_GROUPS
from inkwell.models import init_base_model

MODES = {
    "eager": {"cuda_graphs": False, "lora_side_stream": False},
    "graphs-sync": {"cuda_graphs": True, "lora_side_stream": False, "overlap_decode": False},
    "graphs": {"cuda_graphs": True, "lora_side_stream": False},
    "graphs+side": {"cuda_graphs": True, "lora_side_stream": True},
}


def profiled_steps(
    engine, prompts, keys: list[str | None], new: int, gap_s: float = 0.0
) -> tuple[list[tuple[str, float, float]], int]:
    """The GPU kernels (`cuda_kernels`) of one batch's decode steps, and how many steps ran (the prefill step runs
    before the profiler starts). Steps run synchronously here, so each step() inside the profiler launches exactly
    the step it returns; with `gap_s` the host waits for each step's end and then that long."""
    overlapped, engine.config = engine.config, dataclasses.replace(engine.config, overlap_decode=False)
    submit(engine, prompts, keys, new)
    engine.step()
    torch.cuda.synchronize()
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_work():
            engine.step()
            steps += 1
            if gap_s:
                torch.cuda.synchronize()
                time.sleep(gap_s)
        torch.cuda.synchronize()
    engine.config = overlapped
    return cuda_kernels(prof), steps


def profile_decode(engine, prompts, keys: list[str | None], new: int) -> dict:
    """GPU kernels per decode step of one batch (`profiled_steps`)."""
    kernels, steps = profiled_steps(engine, prompts, keys, new)
    us, count = Counter(), Counter()
    for name, start, end in kernels:
        us[name] += (end - start) / steps
        count[name] += 1 / steps
    own = own_time(kernels)
    return {
        "kernel_us": sum(us.values()),
        "kernels": round(sum(count.values())),
        **replay_us(engine, lora=any(k is not None for k in keys)),
        "by_name": dict(us),
        "busy_us": sum(own.values()) / steps,
        "own_by_name": {name: t / steps for name, t in own.items()},
        "count_by_name": {name: round(n, 2) for name, n in count.items()},
        "steps": steps,
    }


def own_times(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """The kernels in the order they started, each (name, start, end, own time): its share of the GPU's busy time
    on one stream, from the later of its start and the end of every kernel before it, to its end. A chained kernel
    (`kernels.triton_pdl`) starts early and waits, so its profiled duration counts the kernel before it too; its
    own time does not, and the own times add up to the busy time."""
    out, done = [], float("-inf")
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        out.append((name, start, end, max(0.0, end - max(start, done))))
        done = max(done, end)
    return out


def own_time(kernels: list[tuple[str, float, float]]) -> Counter:
    """Each kernel name's own time (`own_times`), summed."""
    own = Counter()
    for name, _, _, us in own_times(kernels):
        own[name] += us
    return own


def cuda_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start, end) in µs of every GPU kernel and copy a torch.profiler run recorded."""
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda and e.device_time_total > 0
    ]


STEP_GAP_S = 0.002  # the host's wait between the timeline's steps: far above any gap inside a step


def step_timeline(engine, prompts, keys: list[str | None], new: int) -> list[dict]:
    """One decode step's kernels in the order they ran (the middle decode step of a batch), each with its start
    (µs after the step's first kernel), its duration and its own time (`own_times`). The host waits STEP_GAP_S
    after each step, so that the steps stand apart in the trace."""
    kernels, _ = profiled_steps(engine, prompts, keys, new, gap_s=STEP_GAP_S)
    steps: list[list] = [[]]
    done = float("-inf")  # the latest end of a kernel so far
    for kernel in sorted(kernels, key=lambda k: k[1]):
        if steps[-1] and kernel[1] - done > STEP_GAP_S * 1e6 / 2:
            steps.append([])
        steps[-1].append(kernel)
        done = max(done, kernel[2])
    step = steps[len(steps) // 2]
    first = step[0][1]
    return [
        {"kernel": name, "start_us": start - first, "us": end - start, "own_us": own}
        for name, start, end, own in own_times(step)
    ]


def replay_us(engine, lora: bool, rounds: int = 10, burst: int = 5) -> dict:
    """The batch's captured step graph replayed alone, `burst` replays back to back per round, medians over rounds
    of the per-replay times: the GPU's by CUDA events ("replay_us": unlike tok/s it leaves out the host's work
    between steps, unlike the kernel sum it counts the gaps between kernels and the overlap of concurrent ones;
    after the first replay the host launches the next one while the GPU runs) and the host's in `replay()`
    ("launch_us"). The replays rewrite only state that no request holds now."""
    (graph, _), *_ = [g for (_, _, with_lora), g in engine.graphs.decode_graphs.items() if with_lora == lora]
    gpu, host = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(burst):
            graph.replay()
        host.append((time.perf_counter() - t0) * 1e6 / burst)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1000 / burst)
    return {"replay_us": statistics.median(gpu), "launch_us": statistics.median(host)}


def step_floor(engine, seen: int, keys: list[str | None], replay_us: float) -> dict:
    """The byte floor (`byte_floor`) of the batch's last decode step, the one its replay repeats (rows `seen`
    positions in, row i on adapter keys[i]), against the replay's GPU time."""
    floor = decode_step_bytes(engine, seen, keys)
    parts = ", ".join(f"{floor[part] / 1e9:.3f} GB of {part}" for part in ("weights", "state", "adapters"))
    line = f"  byte floor: {parts}"
    peak = peak_bytes_s(torch.cuda.get_device_name())
    if peak is not None:
        floor["floor_us"] = (floor["weights"] + floor["state"] + floor["adapters"]) / peak * 1e6
        floor["replay_over_floor"] = replay_us / floor["floor_us"]
        line += f" at {peak / 1e12:.2f} TB/s: {floor['floor_us']:.0f} µs; the replay {floor['replay_over_floor']:.2f}x"
    print(line)
    return floor


def bench_mode(model_dir: Path, adapters, args, options: dict, clock: Clock, prompts) -> dict:
    """Median decode tokens/s (and step time) per adapter count in one engine configuration."""
    engine = make_engine(model_dir, adapters, args, **options)
    out = {}
    for n in args.adapters:
        keys = adapter_keys(n, len(prompts))
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        engine_batch(engine, clock, prompts, keys, args.new, **sampling)  # warm-up
        runs = [rates(engine_batch(engine, clock, prompts, keys, args.new, **sampling)) for _ in range(args.repeats)]
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        out[n] = {"decode_tok_s": tok_s, "decode_step_ms": 1e3 * args.batch / tok_s, "runs": runs}
        print(f"{n} adapters: {tok_s:.0f} decode tok/s ({out[n]['decode_step_ms']:.2f} ms/step)", flush=True)
        if args.profile:
            out[n]["profile"] = profile_decode(engine, prompts, keys, args.new)
            prof = out[n]["profile"]
            times = f"{prof['kernel_us']:.0f} µs ({prof['busy_us']:.0f} busy), replay {prof['replay_us']:.0f} µs"
            times += f", launch {prof['launch_us']:.0f} µs"
            print(f"  {prof['kernels']} kernels, {times}")
            prof["byte_floor"] = step_floor(engine, len(prompts[0]) + args.new - 1, keys, prof["replay_us"])
        if args.timeline:
            out[n]["timeline"] = step_timeline(engine, prompts, keys, args.new)
            print("  start µs    µs   own µs  kernel (one decode step, in order)")
            for k in out[n]["timeline"][: args.timeline]:
                print(f"  {k['start_us']:8.1f} {k['us']:6.1f} {k['own_us']:6.1f}  {k['kernel'][:90]}")
    if engine.graphs is not None:
        out["graphs_captured"] = len(engine.graphs.decode_graphs)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def table(results: dict, counts: list[int]) -> str:
    """Decode tok/s per adapter count (`counts`, 0 first) and mode, each against no adapter and the baseline modes,
    8 against 1 adapter where both ran, and each mode's profile table where it was profiled."""
    modes = [m for m in MODES if m in results]
    baselines = [b for b in ("eager", "graphs-sync") if b in modes]
    head = ["adapters", *(f"{m} tok/s" for m in modes), *(f"{m} vs 0" for m in modes)]
    head += [f"{m} / {b}" for b in baselines for m in modes if m != b]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def rate(mode: str, n: int) -> float:
        return results[mode][n]["decode_tok_s"]

    for n in counts:
        cells = [str(n), *(f"{rate(m, n):.0f}" for m in modes), *(f"{rate(m, n) / rate(m, 0):.3f}" for m in modes)]
        cells += [f"{rate(m, n) / rate(b, n):.2f}" for b in baselines for m in modes if m != b]
        lines.append("| " + " | ".join(cells) + " |")
    if {1, 8} <= set(counts):
        ratios = ", ".join(f"{m} {rate(m, 8) / rate(m, 1):.3f}" for m in modes)
        lines.append(f"\n8 vs 1 adapters (decode tok/s ratio): {ratios}")
    for m in modes:
        if "profile" in results[m][0]:
            lines.append(profile_table(m, results[m], counts))
    return "\n".join(lines)


def profile_table(mode: str, result: dict, counts: list[int], top: int = 8) -> str:
    """Kernel time per decode step against 0 and 1 adapter, the replay against its byte floor (where the card's
    peak is known), and the kernels whose own time (`own_time`) moves most from 0 to 1 adapter and from 1 to 8
    (those of `counts` that ran)."""
    prof = {n: result[n]["profile"] for n in counts}
    lines = [
        f"\n[{mode}] GPU kernels per decode step (torch.profiler)",
        "| adapters | kernels | kernel µs | vs 0 adapters | vs 1 adapter | graph replay µs | vs 0 | vs 1 "
        "| byte floor µs | replay / floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in counts:
        cells = [str(n), str(prof[n]["kernels"])]
        for what in ("kernel_us", "replay_us"):
            us = prof[n][what]
            cells += [f"{us:.0f}", *(f"{us / prof[base][what]:.4f}" if base in prof else "-" for base in (0, 1))]
        floor = prof[n]["byte_floor"]
        cells += [f"{floor['floor_us']:.0f}", f"{floor['replay_over_floor']:.2f}"] if "floor_us" in floor else ["-"] * 2
        lines.append("| " + " | ".join(cells) + " |")
    for a, b in ((0, 1), (1, 8)):
        if not {a, b} <= set(prof):
            continue
        before, after = prof[a]["own_by_name"], prof[b]["own_by_name"]
        moved = sorted(set(before) | set(after), key=lambda k: -abs(after.get(k, 0) - before.get(k, 0)))[:top]
        lines.append(f"\nlargest changes of kernels' own time from {a} to {b} adapters (µs per step):")
        lines += [f"  {after.get(k, 0) - before.get(k, 0):+7.1f}  {k[:100]}" for k in moved]
    return "\n".join(lines)


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--profile", action="store_true", help="also GPU kernel time per decode step (CUDA)")
    ap.add_argument("--timeline", type=int, default=0, help="list the first N kernels of one decode step (CUDA)")
    ap.add_argument(
        "--adapters", type=int, nargs="+", default=list(COUNTS), choices=COUNTS, help="the adapter counts to run"
    )
    ap.add_argument("--targets", nargs="+", choices=TARGET_GROUPS, help="the adapters' targets (default: LoraSpec's)")
    ap.add_argument("--out", type=Path)
    args = parse_engine_args(ap)
    if 0 not in args.adapters:
        ap.error("--adapters must include 0: every count is read against no adapter")
    args.adapters = sorted(set(args.adapters))
    cuda = args.device.startswith("cuda")
    if (args.profile or args.timeline) and not cuda:
        ap.error("--profile and --timeline time CUDA kernels and graph replays: run them with --device cuda")
    modes = [m for m in args.modes if cuda or not MODES[m].get("cuda_graphs")]
    clock = Clock(torch.device(args.device))
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }
    with tempfile.TemporaryDirectory(prefix="bench-decode-graphs-") as tmp:
        model_dir = init_base_model(args.preset, Path(tmp) / args.preset, seed=0)
        adapters = random_adapters(model_dir, args.rank, tuple(args.targets) if args.targets else None)
        prompts = make_prompts(args.batch, args.prompt)
        for mode in modes:
            t0 = time.perf_counter()
            print(f"[{mode}]", flush=True)
            results[mode] = bench_mode(model_dir, adapters, args, MODES[mode], clock, prompts)
            print(f"[{mode}] {time.perf_counter() - t0:.1f}s", flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results, args.adapters))


if __name__ == "__main__":
    main()
