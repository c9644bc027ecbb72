"""Load test of the adapter registry: 32 concurrent clients list, get and download on loopback.

Starts `inkwell serve --workers 0` (embedded SeaweedFS; SQLite, or PostgreSQL with
--database-url) in a subprocess, publishes a few inkling-tiny adapters through the import API,
then runs a bounded number of requests per client and reports p50/p99 latency per operation
and the error count. `--write` puts the table into docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_registry.py --clients 32 --rounds 25 --write
"""

import argparse
import asyncio
import hashlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.io import save_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, init_base_model, load_base_config

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path, port: int, database_url: str | None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "INKWELL_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1"}
    env.pop("INKWELL_S3_ENDPOINT", None)
    if database_url:
        env["INKWELL_DATABASE_URL"] = database_url
    log = data_dir / "serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inkwell.cli", "serve", "--port", str(port), "--workers", "0"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"inkwell serve exited:\n{log.read_text()[-3000:]}")
        match = re.search(r"(ink_[A-Za-z0-9_-]{20,})", log.read_text())
        if match:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    return proc, match.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    raise RuntimeError("inkwell serve did not come up (a reused data dir prints no key; use a fresh one)")


def seed(client: httpx.Client, scratch: Path, adapters: int, versions: int) -> list[tuple[str, int, str]]:
    """Publish adapters; returns (name, version, download_path of the weights) for each version."""
    base = init_base_model("inkling-tiny", scratch / "base")
    config, identity = load_base_config(base), base_model_identity(base)
    spec = LoraSpec(rank=8, alpha=16)
    out = []
    for a in range(adapters):
        for v in range(versions):
            directory = save_adapter(
                init_adapter(config, spec, identity, seed=a * 100 + v, b_std=0.01),
                scratch / f"a{a}v{v}",
                "sglang",
                config,
            )
            files = [("files", (p.name, p.read_bytes())) for p in sorted(directory.iterdir())]
            resp = client.post(
                "/v1/adapters/import",
                files=files,
                data={"name": f"bench-{a}", "base_model": "inkling-tiny", "layout": "sglang"},
            )
            resp.raise_for_status()
            row = resp.json()
            weights = next(f for f in row["files"] if f["layout"] == "sglang" and f["path"].endswith(".safetensors"))
            out.append((row["name"], row["version"], weights["sha256"]))
    return out


async def run_client(url: str, key: str, targets, rounds: int, lat: dict, errors: list, index: int) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for r in range(rounds):
            name, version, sha = targets[(index + r) % len(targets)]
            path = f"/v1/adapters/{name}/versions/{version}/files/sglang/adapter_model.safetensors"
            for op, method_path in (
                ("list", "/v1/adapters"),
                ("get", f"/v1/adapters/{name}/versions/{version}"),
                ("download", path),
            ):
                t0 = time.perf_counter()
                try:
                    resp = await c.get(method_path)
                    ok = resp.status_code == 200
                    if ok and op == "download":
                        ok = hashlib.sha256(resp.content).hexdigest() == sha
                except httpx.HTTPError as exc:
                    ok = False
                    errors.append(f"{op}: {exc!r}")
                lat[op].append(time.perf_counter() - t0)
                if not ok:
                    errors.append(f"{op} {method_path}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=25, help="list+get+download rounds per client")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--database-url", default=None, help="default: SQLite in the scratch dir")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        scratch = Path(tmp)
        port = free_port()
        proc, key = start_server(scratch / "data", port, args.database_url)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
                targets = seed(client, scratch, args.adapters, args.versions)
                size = next(
                    f["size"]
                    for f in client.get(f"/v1/adapters/{targets[0][0]}/versions/1").json()["files"]
                    if f["layout"] == "sglang" and f["path"].endswith(".safetensors")
                )
            lat: dict[str, list[float]] = defaultdict(list)
            errors: list[str] = []

            async def all_clients() -> float:
                t0 = time.perf_counter()
                await asyncio.gather(
                    *(run_client(url, key, targets, args.rounds, lat, errors, i) for i in range(args.clients))
                )
                return time.perf_counter() - t0

            wall = asyncio.run(all_clients())
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)

    total = sum(len(v) for v in lat.values())
    backend = "PostgreSQL" if args.database_url else "SQLite"
    rows = [
        f"| {op} | {len(v)} | {pct(v, 0.5):.1f} | {pct(v, 0.99):.1f} | {statistics.mean(v) * 1000:.1f} |"
        for op, v in lat.items()
    ]
    table = "\n".join(
        [
            f"{args.clients} concurrent clients x {args.rounds} rounds of list + get + download "
            f"({args.adapters * args.versions} versions, weights {size / 1024:.0f} KiB, sha256 checked by the client); "
            f"{backend}, embedded SeaweedFS, one uvicorn process, loopback.",
            "",
            "| operation | requests | p50 ms | p99 ms | mean ms |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"{total} requests in {wall:.1f} s ({total / wall:.0f} req/s), **{len(errors)} errors**. "
            f"Machine: {os.cpu_count()} CPU cores shared with the clients and other work "
            f"(1-min load average {os.getloadavg()[0]:.1f} at the end). With {args.clients} requests always in flight "
            f"the latency is mostly queueing: clients / throughput = {args.clients / (total / wall) * 1000:.0f} ms.",
        ]
    )
    print(table)
    if errors:
        print("first errors:", errors[:5])
    if args.write:
        doc = REPO / "docs" / "benchmarks.md"
        start, end = f"<!-- bench_registry:{backend}:start -->", f"<!-- bench_registry:{backend}:end -->"
        title = f"## Registry load test, {backend} (`benchmarks/bench_registry.py`)"
        section = f"{start}\n{title}\n\n{table}\n{end}"
        text = doc.read_text() if doc.exists() else "# Benchmarks\n"
        if start in text:
            text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
        doc.write_text(text)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
