"""Host time per decode step of streaming detokenization: TextTracker against decoding every token each step.

A generation of L tokens (the presets' byte-level tokenizer; text mixing 1- to 4-byte characters) is fed one
token at a time, as the engine feeds each sequence after each step. Per step, on average over the generation
and over its last 64 steps:
  tracker      TextTracker.update (incremental: decodes the tokens since its last committed chunk)
  full decode  tokenizer.decode of every generated token, which is what the tracker did before, per step
               (its decode alone: a lower bound of that tracker's cost)
A batch of B sequences pays B times this on every step. CPU only; the figure depends on the host.
Run: python benchmarks/bench_detokenize.py [--lengths 64 512 2048]
"""

import argparse
import platform
import time

from inkwell.models.tokenizer import build_tokenizer
from inkwell.serving.text import TextTracker

TEXT = "Inkling serves many adapters \u00e0 la fois: \u4e2d\u6587, \U0001f600, and plain ASCII. "


def per_step_us(step, length: int, tail: int = 64) -> tuple[float, float]:
    """Mean µs of step(i) over i = 1..length, and over the last `tail` steps."""
    times = []
    for i in range(1, length + 1):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return 1e6 * sum(times) / length, 1e6 * sum(times[-tail:]) / min(tail, length)


def bench_length(tokenizer, length: int) -> str:
    """One table row: both ways over a generation of `length` tokens."""
    ids = tokenizer.encode(TEXT * (length // len(TEXT.encode()) + 1), add_special_tokens=False)[:length]
    tracker = TextTracker(tokenizer, ("</answer>",))
    new = per_step_us(lambda i: tracker.update(ids[:i], final=i == length), length)
    old = per_step_us(lambda i: tokenizer.decode(ids[:i], skip_special_tokens=True), length)
    return f"| {length} | {new[0]:.1f} / {new[1]:.1f} | {old[0]:.1f} / {old[1]:.1f} | {old[1] / new[1]:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    args = ap.parse_args()
    tokenizer = build_tokenizer()
    print(f"host: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| tokens | tracker µs/step (mean / last 64) | full decode µs/step (mean / last 64) | ratio, last 64 |")
    print("|---|---|---|---|")
    for length in args.lengths:
        print(bench_length(tokenizer, length))


if __name__ == "__main__":
    main()
