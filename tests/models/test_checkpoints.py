"""Base models as they are released: every combination of names, sharding and config reads as the original, and
what is wrong with a checkpoint is named (the tensor and its file) before anything uses it."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import InklingForConditionalGeneration
from typer.testing import CliRunner

from inkwell import cli
from inkwell.models import BaseModelError, load_base_config, load_base_model, load_base_weights
from inkwell.models.released import ReleasedWeights, placement
from inkwell.models.shards import INDEX_FILE
from tests.models.layouts import LAYOUTS, Layout, file_of, write_layout

PROMPT = torch.randint(0, 263, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    return {layout.id: write_layout(tiny_model_dir, root / layout.id, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def reference_logits(tiny_model_dir) -> torch.Tensor:
    with torch.no_grad():
        return load_base_model(tiny_model_dir)(PROMPT).logits


def _victim(model_dir, layout: Layout) -> str:
    """A stored tensor of the second shard (of the one file), as that layout names it."""
    name = "model.layers.1.self_attn.q_proj.weight"
    if layout.names == "released":
        name = placement(name).name
    elif layout.config == "multimodal":
        name = name.replace("model.", "model.language_model.", 1)
    if layout.shards > 1:
        weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        name = next(n for n, f in weight_map.items() if f.startswith("model-00002") and "tower" not in n)
    return name


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.id)
def test_every_layout_reads_as_the_original_and_gives_its_logits_exactly(
    layouts, tiny_model_dir, reference_logits, layout
):
    original, checkpoint = load_base_weights(tiny_model_dir), load_base_weights(layouts[layout.id])
    assert sorted(checkpoint) == sorted(original)
    for name in original:
        assert checkpoint.shape(name) == original.shape(name)
        assert torch.equal(checkpoint[name], original[name]), name
    assert checkpoint.config.to_dict()["layer_types"] == original.config.to_dict()["layer_types"]
    if layout.config == "multimodal":
        assert "the vision and audio towers are ignored" in checkpoint.notes[0]
        assert any(note.endswith("of the vision tower") for note in checkpoint.notes)
    else:
        assert checkpoint.notes == []
    with torch.no_grad():
        assert torch.equal(load_base_model(layouts[layout.id])(PROMPT).logits, reference_logits)


@pytest.mark.parametrize("layout_id", ["released-3-multimodal", "transformers-3-text"])
def test_a_slice_read_is_that_slice_of_the_tensor(layouts, layout_id):
    """What a TP/EP rank asks for: ranges of leading dims, across the gate and up halves of a fused tensor too."""
    checkpoint = load_base_weights(layouts[layout_id])
    gen = torch.Generator().manual_seed(1)
    for name in checkpoint:
        full = checkpoint[name]
        for _ in range(3):
            index = []
            for size in full.shape[: min(full.dim(), 2)]:
                start = int(torch.randint(0, size, (), generator=gen))
                index.append(slice(start, int(torch.randint(start + 1, size + 1, (), generator=gen))))
            assert torch.equal(checkpoint.read(name, tuple(index)), full[tuple(index)]), (name, index)
    gate_up = "model.layers.2.mlp.experts.gate_up_proj"  # [E, 2F, H]: rows 60..70 straddle gate and up
    assert torch.equal(checkpoint.read(gate_up, (slice(3, 5), slice(60, 70))), checkpoint[gate_up][3:5, 60:70])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.id)
def test_a_missing_or_misshapen_tensor_is_refused_naming_it_and_its_file(layouts, tmp_path, layout):
    broken = shutil.copytree(layouts[layout.id], tmp_path / "broken")
    victim = _victim(broken, layout)
    file = file_of(broken, victim)
    tensors = load_file(file)
    shape = list(tensors[victim].shape)
    save_file({n: t for n, t in tensors.items() if n != victim}, file)
    with pytest.raises(BaseModelError) as missing:
        load_base_weights(broken)
    assert f"{file}: tensor {victim} is missing" in str(missing.value)

    save_file({**tensors, victim: torch.zeros(shape[0] + 1, *shape[1:])}, file)
    with pytest.raises(BaseModelError) as misshapen:
        load_base_weights(broken)
    assert f"{file}: tensor {victim} is {[shape[0] + 1, *shape[1:]]}, config.json says {shape}" in str(misshapen.value)


def test_unexpected_tensors_unlisted_ones_and_a_missing_shard_are_named(layouts, tmp_path):
    broken = shutil.copytree(layouts["transformers-3-text"], tmp_path / "broken")
    first, second = broken / "model-00001-of-00003.safetensors", broken / "model-00002-of-00003.safetensors"
    save_file({**load_file(first), "model.layers.9.mlp.gate_proj.weight": torch.zeros(2)}, first)
    (broken / "model-00003-of-00003.safetensors").unlink()
    index = json.loads((broken / INDEX_FILE).read_text())
    dropped = next(n for n, f in index["weight_map"].items() if f == second.name)
    del index["weight_map"][dropped]
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(BaseModelError) as err:
        load_base_weights(broken)
    message = str(err.value)
    assert f"{first}: tensor model.layers.9.mlp.gate_proj.weight is not in {INDEX_FILE}" in message
    assert f"{second}: tensor {dropped} is not in {INDEX_FILE}" in message
    assert f"{broken / 'model-00003-of-00003.safetensors'}: missing ({INDEX_FILE} lists it)" in message

    stray = shutil.copytree(layouts["released-1-text"], tmp_path / "stray")
    weights = load_file(stray / "model.safetensors")
    save_file({**weights, "model.llm.layers.0.attn.extra.weight": torch.zeros(2)}, stray / "model.safetensors")
    with pytest.raises(BaseModelError, match=r"model.safetensors: unexpected tensor model.llm.layers.0.attn.extra"):
        load_base_weights(stray)


def test_config_problems_are_named(layouts, tmp_path):
    broken = shutil.copytree(layouts["released-1-multimodal"], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    del config["text_config"]["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(BaseModelError, match="config.json: the text_config lacks hidden_size"):
        load_base_config(broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "inkling_mm_model"}))
    with pytest.raises(BaseModelError, match="without a text_config"):
        load_base_config(broken)


def test_transformers_reads_the_released_shards_as_the_original(layouts, tiny_model_dir):
    """transformers' own conversion mapping is the oracle of the released names: it reads our released shards
    (multimodal config, towers and all) back into exactly the original tensors."""
    model = InklingForConditionalGeneration.from_pretrained(layouts["released-3-multimodal"])
    text = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()}
    original = load_base_weights(tiny_model_dir)
    assert {k for k in text if "_tower." not in k} == set(original)
    for name, tensor in original.items():
        assert torch.equal(text[name], tensor), name
    assert torch.equal(text["model.audio_tower.norm.weight"], torch.ones(128))  # the tower was read, not ours


def test_released_w13_alternates_gate_and_up_rows():
    gate, up = torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([[10.0], [11.0], [12.0]])
    weights = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up}
    released = ReleasedWeights(weights)
    assert list(released) == ["model.llm.layers.0.mlp.w13_dn.weight"]
    assert released["model.llm.layers.0.mlp.w13_dn.weight"].flatten().tolist() == [0.0, 10.0, 1.0, 11.0, 2.0, 12.0]


def test_add_base_model_registers_a_release_and_refuses_a_broken_one(layouts, tmp_path):
    runner = CliRunner()
    model_dir = layouts["released-3-multimodal"]
    ok = runner.invoke(cli.app, ["admin", "add-base-model", "inkling-x", str(model_dir), "--data-dir", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "the vision and audio towers are ignored" in ok.output and "registered base model inkling-x" in ok.output

    broken = shutil.copytree(model_dir, tmp_path / "broken")
    file = broken / "model-00002-of-00003.safetensors"
    tensors = load_file(file)
    victim = next(iter(tensors))
    save_file({n: t for n, t in tensors.items() if n != victim}, file)
    bad = runner.invoke(cli.app, ["admin", "add-base-model", "inkling-y", str(broken), "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and f"{file}: tensor {victim} is missing" in bad.output, bad.output
    listed = runner.invoke(
        cli.app, ["admin", "add-base-model", "inkling-y", str(tmp_path), "--data-dir", str(tmp_path)]
    )
    assert listed.exit_code == 2 and "config.json: missing" in listed.output
