"""The JSONL training-data format, read by one set of rules: the service's dataset upload and the trainer both
parse files with `parse_jsonl`, so a file the upload accepts is a file the trainer reads, line for line.

Every non-blank line is a JSON object in one of three formats, and a file holds one format only:

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` with at least one
  assistant message with non-empty content (the tokens the model learns from);
- prompt/completion: `{"prompt": "...", "completion": "..."}` with a non-empty completion;
- prompt/answer: `{"prompt": "...", "answer": "..."}` and no completion: a problem for RL (method `grpo`), whose
  answer a built-in verifier (`inkwell.trainer.verifiers`) compares the sampled completions with. SFT refuses it.

A missing `prompt` is refused (write `"prompt": ""` for none). The upload refused it and the trainer read it as
"": the stricter rule wins, so a misspelt key ("promt") fails loudly instead of training on completions without
their prompts. Other keys are ignored. The text must be UTF-8; lines end at \\n, \\r\\n or \\r.
"""

import codecs
import json
import re
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, TypedDict

DatasetFormat = Literal["chat", "prompt_completion", "prompt_answer"]
SFT_FORMATS: tuple[DatasetFormat, ...] = ("chat", "prompt_completion")  # what SFT learns from: completions
_LINE_END = re.compile(r"\r\n|\r|\n")


class JsonlError(ValueError):
    """The first bad line of a file; `line` is 1-based, `reason` says what is wrong and how to fix it."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


class Message(TypedDict):
    role: str
    content: str


@dataclass(frozen=True)
class Chat:
    """A chat example; the loss falls on the assistant messages."""

    messages: tuple[Message, ...]
    format: ClassVar[DatasetFormat] = "chat"


@dataclass(frozen=True)
class PromptCompletion:
    """Raw text: the loss falls on the completion only."""

    prompt: str
    completion: str
    format: ClassVar[DatasetFormat] = "prompt_completion"


@dataclass(frozen=True)
class PromptAnswer:
    """A problem for RL: a prompt to sample completions of, and the answer a verifier scores them against."""

    prompt: str
    answer: str
    format: ClassVar[DatasetFormat] = "prompt_answer"


type Record = Chat | PromptCompletion | PromptAnswer


class Line(NamedTuple):
    number: int
    record: Record


def _chat(messages: object) -> Chat:
    # On use: the API schemas import DatasetFormat from here, and the SDK reads them without loading transformers.
    from inkwell.models.tokenizer import chat_role

    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a {{role, content}} object")
        content = message.get("content")
        try:
            role = chat_role(message.get("role"))
        except ValueError as e:
            raise ValueError(f"messages[{i}].{e}") from None
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        parsed.append(Message(role=role, content=content))
    if not any(m["role"] == "assistant" and m["content"] for m in parsed):
        raise ValueError("a chat example needs an assistant message with content; it is what the model learns")
    return Chat(tuple(parsed))


def _prompt_completion(obj: dict) -> PromptCompletion:
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string (\"\" for none)")
    if not isinstance(completion, str) or not completion:
        raise ValueError("'completion' must be a non-empty string; it is what the model learns")
    return PromptCompletion(prompt, completion)


def _prompt_answer(obj: dict) -> PromptAnswer:
    prompt, answer = obj.get("prompt"), obj.get("answer")
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string (\"\" for none)")
    if not isinstance(answer, str):
        raise ValueError("'answer' must be a string: what the verifier compares each completion with")
    return PromptAnswer(prompt, answer)


def parse_record(obj: object) -> Record:
    """One decoded JSONL line as an example; ValueError says why it is not one."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return _chat(obj["messages"])
    if "answer" in obj and "completion" not in obj:
        return _prompt_answer(obj)
    if "prompt" in obj or "completion" in obj:
        return _prompt_completion(obj)
    raise ValueError(
        f"an example needs 'messages' (chat), 'prompt' and 'completion', or 'prompt' and 'answer'; found keys "
        f"{sorted(obj)}"
    )


def parse_jsonl(data: bytes) -> list[Line]:
    """Every example of a JSONL file with its line number; JsonlError for the first line that is not UTF-8, not
    JSON, not an example or of another format than the lines before it, or for a file without examples."""
    data = data.removeprefix(codecs.BOM_UTF8)  # the mark some editors write first; not part of line 1
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = len(_LINE_END.split(data[: exc.start].decode("utf-8")))
        raise JsonlError(line, "not UTF-8 text; save the file as UTF-8 JSONL") from exc
    lines: list[Line] = []
    for number, raw in enumerate(_LINE_END.split(text), start=1):
        if not raw.strip():
            continue
        try:
            record = parse_record(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise JsonlError(number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        except RecursionError as exc:  # json.loads gives up on deep nesting; no example is nested like that
            raise JsonlError(number, "JSON nested too deeply; an example is an object of strings and lists") from exc
        except ValueError as exc:
            raise JsonlError(number, str(exc)) from exc
        if lines and record.format != lines[0].record.format:
            first = lines[0].record.format
            raise JsonlError(number, f"this line is {record.format} but earlier lines are {first}; use one format")
        lines.append(Line(number, record))
    if not lines:
        raise JsonlError(1, "the file has no examples")
    return lines
