"""Serving on one GPU: the native engine's mixed-adapter batches vs a per-adapter loop vs transformers +
peft, and adapter hot-swap through CUDA IPC vs loading from disk vs a plain device copy.

Throughput: a batch of `--batch` prompts of `--prompt` random tokens, `--new` greedy tokens each, with
no adapter and with 1, 4 and 8 distinct adapters of rank `--rank` (16; request i uses adapter i mod n). Prefill =
the first step (every prompt in one forward, which also yields the first token); decode = the rest.
  engine   one mixed batch through the native engine (per-token LoRA slots, inkwell.kernels)
  loop     the same requests, one engine batch per adapter, run one after the other
  peft     transformers' InklingForCausalLM (eager) + peft, one mixed batch via `adapter_names`
           (no adapter: the plain transformers model); prefill = generate(1 token), decode = the rest
Swap (one adapter of rank `--rank` over every target group, engine max_lora_rank the same), each with its ratio
to d2d (host clock with sync against host clock, CUDA events against CUDA events):
  d2d      a device-to-device copy of the adapter's slot image bytes (CUDA events, and host clock with sync);
           `d2d_idle` the same copy timed alone after the host and GPU sat idle for IDLE_S, as a lone swap does
  write    LoraSlots.write_image from an image already on the device (one copy, scalings included)
  ipc      the loader process reads, verifies and pads the adapter into a row of its staging ring on
           the GPU; the worker side, from the message's arrival: slot written (a pinned load straight
           from the row), and done (its own copy of the image taken, the row released). `first` is
           the first swap, whose message carries the ring (the CUDA IPC handle is opened then);
           `ipc_slot` / `ipc_done` are the steady state; end to end from the load request. A lone swap
           is set against `d2d_idle` too (`/ idle d2d`): both pay for waking an idle host thread and GPU.
           `ipc_decoding_*`: the same swaps made between the decode steps of the stall run (below),
           as a serving worker makes them
  disk     safetensors -> Adapter -> slot (what a worker without the loader would do)
  stall    decode steps of 7 other adapters' requests, and the step right after each swap
Run: python benchmarks/bench_serving.py [--preset inkling-small] [--out serving.json]
Only the swap table: --swap-only
CPU smoke run: python benchmarks/bench_serving.py --preset inkling-tiny --device cpu --dtype float32 --prompt 16 --new 4
"""

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.io import load_adapter, save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, init_base_model, load_base_config, load_base_model
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.loader import loader_main, stop_loader
from inkwell.serving.messages import Load, Staged
from inkwell.serving.native.engine import Engine
from inkwell.serving.sources import DirectorySource
from inkwell.serving.transfer import ImageReceiver

COUNTS = (0, 1, 4, 8)
RANK = 16  # the adapters' rank unless --rank says otherwise
SWAPS = 5
IDLE_S = 0.005  # about how long a lone swap's worker waits for the loader's message
# peft 0.21 mixes adapters in one batch only on linear modules (its expert ParamWrapper refuses)
PEFT_MIXABLE = ("attn", "mlp", "lm_head")


class Clock:
    """Host wall clock that first waits for the device, so it brackets finished work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def engine_parser(description: str) -> argparse.ArgumentParser:
    """The options every engine benchmark takes: model preset, device and dtype, batch and prompt length."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default="inkling-small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rank", type=int, default=RANK, help="the adapters' LoRA rank, and the engine's max_lora_rank")
    return ap


def parse_engine_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def random_adapters(model_dir: Path, rank: int, targets: tuple[str, ...] | None = None) -> list[Adapter]:
    """Adapters a0..a7 for the model in `model_dir`: rank `rank`, alpha 2 x rank, random B (std 0.01), seeds 1..8."""
    config, identity = load_base_config(model_dir), base_model_identity(model_dir)
    spec = LoraSpec(rank=rank, alpha=2 * rank, **({} if targets is None else {"targets": targets}))
    return [init_adapter(config, spec, identity, seed=i + 1, b_std=0.01) for i in range(max(COUNTS))]


def make_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (batch, length), generator=gen).tolist()


