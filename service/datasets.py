"""JSONL training data: validated line by line before it is stored, so a job never starts on a
file the trainer would reject. Two formats, one per file: chat `messages` or `prompt`/`completion`.
"""

import json
from dataclasses import dataclass

from inkwell.models.tokenizer import ROLE_TOKENS


class DatasetError(ValueError):
    """A bad line; `line` is 1-based."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


@dataclass(frozen=True)
class DatasetSummary:
    format: str
    num_examples: int


def _line_format(obj: object) -> str:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(sorted(ROLE_TOKENS))}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("a chat example needs at least one assistant message to learn from")
        return "chat"
    if "prompt" in obj or "completion" in obj:
        if not isinstance(obj.get("prompt"), str):
            raise ValueError("'prompt' must be a string")
        if not isinstance(obj.get("completion"), str) or not obj["completion"]:
            raise ValueError("'completion' must be a non-empty string")
        return "prompt_completion"
    raise ValueError("an example needs 'messages' (chat) or 'prompt' and 'completion'")


def validate_jsonl(data: bytes) -> DatasetSummary:
    """The file's format and example count, or DatasetError for the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DatasetError(line, "not UTF-8 text; save the file as UTF-8 JSONL") from exc
    fmt: str | None = None
    count = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DatasetError(number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        try:
            line_format = _line_format(obj)
        except ValueError as exc:
            raise DatasetError(number, str(exc)) from exc
        if fmt is not None and line_format != fmt:
            raise DatasetError(number, f"this line is {line_format} but earlier lines are {fmt}; use one format")
        fmt = line_format
        count += 1
    if fmt is None:
        raise DatasetError(1, "the file has no examples")
    return DatasetSummary(format=fmt, num_examples=count)
