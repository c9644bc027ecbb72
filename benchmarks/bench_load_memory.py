"""Peak host memory of loading a sharded `inkling-small` with the base-model loader, on the CPU.

Writes `inkling-small` (random weights, --dtype, released names and the multimodal config, or --names
transformers with the text config) as --shards safetensors shards with their index into a temporary folder, then
loads it in a fresh subprocess per consumer and reads that process's peak RSS (ru_maxrss) above its RSS just
before loading:

- `checkpoint`: every tensor read into one dict (the loader alone);
- `transformers`: `load_base_model`, the reference `InklingForCausalLM`;
- `native`: the native engine's `InklingModel` (CPU);
- `trainer`: the megatron-core `InklingGPT` (base only, TP=EP=1) built, then `load_state` from the checkpoint.

The bound asked of the loader: the model's bytes plus one shard. It reads with pread(2) into new memory (no file
is mapped), so what it adds to the model itself is one tensor at a time.
Run: python benchmarks/bench_load_memory.py [--shards 4] [--names released] [--dtype bfloat16] [--md table.md]
"""

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from inkwell.models import load_base_model, load_base_weights, preset_config
from inkwell.models.names import expected_tensors
from inkwell.models.released import ReleasedWeights, released_config
from inkwell.models.shards import write_shards

CONSUMERS = ("checkpoint", "transformers", "native", "trainer")
GIB = 1024**3


class RandomWeights(Mapping[str, torch.Tensor]):
    """A model's tensors made up when asked for (N(0, 0.02)), so that writing it never holds all of them."""

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype):
        self.shapes, self.dtype = shapes, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(list(self.shapes).index(name))
        return (torch.randn(self.shapes[name], generator=generator) * 0.02).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_model(out: Path, names: str, shards: int, dtype: torch.dtype) -> None:
    config = preset_config("inkling-small")
    weights = RandomWeights(expected_tensors(config), dtype)
    if names == "released":
        (out / "config.json").write_text(json.dumps(released_config(config)))
        write_shards(ReleasedWeights(weights), out, shards)
    else:
        (out / "config.json").write_text(json.dumps(config.to_dict(), default=str))
        write_shards(weights, out, shards)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def load(model_dir: Path, consumer: str, dtype: torch.dtype) -> dict:
    """Run in the subprocess: load with `consumer`; RSS before, peak, and what stays resident."""
    torch.set_num_threads(2)
    if consumer == "trainer":
        from inkwell.trainer.bridge import load_state
        from inkwell.trainer.model import InklingGPT
        from inkwell.trainer.parallel import model_parallel

        with model_parallel(tp=1, ep=1, device="cpu", seed=0):
            before = rss_bytes()
            weights = load_base_weights(model_dir)
            model = InklingGPT(weights.config, None, dtype, "cpu", "eager")
            load_state(model, weights, lora=False)
            return {"before": before, "peak": _max_rss(), "after": rss_bytes()}
    before = rss_bytes()
    if consumer == "checkpoint":
        kept = dict(load_base_weights(model_dir).items())
    elif consumer == "transformers":
        kept = load_base_model(model_dir, dtype=dtype)
    else:
        from inkwell.serving.native.model import InklingModel

        weights = load_base_weights(model_dir)
        kept = InklingModel(weights.config, weights, dtype=dtype)
        del weights
    result = {"before": before, "peak": _max_rss(), "after": rss_bytes()}
    del kept
    return result


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--names", choices=("released", "transformers"), default="released")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--consumers", default=",".join(CONSUMERS))
    parser.add_argument("--md", type=Path, help="also write the table as markdown here")
    parser.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # the subprocess: load this folder
    parser.add_argument("--consumer", choices=CONSUMERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.load is not None:
        print(json.dumps(load(args.load, args.consumer, dtype)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_model(model_dir, args.names, args.shards, dtype)
        files = sorted(model_dir.glob("*.safetensors"))
        model_bytes = load_base_weights(model_dir).nbytes
        shard = max(f.stat().st_size for f in files)
        rows = []
        for consumer in args.consumers.split(","):
            command = [
                sys.executable,
                __file__,
                "--load",
                str(model_dir),
                "--consumer",
                consumer,
                "--dtype",
                args.dtype,
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            got = json.loads(out)
            peak = got["peak"] - got["before"]
            rows.append((consumer, peak, got["after"] - got["before"], peak <= model_bytes + shard))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"inkling-small, {args.dtype}, {args.names} names, {len(files)} shards: model {model_bytes / GIB:.2f} GiB, "
        f"largest shard {shard / GIB:.2f} GiB, bound (model + shard) {(model_bytes + shard) / GIB:.2f} GiB",
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{when}",
        "",
        "| consumer | peak RSS above start (GiB) | resident after (GiB) | within model + one shard |",
        "|---|---|---|---|",
        *[f"| {c} | {p / GIB:.2f} | {a / GIB:.2f} | {'yes' if ok else 'NO'} |" for c, p, a, ok in rows],
    ]
    print("\n".join(lines))
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
