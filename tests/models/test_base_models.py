import json
import subprocess
import sys

import pytest
import torch
from transformers import InklingForCausalLM
from typer.testing import CliRunner

from inkwell import cli
from inkwell.models import (
    BaseModelError,
    init_base_model,
    installed_weight_names,
    load_base_config,
    load_base_model,
    load_base_weights,
    load_tokenizer,
    preset_config,
)
from inkwell.models.shards import WEIGHTS_FILE


def test_tiny_preset_has_every_inkling_feature_under_10m_parameters(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    assert {"hybrid", "hybrid_sliding"} == set(config.layer_types)
    assert config.mlp_layer_types[0] == "dense" and "sparse" in config.mlp_layer_types[1:]
    assert config.n_routed_experts > config.num_experts_per_tok and config.n_shared_experts == 2
    assert config.shared_expert_sink and config.log_scaling_n_floor and config.d_rel > 0
    model = load_base_model(tiny_model_dir)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000


def test_small_preset_matches_the_benchmarked_configuration():
    c = preset_config("inkling-small")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 16, 4)
    assert (c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok) == (16, 512, 4)
    assert (c.intermediate_size, c.vocab_size, c.sliding_window_size, c.rel_extent) == (5632, 32000, 512, 1024)
    with torch.device("meta"):
        n = sum(p.numel() for p in InklingForCausalLM(c).parameters())
    assert 1.15e9 < n < 1.25e9


def test_init_is_deterministic_and_transformers_loads_it(tiny_model_dir, tmp_path):
    again = init_base_model("inkling-tiny", tmp_path / "again", seed=0)
    other = init_base_model("inkling-tiny", tmp_path / "other", seed=1)
    same = (tiny_model_dir / WEIGHTS_FILE).read_bytes() == (again / WEIGHTS_FILE).read_bytes()
    assert same and (other / WEIGHTS_FILE).read_bytes() != (again / WEIGHTS_FILE).read_bytes()
    ours = load_base_model(tiny_model_dir)
    theirs = InklingForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, 263, (1, 40))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    tok = load_tokenizer(tiny_model_dir)
    assert tok.decode(tok.encode("héllo, wörld", add_special_tokens=False)) == "héllo, wörld"


def test_cli_models_init_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "inkwell.cli", "models", "init", "inkling-tiny", str(out), "--seed", "3"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    assert load_base_config(out).hidden_size == 128
    bad = subprocess.run([*cmd[:5], "inkling-huge", str(tmp_path / "x")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "unknown preset" in bad.stdout
    weights = (out / WEIGHTS_FILE).read_bytes()
    again = CliRunner().invoke(cli.app, ["models", "init", "inkling-tiny", str(out), "--seed", "4"])
    assert again.exit_code == 2 and "--overwrite" in again.output and (out / WEIGHTS_FILE).read_bytes() == weights
    replaced = CliRunner().invoke(cli.app, ["models", "init", "inkling-tiny", str(out), "--seed", "4", "--overwrite"])
    assert replaced.exit_code == 0 and (out / WEIGHTS_FILE).read_bytes() != weights
    onto_a_file = CliRunner().invoke(cli.app, ["models", "init", "inkling-tiny", str(out / "config.json")])
    assert onto_a_file.exit_code == 2 and "is a file; give a directory" in onto_a_file.output, onto_a_file.output


def test_missing_corrupt_or_foreign_checkpoints_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(BaseModelError, match="config.json: missing"):
        load_base_config(tmp_path)
    broken = init_base_model("inkling-tiny", tmp_path / "broken", seed=0)
    data = (broken / WEIGHTS_FILE).read_bytes()
    (broken / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(BaseModelError, match="corrupt safetensors"):
        load_base_model(broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BaseModelError, match="not 'inkling_text'"):
        load_base_config(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(BaseModelError, match="not valid JSON"):
        load_base_config(broken)


def test_a_transformers_5_17_checkpoint_loads_under_the_current_names(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    old = init_base_model("inkling-tiny", tmp_path / "old", seed=0)
    state = load_file(str(old / WEIGHTS_FILE))
    state["model.embed_norm.weight"] = state.pop("model.embed_tokens.embed_norm.weight")
    save_file(state, str(old / WEIGHTS_FILE))
    ids = torch.randint(0, 263, (1, 20))
    with torch.no_grad():
        assert torch.equal(load_base_model(old)(ids).logits, load_base_model(tiny_model_dir)(ids).logits)


def test_weights_go_back_under_the_installed_transformers_names(tiny_model_dir):
    """Under transformers 5.17 (which calls the embedding norm `model.embed_norm`) the canonical names are
    mapped back; under the installed version they are what its model expects."""
    weights = load_base_weights(tiny_model_dir)
    installed = InklingForCausalLM(load_base_config(tiny_model_dir))
    assert installed_weight_names(weights, installed).keys() == installed.state_dict().keys()

    older = torch.nn.Module()  # the one name 5.17 spells differently, as a module tree
    older.model = torch.nn.Module()
    older.model.embed_norm = torch.nn.Module()
    older.model.embed_norm.weight = torch.nn.Parameter(torch.ones(1))
    mapped = installed_weight_names(weights, older)
    assert "model.embed_norm.weight" in mapped and "model.embed_tokens.embed_norm.weight" not in mapped
    assert len(mapped) == len(weights)
