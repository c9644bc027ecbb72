"""Verifiable problems for RL: a JSONL file of `{"prompt", "answer"}` lines.

The answer is what a verifier (`inkwell.trainer.verifiers`) compares a completion with: the expected text for
`exact_match`, a pattern for `regex`.
"""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def load_problems(path: str | Path) -> list[Problem]:
    """Every line of a JSONL file as a Problem; a line without a string `prompt` and `answer` is an error."""
    problems = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("answer"), str)):
            raise ValueError(f"{path}:{number}: a problem is an object with string 'prompt' and 'answer'")
        problems.append(Problem(row["prompt"], row["answer"]))
    return problems
