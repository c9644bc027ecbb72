"""One benchmark on two trees of inkwell in the same call, in turn, and each figure's ratio: the change against
the code before it, on the same machine in the same run (how docs/benchmarks.md reads a speed-up).

The change is the tree this script is in; `--base DIR` is the baseline's tree (`git worktree add DIR REV`, or
`git archive REV | tar -x -C DIR` for a machine without the repository). Each tree runs as its own `inkwell`: a
folder of links laid out as that tree's setup.py maps its folders, first on PYTHONPATH, so neither tree needs
installing. The benchmark (a script in benchmarks/, with its own arguments after `--`) runs from each tree's
benchmarks/ with `--out` pointing at a JSON file, `--rounds` times: base, change, base, change... Every number
the two JSONs hold at the same place (its keys and list indices, joined by '.') is printed with the median of its
rounds, change / base and each round's change / base (the spread), after every round (a run cut short keeps the
rounds it finished); `--match` keeps the places that contain any of its words.
Run: python benchmarks/ab.py --base /tmp/base [--rounds 2] [--match tok_s] -- bench_decode_graphs.py --batch 8
"""

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def package_folders(tree: Path) -> list[str]:
    """The folders the tree's setup.py installs as `inkwell.<folder>` (its FOLDERS list, read without running it)."""
    for node in ast.walk(ast.parse((tree / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{tree / 'setup.py'} has no FOLDERS list: is {tree} a tree of inkwell?")


def link_package(tree: Path, root: Path) -> Path:
    """root/inkwell: the tree's inkwell/*.py and each of its package folders, linked; returns root for PYTHONPATH."""
    package = root / "inkwell"
    package.mkdir(parents=True)
    for module in (tree / "inkwell").glob("*.py"):
        (package / module.name).symlink_to(module)
    for folder in package_folders(tree):
        (package / folder).symlink_to(tree / folder, target_is_directory=True)
    return root


def flatten(value: object, place: str = "") -> dict[str, float]:
    """Every number in a JSON value by its place (keys and list indices joined by '.'); booleans are not numbers."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return {place: float(value)}
    else:
        return {}
    out: dict[str, float] = {}
    for key, item in items:
        out.update(flatten(item, f"{place}.{key}" if place else str(key)))
    return out


def run_once(tree: Path, path_root: Path, bench: list[str], out: Path) -> dict[str, float]:
    """The benchmark from `tree`'s benchmarks/ as that tree's inkwell, its figures flattened from its --out JSON."""
    script, *args = bench
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path_root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out)]
    print(f"$ {' '.join(cmd)}   (inkwell from {tree})", flush=True)
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    return flatten(json.loads(out.read_text()))


def ratio(new: float, base: float) -> float:
    return new / base if base else float("nan")


def compare(base: list[dict[str, float]], new: list[dict[str, float]], match: list[str]) -> list[tuple]:
    """(place, base median, change median, change / base, each round's change / base) for each place both runs
    hold in every round."""
    places = set.intersection(*(set(r) for r in base + new))
    rows = []
    for place in sorted(p for p in places if not match or any(m in p for m in match)):
        b = statistics.median(r[place] for r in base)
        n = statistics.median(r[place] for r in new)
        rounds = [ratio(rn[place], rb[place]) for rb, rn in zip(base, new, strict=True)]
        rows.append((place, b, n, ratio(n, b), rounds))
    return rows


def table(rows: list[tuple], done: int, rounds: int) -> str:
    """The comparison after `done` of `rounds` rounds: medians, their ratio and each round's (the spread)."""
    lines = [
        f"\nafter round {done} of {rounds}",
        f"{'place':<60} {'base':>14} {'change':>14} {'change/base':>12}  rounds",
    ]
    for place, b, n, r, each in rows:
        lines.append(f"{place:<60} {b:>14.6g} {n:>14.6g} {r:>12.4f}  {'/'.join(f'{x:.4f}' for x in each)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the baseline's tree of inkwell")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each tree, in turn")
    ap.add_argument("--match", nargs="*", default=[], help="print only the places containing one of these")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: a script in benchmarks/")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name the benchmark after --, e.g. -- bench_decode_graphs.py --batch 8")
    trees = {"base": args.base.resolve(), "change": HERE}
    for name, tree in trees.items():
        if not (tree / "benchmarks" / bench[0]).is_file():
            ap.error(f"{name} tree {tree} has no benchmarks/{bench[0]}")
    runs: dict[str, list[dict[str, float]]] = {"base": [], "change": []}
    with tempfile.TemporaryDirectory(prefix="inkwell-ab-") as tmp:
        roots = {name: link_package(tree, Path(tmp) / name) for name, tree in trees.items()}
        for i in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run_once(tree, roots[name], bench, Path(tmp) / f"{name}-{i}.json"))
            # after every round, so a run cut short (a time limit) keeps the rounds it finished
            print(table(compare(runs["base"], runs["change"], args.match), i + 1, args.rounds), flush=True)


if __name__ == "__main__":
    main()
