"""Verifiable problems for RL: a JSONL file of `{"prompt", "answer"}` lines, the dataset format's prompt/answer
records (`inkwell.trainer.records`, the rules a dataset upload checks too).

The answer is what a verifier (`inkwell.trainer.verifiers`) compares a completion with: the expected text for
`exact_match`, a pattern for `regex`.
"""

from pathlib import Path

from inkwell.trainer.records import JsonlError, PromptAnswer, PromptCompletion, parse_jsonl

Problem = PromptAnswer  # one record of the dataset format, not a second definition


def load_problems(path: str | Path, answer: str | None = None) -> list[Problem]:
    """Every line of a JSONL file as a Problem. With `answer`, every prompt gets that answer and the lines need
    prompts only (prompt/completion lines do too); without, they are prompt/answer lines."""
    try:
        lines = parse_jsonl(Path(path).read_bytes())
    except JsonlError as exc:
        raise ValueError(f"{path}:{exc.line}: {exc.reason}") from exc
    records = [record for _, record in lines]
    if answer is not None and all(isinstance(r, PromptAnswer | PromptCompletion) for r in records):
        return [PromptAnswer(r.prompt, answer) for r in records]
    if not all(isinstance(r, PromptAnswer) for r in records):
        raise ValueError(f'{path}: {records[0].format} lines; problems are {{"prompt", "answer"}} lines')
    return records
