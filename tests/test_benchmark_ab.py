"""benchmarks/ab.py: each tree's own code runs (as `inkwell`, from links, though the venv installs this checkout),
in turn, and each figure is printed with its median, change / base and each round's ratio, after every round."""

import shutil
import subprocess
import sys
from pathlib import Path

AB = Path(__file__).resolve().parents[1] / "benchmarks" / "ab.py"

BENCH = """
import argparse, json, pathlib
import inkwell.probe as probe
ap = argparse.ArgumentParser()
ap.add_argument("--scale", type=float)
ap.add_argument("--out", type=pathlib.Path)
args = ap.parse_args()
figures = {"speed": probe.SPEED * args.scale, "runs": [{"ms": 4.0}, {"ms": probe.SPEED}], "cached": True}
args.out.write_text(json.dumps({**figures, "tree": str(pathlib.Path(probe.__file__).parents[1])}))
"""


def make_tree(root: Path, speed: float) -> Path:
    """A tree laid out as inkwell's: setup.py's FOLDERS, inkwell/, a package folder and a benchmark."""
    (root / "inkwell").mkdir(parents=True)
    (root / "inkwell" / "__init__.py").write_text("")
    (root / "probe").mkdir()
    (root / "probe" / "__init__.py").write_text(f"SPEED = {speed}\n")
    (root / "setup.py").write_text('FOLDERS = ["probe"]\nraise SystemExit("never run")\n')
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "bench_probe.py").write_text(BENCH)
    return root


def test_ab_runs_each_tree_in_turn_and_prints_the_ratios(tmp_path):
    base = make_tree(tmp_path / "base", 2.0)
    change = make_tree(tmp_path / "change", 3.0)
    shutil.copy(AB, change / "benchmarks" / "ab.py")
    cmd = [sys.executable, str(change / "benchmarks" / "ab.py"), "--base", str(base), "--rounds", "2"]
    run = subprocess.run([*cmd, "--", "bench_probe.py", "--scale", "10"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    order = [line.split("(inkwell from ")[1].rstrip(")") for line in lines if line.startswith("$ ")]
    assert order == [str(base), str(change)] * 2
    assert [line for line in lines if line.startswith("after round")] == ["after round 1 of 2", "after round 2 of 2"]
    first = lines.index("after round 1 of 2")
    third_run = [i for i, line in enumerate(lines) if line.startswith("$ ")][2]
    assert first < third_run, "the first round's table is printed before the second round runs"
    assert lines[first + 4].split() == ["speed", "20", "30", "1.5000", "1.5000"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index("after round 2 of 2") + 2 :]}
    assert rows == {
        "runs.0.ms": ["4", "4", "1.0000", "1.0000/1.0000"],
        "runs.1.ms": ["2", "3", "1.5000", "1.5000/1.5000"],
        "speed": ["20", "30", "1.5000", "1.5000/1.5000"],
    }
    matched = subprocess.run([*cmd, "--match", "speed", "--", "bench_probe.py", "--scale", "1"], capture_output=True)
    last = matched.stdout.decode().splitlines()[-1].split()
    assert matched.returncode == 0 and last == ["speed", "2", "3", "1.5000", "1.5000/1.5000"]


def test_ab_refuses_a_benchmark_a_tree_lacks(tmp_path):
    change = make_tree(tmp_path / "change", 3.0)
    shutil.copy(AB, change / "benchmarks" / "ab.py")
    base = tmp_path / "empty"
    base.mkdir()
    run = subprocess.run(
        [sys.executable, str(change / "benchmarks" / "ab.py"), "--base", str(base), "--", "bench_probe.py"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and f"base tree {base} has no benchmarks/bench_probe.py" in run.stderr