def adapter_keys(n: int, batch: int) -> list[str | None]:
    return [None if n == 0 else f"a{i % n}" for i in range(batch)]


def submit(
    engine: Engine,
    prompts: list[list[int]],
    keys: list[str | None],
    new: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> None:
    """Queue one request of `new` tokens per prompt, prompt i on adapter keys[i] (None: base model) with seed i;
    greedy unless `temperature` > 0."""
    for i, (prompt, key) in enumerate(zip(prompts, keys, strict=True)):
        params = SamplingParams(max_tokens=new, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
        engine.add_request(Request(f"r{i}", prompt, params, key))


def engine_batch(
    engine: Engine, clock: Clock, prompts: list[list[int]], keys: list[str | None], new: int, **sampling
) -> dict:
    """Seconds and tokens of the prefill step (to its tokens on the host) and of the decode steps of one batch;
    `sampling` as `submit` takes it."""
    submit(engine, prompts, keys, new, **sampling)
    t0 = clock()
    engine.step()
    # The prefill's tokens are on the host once step() returns; no device sync here, since the engine may have
    # queued the first decode step behind it, and that step belongs to the decode time.
    t1 = time.perf_counter()
    while engine.has_work():
        engine.step()
    t2 = clock()
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tokens": len(prompts) * len(prompts[0]),
        "decode_tokens": len(prompts) * (new - 1),
    }


def add_runs(runs: list[dict]) -> dict:
    return {k: sum(r[k] for r in runs) for k in runs[0]}


def rates(run: dict) -> dict:
    return {
        "prefill_tok_s": run["prefill_tokens"] / run["prefill_s"],
        "decode_tok_s": run["decode_tokens"] / run["decode_s"] if run["decode_s"] > 0 else None,
        **run,
    }


def bench_engine(engine: Engine, clock: Clock, prompts, new: int) -> dict:
    """Mixed batches and per-adapter loops for each adapter count (each timed after a warm-up run)."""
    out: dict = {}
    for n in COUNTS:
        keys = adapter_keys(n, len(prompts))
        engine_batch(engine, clock, prompts, keys, new)  # warm-up: Triton compiles, allocator settles
        out[f"engine_{n}"] = rates(engine_batch(engine, clock, prompts, keys, new))
        if n == 0:
            continue
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        runs = [
            engine_batch(engine, clock, [prompts[i] for i in idx], [key] * len(idx), new) for key, idx in groups.items()
        ]
        out[f"loop_{n}"] = rates(add_runs(runs))
        decode = out[f"engine_{n}"]["decode_tok_s"], out[f"loop_{n}"]["decode_tok_s"]
        print(f"engine n={n}: {decode[0]:.0f} decode tok/s, loop {decode[1]:.0f}", flush=True)
    return out


def bench_linear(engine: Engine, clock: Clock, prompts, new: int) -> dict:
    """The engine on peft's targets (adapters p0..p7): the row to set beside peft's mixed batches."""
    out = {}
    for n in COUNTS[1:]:
        keys = [f"p{i % n}" for i in range(len(prompts))]
        engine_batch(engine, clock, prompts, keys, new)
        out[f"engine_lin_{n}"] = rates(engine_batch(engine, clock, prompts, keys, new))
    return out


def bench_peft(model_dir: Path, adapters: list[Adapter], tmp: Path, args, clock: Clock, prompts) -> dict:
    """transformers + peft generation, the plain model for no adapter and `adapter_names` batches otherwise."""
    import peft

    config = load_base_config(model_dir)
    device = torch.device(args.device)
    model = load_base_model(model_dir, getattr(torch, args.dtype), device)
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(gen_model, names: list[str] | None) -> dict:
        extra = {} if names is None else {"adapter_names": names}

        def generate(n: int) -> None:
            gen_model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra
            )

        generate(2)  # warm-up
        t0 = clock()
        generate(1)
        t1 = clock()
        generate(args.new)
        t2 = clock()
        prefill = t1 - t0
        return rates(
            {
                "prefill_s": prefill,
                "decode_s": (t2 - t1) - prefill,
                "prefill_tokens": ids.numel(),
                "decode_tokens": ids.shape[0] * (args.new - 1),
            }
        )

    out = {"peft_0": run(model, None)}
    dirs = [save_adapter(a, tmp / f"peft{i}", "peft", config) for i, a in enumerate(adapters)]
    wrapped = peft.PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="a0")
    for i, d in enumerate(dirs[1:], start=1):
        wrapped.load_adapter(str(d), adapter_name=f"a{i}")
    wrapped.eval()
    for n in COUNTS[1:]:
        out[f"peft_{n}"] = run(wrapped, adapter_keys(n, len(prompts)))
        print(f"peft n={n}: {out[f'peft_{n}']['decode_tok_s']:.0f} decode tok/s", flush=True)
    return out


