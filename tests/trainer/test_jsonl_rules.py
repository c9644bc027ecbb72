"""One JSONL rule book: every file below is accepted or refused identically by the dataset upload
(`inkwell.service.datasets.validate_jsonl`) and by the trainer (`load_examples`), on the same line for the
same reason."""

import json

import pytest

from inkwell.models import load_tokenizer
from inkwell.service.datasets import validate_jsonl
from inkwell.trainer.config import TrainConfigError
from inkwell.trainer.dataset import load_examples
from inkwell.trainer.records import JsonlError


def lines(*records) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PC = {"prompt": "2+2=", "completion": "4"}


def chat(*messages) -> dict:
    return {"messages": list(messages)}


# (id, file, ("accept", format, examples) or ("refuse", line, words in the reason))
TABLE = [
    ("chat", lines(CHAT, CHAT), ("accept", "chat", 2)),
    (
        "chat-system-extra-keys",
        lines(
            {**CHAT, "id": 7}, chat({"role": "system", "content": ""}, {"role": "assistant", "content": "x", "n": 1})
        ),
        ("accept", "chat", 2),
    ),
    (
        "chat-developer-role",  # OpenAI's newer name for the system turn
        lines(chat({"role": "developer", "content": "be brief"}, *CHAT["messages"])),
        ("accept", "chat", 1),
    ),
    ("prompt-completion", lines(PC, PC, PC), ("accept", "prompt_completion", 3)),
    ("empty-prompt", lines({"prompt": "", "completion": "x"}), ("accept", "prompt_completion", 1)),
    (
        "blank-lines-and-crlf",
        b"\r\n" + lines(PC).replace(b"\n", b"\r\n  \r\n") + lines(PC).strip(),
        ("accept", "prompt_completion", 2),
    ),
    ("cr-line-ends", lines(PC).replace(b"\n", b"\r") + lines(PC), ("accept", "prompt_completion", 2)),
    ("utf8-bom", b"\xef\xbb\xbf" + lines(PC, PC), ("accept", "prompt_completion", 2)),  # as Notepad and Excel save
    ("bom-then-not-utf8", b"\xef\xbb\xbf" + lines(PC) + b"\xff\n", ("refuse", 2, "not UTF-8")),
    ("not-json", lines(PC, '{"prompt": "a"'), ("refuse", 2, "not valid JSON")),
    ("not-an-object", lines("[1, 2]"), ("refuse", 1, "expected a JSON object, got list")),
    ("unknown-shape", lines(PC, {"text": "hello"}), ("refuse", 2, "needs 'messages'")),
    ("missing-prompt", lines({"completion": "x"}), ("refuse", 1, "'prompt' must be a string")),
    ("misspelt-prompt", lines({"promt": "a", "completion": "x"}), ("refuse", 1, "'prompt' must be a string")),
    ("prompt-not-string", lines({"prompt": 3, "completion": "x"}), ("refuse", 1, "'prompt' must be a string")),
    ("missing-completion", lines(PC, PC, {"prompt": "x"}), ("refuse", 3, "'completion' must be a non-empty")),
    ("empty-completion", lines({"prompt": "x", "completion": ""}), ("refuse", 1, "'completion' must be a non-empty")),
    ("messages-not-list", lines({"messages": "hi"}), ("refuse", 1, "non-empty list")),
    ("messages-empty", lines({"messages": []}), ("refuse", 1, "non-empty list")),
    ("message-not-object", lines(chat("hi")), ("refuse", 1, "messages[0] must be")),
    ("unknown-role", lines(chat({"role": "bot", "content": "x"})), ("refuse", 1, "messages[0].role must be one of")),
    ("role-not-string", lines(chat({"role": ["user"], "content": "x"})), ("refuse", 1, "messages[0].role")),
    (
        "content-not-string",
        lines(chat({"role": "user", "content": "x"}, {"role": "assistant", "content": None})),
        ("refuse", 1, "messages[1].content must be a string"),
    ),
    ("no-assistant", lines(CHAT, "", chat({"role": "user", "content": "q"})), ("refuse", 3, "assistant")),
    (
        "empty-assistant",
        lines(chat({"role": "user", "content": "q"}, {"role": "assistant", "content": ""})),
        ("refuse", 1, "assistant message with content"),
    ),
    ("mixed-formats", lines(CHAT, PC), ("refuse", 2, "use one format")),
    ("not-utf8", lines(PC) + b"\xff\xfe\n", ("refuse", 2, "not UTF-8")),
    ("no-examples", b"\n \n", ("refuse", 1, "no examples")),
    ("nested-too-deeply", lines(PC, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), ("refuse", 2, "too deeply")),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("data,expected", [case[1:] for case in TABLE], ids=[case[0] for case in TABLE])
def test_upload_and_trainer_apply_the_same_rules(tmp_path, tokenizer, data, expected):
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    limits = {"seq_len": 1024, "max_positions": 1024}
    if expected[0] == "accept":
        _, fmt, count = expected
        summary = validate_jsonl(data)
        assert (summary.format, summary.num_examples) == (fmt, count)
        assert len(load_examples(path, tokenizer, field="dataset_path", **limits)) == count
        return
    _, line, words = expected
    with pytest.raises(JsonlError) as upload:
        validate_jsonl(data)
    with pytest.raises(TrainConfigError) as training:
        load_examples(path, tokenizer, field="dataset_path", **limits)
    assert upload.value.line == training.value.line == line
    assert words in upload.value.reason
    assert str(training.value) == f"d.jsonl line {line}: {upload.value.reason}"
    assert training.value.field == "dataset_path"


def test_a_developer_turn_trains_as_the_system_turn(tmp_path, tokenizer):
    """OpenAI's "developer" role opens the system turn: the trainer's tokens and the saved chat template's agree."""
    tokens = {}
    for role in ("developer", "system"):
        messages = [{"role": role, "content": "be brief"}, *CHAT["messages"]]
        path = tmp_path / f"{role}.jsonl"
        path.write_bytes(lines(chat(*messages)))
        (example,) = load_examples(path, tokenizer, field="dataset_path", seq_len=1024, max_positions=1024)
        assert tokenizer.apply_chat_template(messages, tokenize=False).startswith("<bos><|system|>be brief<|end|>")
        tokens[role] = (example.ids, example.mask)
    assert tokens["developer"] == tokens["system"]


def test_an_unknown_role_is_named_cut_short():
    """The refusal quotes the role the file gave, but not a whole line's worth of it."""
    with pytest.raises(JsonlError) as refused:
        validate_jsonl(lines(chat({"role": "x" * 100_000, "content": "q"}, {"role": "assistant", "content": "a"})))
    assert refused.value.reason.startswith("messages[0].role must be one of assistant, developer, system, user, got")
    assert len(refused.value.reason) < 200
