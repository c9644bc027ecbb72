"""Bad jobs fail in train() before any training step, with the field (and dataset line) named."""

import json

import pytest

from inkwell.models import base_model_identity, init_base_model
from inkwell.trainer import TrainCallbacks, TrainConfigError, train
from inkwell.trainer.checkpoint import META, STATE


class Recorder(TrainCallbacks):
    def __init__(self):
        self.events = []

    def on_event(self, event):
        self.events.append(event)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"prompt": "reverse abc =", "completion": " cba"}


def job(tmp_path, base, dataset, **overrides):
    return {
        "base_model_dir": str(base),
        "dataset_path": str(dataset),
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "batch_size": 2,
        "seq_len": 64,
        **overrides,
    }


def fails(config, field, line=None, match=None):
    recorder = Recorder()
    with pytest.raises(TrainConfigError) as info:
        train(config, recorder)
    assert info.value.field == field, str(info.value)
    assert info.value.line == line, str(info.value)
    if match:
        assert match in str(info.value)
    assert recorder.events == [], "training must not have started"
    return info.value


def test_dataset_line_without_completion_is_named(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"prompt": "reverse xyz ="}, GOOD])
    err = fails(job(tmp_path, tiny_model_dir, data), "dataset_path", line=3, match="line 3")
    assert "completion" in str(err)
    assert not (tmp_path / "out" / "adapters").exists()


def test_chat_line_without_assistant_turn_is_named(tmp_path, tiny_model_dir):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, "", chat])
    fails(job(tmp_path, tiny_model_dir, data), "dataset_path", line=3, match="assistant")


def test_invalid_json_and_unknown_shape_are_named(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, "{not json"])
    fails(job(tmp_path, tiny_model_dir, data), "dataset_path", line=2, match="not valid JSON")
    data = write_jsonl(tmp_path / "e.jsonl", [{"text": "hello"}])
    fails(job(tmp_path, tiny_model_dir, data), "dataset_path", line=1, match="messages")


def test_sequence_longer_than_the_model_is_named(tmp_path, tiny_model_dir):
    long = {"prompt": "x" * 1100, "completion": "y"}  # inkling-tiny: max_position_embeddings 1024
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, long])
    fails(job(tmp_path, tiny_model_dir, data, seq_len=1024), "dataset_path", line=2, match="max_position_embeddings")
    fails(job(tmp_path, tiny_model_dir, data, seq_len=2048), "seq_len", match="max_position_embeddings")
    data = write_jsonl(tmp_path / "e.jsonl", [GOOD, {"prompt": "x" * 100, "completion": "y"}])
    fails(job(tmp_path, tiny_model_dir, data), "dataset_path", line=2, match="seq_len")


def test_bad_lora_spec_names_the_field(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    err = fails(job(tmp_path, tiny_model_dir, data, lora={"rank": 0}), "lora.rank")
    assert "greater than or equal to 1" in str(err)
    err = fails(job(tmp_path, tiny_model_dir, data, lora={"targets": ["attn", "router"]}), "lora.targets")
    assert "unknown target group 'router'" in str(err)


def test_layout_the_model_cannot_split_is_refused(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    fails(job(tmp_path, tiny_model_dir, data, ep=3, nproc=3, batch_size=3), "ep", match="n_routed_experts")


def test_checkpoint_of_another_base_model_is_refused(tmp_path, tiny_model_dir):
    other = init_base_model("inkling-tiny", tmp_path / "other", seed=1, name="other-tiny")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / STATE).write_bytes(b"")
    meta = {
        "base_model": base_model_identity(other).to_dict(),
        "lora": {},
        "layout": {"tp": 1, "ep": 1, "nproc": 1},
        "step": 1,
    }
    (checkpoint / META).write_text(json.dumps(meta))
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    err = fails(job(tmp_path, tiny_model_dir, data, resume_from=str(checkpoint)), "resume_from")
    assert "other-tiny" in str(err)
    fails(job(tmp_path, tiny_model_dir, data, resume_from=str(tmp_path)), "resume_from", match="not a checkpoint")


@pytest.mark.parametrize(
    "overrides,match",
    [({"grad_accum": 2, "batch_size": 4}, "use grad_accum 1"), ({"nproc": 2, "tp": 2}, "several processes")],
)
def test_cuda_graph_layers_are_refused_where_they_cannot_work(tmp_path, tiny_model_dir, overrides, match):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    fails(job(tmp_path, tiny_model_dir, data, compile="reduce-overhead", **overrides), None, match=match)