def median_us(fn: Callable[[], float], reps: int) -> float:
    return statistics.median(fn() for _ in range(reps)) * 1e6


def cuda_event_us(fn: Callable[[], None], reps: int) -> float:
    """Median GPU time of `fn`'s work between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return median_us(once, reps)


def wall_us(fn: Callable[[], None], clock: Clock, reps: int) -> float:
    """Median host time of `fn` until its device work is done (the clock synchronizes)."""

    def once() -> float:
        t0 = clock()
        fn()
        return clock() - t0

    return median_us(once, reps)


def bench_copies(engine: Engine, adapter: Adapter, clock: Clock) -> dict:
    """The d2d baseline (a device copy of the image's bytes) and write_image from a device-resident image."""
    lora = engine.lora
    src = torch.randn(lora.layout.slot_elems, device=engine.device).to(lora.layout.dtype)
    dst = torch.empty_like(src)
    flat = lora.slot_image(adapter, engine.device)
    slot = min(set(range(lora.max_loras)) - {lora.slot_of(k) for k in lora.resident()})
    copies = {"d2d": lambda: dst.copy_(src), "write_image": lambda: lora.write_image(slot, flat)}
    out = {}
    for name, fn in copies.items():
        fn()
        out[f"{name}_wall_us"] = wall_us(fn, clock, 30)
        if engine.device.type == "cuda":
            out[f"{name}_event_us"] = cuda_event_us(fn, 30)
    lora.scalings[slot].zero_()  # leave the free slot inert, as evict does

    def idle_copy() -> float:
        time.sleep(IDLE_S)
        t0 = clock()
        dst.copy_(src)
        return clock() - t0

    out["d2d_idle_wall_us"] = median_us(idle_copy, 15)
    return out


def bench_swap(engine: Engine, adapter: Adapter, model_dir: Path, tmp: Path, args, clock: Clock, prompts) -> dict:
    config = engine.model_config
    directory = save_adapter(adapter, tmp / "swap", "sglang", config)
    layout = engine.lora.layout
    out: dict = {
        "adapter_bytes": adapter.num_parameters * layout.dtype.itemsize,
        "image_bytes": layout.slot_elems * layout.dtype.itemsize,
        "adapter_tensors": len(adapter.tensors),
    }
    out.update(bench_copies(engine, adapter, clock))

    disk = []
    for k in range(SWAPS):
        t0 = clock()
        engine.load_adapter(f"disk{k}", load_adapter(directory, config), pinned=True)
        disk.append(clock() - t0)
        engine.unload_adapter(f"disk{k}")
    out["disk_us"] = statistics.median(disk) * 1e6

    ctx = mp.get_context("spawn")
    inbox, arrived = ctx.Queue(), ctx.Queue()
    loader = ctx.Process(target=loader_main, args=(str(model_dir), engine.config, inbox, arrived), daemon=True)
    loader.start()
    receiver = ImageReceiver(layout)
    try:

        def wait_for_message() -> None:
            """Until the loader's next message is in the queue (a swap's clock starts at its arrival)."""
            while arrived.empty():
                time.sleep(1e-4)

        def swap(key: str) -> tuple[float, float]:
            """What the worker does with an arriving staged adapter; seconds to slot written, and to done."""
            t0 = clock()
            msg = arrived.get()
            if not isinstance(msg, Staged) or msg.key != key:
                raise RuntimeError(f"loader answered {msg}, expected adapter {key} staged")
            staged = msg.staged
            adapter = receiver.adapter(staged)
            engine.load_adapter(key, adapter, pinned=True)
            t1 = clock()
            inbox.put(receiver.release(staged, adapter))
            t2 = clock()
            return t1 - t0, t2 - t0

        slot, done, end_to_end = [], [], []
        for k in range(SWAPS + 1):  # the first swap maps the ring
            key = f"ipc{k}"
            t0 = time.perf_counter()
            inbox.put(Load(key, DirectorySource(str(directory)), True))
            wait_for_message()
            t_slot, t_done = swap(key)
            end_to_end.append(time.perf_counter() - t0)
            engine.unload_adapter(key)
            slot.append(t_slot)
            done.append(t_done)
        out["ipc_first_slot_us"], out["ipc_first_done_us"] = slot[0] * 1e6, done[0] * 1e6
        out["ipc_slot_us"] = statistics.median(slot[1:]) * 1e6
        out["ipc_done_us"] = statistics.median(done[1:]) * 1e6
        out["ipc_end_to_end_us"] = statistics.median(end_to_end[1:]) * 1e6

        # Decode of 7 other adapters' requests while adapters are swapped in between their steps.
        for k in range(SWAPS):  # the loader stages them as ring rows come back
            inbox.put(Load(f"stall{k}", DirectorySource(str(directory)), True))
        params = SamplingParams(max_tokens=8 + 4 * SWAPS + 8, temperature=0.0, ignore_eos=True)
        for i in range(7):
            engine.add_request(Request(f"s{i}", prompts[i], params, f"a{i}"))
        engine.step()  # prefill
        plain, swapped, busy_slot, busy_done = [], [], [], []
        step = 0
        while engine.has_work():
            if step >= 8 and step % 4 == 0 and step // 4 - 2 < SWAPS:
                key = f"stall{step // 4 - 2}"
                wait_for_message()
                t0 = clock()
                t_slot, t_done = swap(key)
                engine.step()
                swapped.append(clock() - t0)
                busy_slot.append(t_slot)
                busy_done.append(t_done)
                engine.unload_adapter(key)  # frees the one spare slot for the next swap
            else:
                t0 = clock()
                engine.step()
                plain.append(clock() - t0)
            step += 1
        median_step = statistics.median(plain)
        out["decode_step_ms"] = median_step * 1e3
        out["decode_step_with_swap_ms"] = max(swapped) * 1e3
        out["stall_steps"] = (max(swapped) - median_step) / median_step
        out["ipc_decoding_slot_us"] = statistics.median(busy_slot) * 1e6
        out["ipc_decoding_done_us"] = statistics.median(busy_done) * 1e6
    finally:
        stop_loader(loader, inbox, receiver)
    ratios = {}
    for key, value in out.items():
        if key.endswith("_us") and not key.startswith("d2d"):
            base = out.get("d2d_event_us") if key.endswith("_event_us") else out["d2d_wall_us"]
            if base:
                ratios[key[:-3]] = value / base
    out["vs_d2d"] = ratios
    lone = ("ipc_first_slot", "ipc_first_done", "ipc_slot", "ipc_done")
    out["vs_d2d_idle"] = {key: out[f"{key}_us"] / out["d2d_idle_wall_us"] for key in lone}
    return out


def section(results: dict, name: str, fn: Callable[[], dict], out: Path | None) -> None:
    """Run one part of the benchmark; a failure is recorded and printed, the other parts still run.
    Results so far are written after every part, so a run cut short keeps what it measured."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[{name}] {time.perf_counter() - t0:.1f}s", flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")


def table(results: dict) -> str:
    tp = {**results.get("engine", {}), **results.get("engine_peft_targets", {}), **results.get("peft", {})}
    kinds = ("engine", "loop", "engine_lin", "peft")
    lines = [
        "| adapters | engine prefill | engine decode | loop prefill | loop decode | engine (peft targets) prefill "
        "| engine (peft targets) decode | peft prefill | peft decode | engine/peft decode (same targets) "
        "| engine n / engine 0 decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def get(kind: str, n: int, what: str) -> float | None:
        return tp.get(f"{kind}_{n}", {}).get(f"{what}_tok_s")

    def fmt(v: float | None, digits: int = 0) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    base = get("engine", 0, "decode")
    for n in COUNTS:
        e, lin, p = get("engine", n, "decode"), get("engine_lin", n, "decode"), get("peft", n, "decode")
        cells = [get(k, n, w) for k in kinds for w in ("prefill", "decode")]
        ratio = (lin if n else e) / p if (lin if n else e) and p else None
        vs_base = e / base if e and base else None
        lines.append(f"| {n} | " + " | ".join(fmt(c) for c in cells) + f" | {fmt(ratio, 2)} | {fmt(vs_base, 3)} |")
    swap = results.get("swap", {})
    if "ipc_done_us" in swap:
        lines.append("")
        lines.append("| swap | µs | / d2d | / idle d2d |")
        lines.append("|---|---|---|---|")
        for key in sorted(k for k in swap if k.endswith("_us")):
            ratios = (swap["vs_d2d"].get(key[:-3]), swap["vs_d2d_idle"].get(key[:-3]))
            cells = " | ".join("-" if r is None else f"{r:.2f}" for r in ratios)
            lines.append(f"| {key[:-3]} | {swap[key]:.0f} | {cells} |")
        lines.append(
            f"\nadapter {swap['adapter_bytes'] / 2**20:.1f} MiB in {swap['adapter_tensors']} tensors, slot image "
            f"{swap['image_bytes'] / 2**20:.1f} MiB; decode step {swap['decode_step_ms']:.2f} ms, with a swap "
            f"{swap['decode_step_with_swap_ms']:.2f} ms (stall {swap['stall_steps']:.2f} steps)"
        )
    return "\n".join(lines)


def make_engine(model_dir: Path, adapters: list[Adapter], args, **options) -> Engine:
    """An engine sized for the benchmark batch, with `adapters` pinned as a0, a1, ...; the prefix cache off unless
    `options` turn it on: the benchmarks repeat their prompts and mean to time computing them."""
    options = {"prefix_cache": False, **options}
    config = EngineConfig(
        max_loras_per_batch=max(COUNTS),
        max_lora_rank=args.rank,
        max_loaded_adapters=64,
        max_seqs=args.batch,
        max_batch_tokens=args.batch * args.prompt,
        dtype=args.dtype,
        device=args.device,
        **options,
    )
    engine = Engine(model_dir, config)
    for i, adapter in enumerate(adapters):
        engine.load_adapter(f"a{i}", adapter, pinned=True)
    return engine


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--swap-only", action="store_true", help="only the hot-swap table (no throughput runs)")
    ap.add_argument("--out", type=Path)
    args = parse_engine_args(ap)
    device = torch.device(args.device)
    clock = Clock(device)
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        model_dir = init_base_model(args.preset, tmp / args.preset, seed=0)
        adapters, linear_adapters = (
            random_adapters(model_dir, args.rank),
            random_adapters(model_dir, args.rank, PEFT_MIXABLE),
        )
        engine = make_engine(model_dir, adapters, args)
        print(f"[setup] {time.perf_counter() - t0:.1f}s", flush=True)
        prompts = make_prompts(args.batch, args.prompt)
        if not args.swap_only:
            section(results, "engine", partial(bench_engine, engine, clock, prompts, args.new), args.out)
        engine.unload_adapter(f"a{max(COUNTS) - 1}")  # a free slot for the swaps
        swap = partial(bench_swap, engine, adapters[-1], model_dir, tmp, args, clock, prompts)
        section(results, "swap", swap, args.out)
        if args.swap_only:
            print(table(results))
            return
        for i, adapter in enumerate(linear_adapters):  # peft's targets, for the row beside peft's
            if f"a{i}" in engine.adapters:
                engine.unload_adapter(f"a{i}")
            engine.load_adapter(f"p{i}", adapter, pinned=True)
        section(results, "engine_peft_targets", partial(bench_linear, engine, clock, prompts, args.new), args.out)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_peft:
            hf = partial(bench_peft, model_dir, linear_adapters, tmp, args, clock, prompts)
            section(results, "peft", hf, args.out)
    print(table(results))


if __name__ == "__main__":
    main()
