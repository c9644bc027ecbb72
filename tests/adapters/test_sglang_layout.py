"""The sglang layout against SGLang 0.5.23's own LoRA loader and Inkling shared-sink LoRA code.

The expected normalized tensors are built here from the canonical factors, straight from what
SGLang's code does (concatenate q, k, v, r; stack gate and up; shared outer factors with expert
dim 1), never from the layout module's own helpers.
"""

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.layouts.sglang import SglangLayoutError, from_sglang, sglang_config, to_sglang
from inkwell.adapters.spec import TARGET_GROUPS, LoraSpec
from inkwell.models import base_model_identity, load_base_config, preset_config
from inkwell.models.presets import PRESETS
from tests.sglang_import import sglang_fixture

ALL = LoraSpec(rank=8, alpha=16, targets=TARGET_GROUPS)


sgl = sglang_fixture(
    "LoadConfig LoRAAdapter LoRAConfig normalize_targets Sink", "SGLang's LoRA loader and Inkling LoRA layers."
)


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> InklingTextConfig:
    return load_base_config(tiny_model_dir)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, config) -> Adapter:
    return init_adapter(config, ALL, base_model_identity(tiny_model_dir), seed=1, b_std=0.02)


def sglang_load(sgl, tensors: dict, adapter_config: dict, config: InklingTextConfig):
    base_cfg = SimpleNamespace(
        architectures=["InklingForConditionalGeneration"],
        model_type="inkling_mm_model",
        n_shared_experts=config.n_shared_experts,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
    )
    lora = sgl.LoRAAdapter("t", sgl.LoRAConfig.from_dict(adapter_config), base_cfg, sgl.LoadConfig(), lora_backend=None)
    lora.initialize_weights_from_tensors(dict(tensors))
    return lora


def expected_normalized(adapter: Adapter, config: InklingTextConfig) -> tuple[list[dict], dict]:
    """Per layer, the names and tensors SGLang's normalization must produce from our factors."""
    t = adapter.tensors
    layers: list[dict] = []
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}", f"language_model.layers.{i}"
        w: dict[str, torch.Tensor] = {}
        if "attn" in adapter.spec.targets:
            qkvr = [f"{src}.self_attn.{p}_proj" for p in "qkvr"]
            w[f"{dst}.attn.qkvr.lora_A.weight"] = torch.cat([t[f"{m}.lora_A"] for m in qkvr])
            w[f"{dst}.attn.qkvr.lora_B.weight"] = torch.cat([t[f"{m}.lora_B"] for m in qkvr])
            w[f"{dst}.attn.wo_ud.lora_A.weight"] = t[f"{src}.self_attn.o_proj.lora_A"]
            w[f"{dst}.attn.wo_ud.lora_B.weight"] = t[f"{src}.self_attn.o_proj.lora_B"]
        if config.mlp_layer_types[i] == "dense":
            if "mlp" in adapter.spec.targets:
                m = f"{src}.mlp"
                w[f"{dst}.mlp.gate_up_proj.lora_A.weight"] = torch.cat(
                    [t[f"{m}.gate_proj.lora_A"], t[f"{m}.up_proj.lora_A"]]
                )
                w[f"{dst}.mlp.gate_up_proj.lora_B.weight"] = torch.cat(
                    [t[f"{m}.gate_proj.lora_B"], t[f"{m}.up_proj.lora_B"]]
                )
                w[f"{dst}.mlp.down_proj.lora_A.weight"] = t[f"{m}.down_proj.lora_A"]
                w[f"{dst}.mlp.down_proj.lora_B.weight"] = t[f"{m}.down_proj.lora_B"]
        else:
            for group in ("experts", "shared_experts"):
                if group not in adapter.spec.targets:
                    continue
                m, d = f"{src}.mlp.{group}", f"{dst}.mlp.{group}"
                gate_a, up_a = t[f"{m}.gate_proj.lora_A"], t[f"{m}.up_proj.lora_A"]
                w[f"{d}.gate_up_proj.lora_A.weight"] = torch.cat([gate_a, up_a]).unsqueeze(0)
                w[f"{d}.gate_up_proj.lora_B.weight"] = torch.cat(
                    [t[f"{m}.gate_proj.lora_B"], t[f"{m}.up_proj.lora_B"]], 1
                )
                w[f"{d}.down_proj.lora_A.weight"] = t[f"{m}.down_proj.lora_A"]
                w[f"{d}.down_proj.lora_B.weight"] = t[f"{m}.down_proj.lora_B"].unsqueeze(0)
        layers.append(w)
    head = {}
    if "lm_head" in adapter.spec.targets:
        head = {f"language_model.lm_head.lora_{f}.weight": t[f"lm_head.lora_{f}"] for f in "AB"}
    return layers, head


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)  # SGLang drops unknown names silently: compare name sets
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def test_sglang_loader_normalizes_every_tensor(sgl, adapter, config):
    tensors, cfg = to_sglang(adapter, config)
    lora = sglang_load(sgl, tensors, cfg, config)
    assert lora.scaling == 16 / 8
    layers, head = expected_normalized(adapter, config)
    for i, layer in enumerate(lora.layers):
        assert_same_tensors(layer.weights, layers[i])
    assert_same_tensors(lora.embedding_layers, head)

    # The shapes SGLang's pool buffers and Inkling modules take (slot dim dropped), from the config.
    r, h, f = 8, config.hidden_size, config.moe_intermediate_size
    e, s = config.n_routed_experts, config.n_shared_experts
    for i, layer in enumerate(lora.layers):
        w, p = layer.weights, f"language_model.layers.{i}"
        local = config.layer_types[i] == "hybrid_sliding"
        heads = config.swa_num_attention_heads if local else config.num_attention_heads
        kv = config.swa_num_key_value_heads if local else config.num_key_value_heads
        hd = config.swa_head_dim if local else config.head_dim
        assert w[f"{p}.attn.qkvr.lora_A.weight"].shape == (4 * r, h)
        assert w[f"{p}.attn.qkvr.lora_B.weight"].shape == (heads * hd + 2 * kv * hd + heads * config.d_rel, r)
        if config.mlp_layer_types[i] == "dense":
            assert w[f"{p}.mlp.gate_up_proj.lora_B.weight"].shape == (2 * config.intermediate_size, r)
            continue
        for group, n in (("experts", e), ("shared_experts", s)):
            assert w[f"{p}.mlp.{group}.gate_up_proj.lora_A.weight"].shape == (1, 2 * r, h)
            assert w[f"{p}.mlp.{group}.gate_up_proj.lora_B.weight"].shape == (n, 2 * f, r)
            assert w[f"{p}.mlp.{group}.down_proj.lora_A.weight"].shape == (n, r, f)
            assert w[f"{p}.mlp.{group}.down_proj.lora_B.weight"].shape == (1, h, r)


def test_shared_sink_lora_applies_our_shared_expert_deltas(sgl, adapter, config):
    """SGLang's Inkling shared-sink LoRA layer accepts the pool buffers and yields B_j A per expert."""
    tensors, cfg = to_sglang(adapter, config)
    lora = sglang_load(sgl, tensors, cfg, config)
    s, f, h = config.n_shared_experts, config.moe_intermediate_size, config.hidden_size
    checked = 0
    for i, layer in enumerate(lora.layers):
        if config.mlp_layer_types[i] == "dense":
            continue
        w, p = layer.weights, f"language_model.layers.{i}.mlp.shared_experts"
        sink = sgl.Sink.__new__(sgl.Sink)
        torch.nn.Module.__init__(sink)
        sink.n_shared_experts, sink._w1_delta, sink._a_cat = s, None, None
        sink.set_lora_info(  # pool buffers: one slot in front
            w[f"{p}.gate_up_proj.lora_A.weight"][None],
            w[f"{p}.gate_up_proj.lora_B.weight"][None],
            w[f"{p}.down_proj.lora_A.weight"][None],
            w[f"{p}.down_proj.lora_B.weight"][None],
        )
        assert sink.experts_shared_outer_loras
        w13 = (sink._w1_delta[0] @ sink.gate_up_lora_a_weights[0, 0]).view(s, f, 2, h)  # interleaved gate/up rows
        w2 = (sink.down_lora_b_weights[0, 0] @ sink._a_cat[0]).view(h, s, f)
        m = f"model.layers.{i}.mlp.shared_experts"
        t = adapter.tensors
        for j in range(s):
            torch.testing.assert_close(w13[j, :, 0], t[f"{m}.gate_proj.lora_B"][j] @ t[f"{m}.gate_proj.lora_A"])
            torch.testing.assert_close(w13[j, :, 1], t[f"{m}.up_proj.lora_B"][j] @ t[f"{m}.up_proj.lora_A"])
            torch.testing.assert_close(w2[:, j], t[f"{m}.down_proj.lora_B"] @ t[f"{m}.down_proj.lora_A"][j])
        checked += 1
    assert checked == config.mlp_layer_types.count("sparse")


def test_target_modules_are_sglang_inkling_lora_modules(sgl, adapter, config):
    origin = Path(importlib.util.find_spec("sglang").origin).parent / "srt/models/inkling.py"
    cls = next(
        n for n in ast.parse(origin.read_text()).body if getattr(n, "name", "") == "InklingForConditionalGeneration"
    )
    supported = next(
        ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.Assign) and n.targets[0].id == "supported_lora_modules"
    )
    _, cfg = to_sglang(adapter, config)
    assert sgl.normalize_targets(cfg["target_modules"]) <= set(supported)
    assert set(cfg["target_modules"]) == {"qkvr", "wo_ud", "gate_up_proj", "down_proj", "lm_head"}
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert cfg["inkwell"]["layout"] == "sglang" and cfg["inkwell"]["format_version"] == 1
    assert cfg["inkwell"]["base"] == adapter.base.to_dict()

    attn_only = Adapter(LoraSpec(rank=8, targets=["attn", "lm_head"]), {}, adapter.base)
    assert set(sglang_config(attn_only)["target_modules"]) == {"qkvr", "wo_ud", "lm_head"}


def test_subset_of_targets_loads_only_those(sgl, tiny_model_dir, config):
    spec = LoraSpec(rank=4, alpha=8, targets=["experts", "lm_head"])
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=2, b_std=0.02)
    tensors, cfg = to_sglang(adapter, config)
    lora = sglang_load(sgl, tensors, cfg, config)
    layers, head = expected_normalized(adapter, config)
    for i, layer in enumerate(lora.layers):
        assert_same_tensors(layer.weights, layers[i])
    assert_same_tensors(lora.embedding_layers, head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(adapter, config, dtype, tmp_path):
    cast = Adapter(adapter.spec, {k: v.to(dtype) for k, v in adapter.tensors.items()}, adapter.base)
    tensors, cfg = to_sglang(cast, config)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    spec, back = from_sglang(load_file(tmp_path / "adapter_model.safetensors"), cfg, config)
    assert spec == cast.spec
    assert sorted(back) == sorted(cast.tensors)
    for name, tensor in cast.tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name


def _scaled_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return scaling * (b.double() @ a.double())


def test_mixed_ranks_pad_to_max_and_fold_scaling_into_b(sgl, tiny_model_dir, config):
    spec = LoraSpec(rank=8, alpha=16, targets=TARGET_GROUPS, ranks={"attn": 4, "lm_head": 2})
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=3, b_std=0.02)
    tensors, cfg = to_sglang(adapter, config)
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16
    lora = sglang_load(sgl, tensors, cfg, config)
    t = adapter.tensors
    qkvr_a = lora.layers[0].weights["language_model.layers.0.attn.qkvr.lora_A.weight"]
    qkvr_b = lora.layers[0].weights["language_model.layers.0.attn.qkvr.lora_B.weight"]
    q_rows = t["model.layers.0.self_attn.q_proj.lora_B"].shape[0]
    assert qkvr_a.shape[0] == 4 * 8
    assert not qkvr_a[4:8].any() and not qkvr_b[:, 4:].any()  # zero padding of the rank-4 group
    torch.testing.assert_close(  # SGLang's alpha / 8 on the padded factors == the group's alpha / 4
        _scaled_delta(qkvr_a[:8], qkvr_b[:q_rows], lora.scaling),
        _scaled_delta(t["model.layers.0.self_attn.q_proj.lora_A"], t["model.layers.0.self_attn.q_proj.lora_B"], 4.0),
    )
    head_a = lora.embedding_layers["language_model.lm_head.lora_A.weight"]
    head_b = lora.embedding_layers["language_model.lm_head.lora_B.weight"]
    torch.testing.assert_close(
        _scaled_delta(head_a, head_b, lora.scaling), _scaled_delta(t["lm_head.lora_A"], t["lm_head.lora_B"], 8.0)
    )
    # Rank-8 groups are untouched.
    assert torch.equal(
        tensors["language_model.layers.1.mlp.experts.w2.lora_A.weight"],
        t["model.layers.1.mlp.experts.down_proj.lora_A"],
    )

    spec_back, back = from_sglang(tensors, cfg, config)  # power-of-two ratios: bit-exact
    assert spec_back == spec
    assert all(torch.equal(back[k], v) for k, v in t.items())


def test_mixed_ranks_other_ratio_round_trips_within_one_rounding(tiny_model_dir, config):
    spec = LoraSpec(rank=8, alpha=16, targets=["attn", "mlp"], ranks={"attn": 6})
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), seed=4, b_std=0.02)
    _, back = from_sglang(*to_sglang(adapter, config), config)
    for name, tensor in adapter.tensors.items():
        if name.endswith("lora_A") or ".mlp." in name:
            assert torch.equal(back[name], tensor), name
        else:
            torch.testing.assert_close(back[name], tensor, rtol=3e-7, atol=0)


def test_from_sglang_names_what_is_wrong(adapter, config):
    tensors, cfg = to_sglang(adapter, config)
    name = "language_model.layers.2.mlp.experts.w1.lora_B.weight"

    missing = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(SglangLayoutError, match=r"missing 1 tensor.*experts\.w1\.lora_B"):
        from_sglang(missing, cfg, config)

    extra = dict(tensors, **{"language_model.embed_tokens.lora_A.weight": torch.zeros(8, 4)})
    with pytest.raises(SglangLayoutError, match="does not target: language_model.embed_tokens"):
        from_sglang(extra, cfg, config)

    wrong = dict(tensors, **{name: tensors[name][:, :, :4]})
    with pytest.raises(
        SglangLayoutError, match=r"wrong shape.*w1\.lora_B\.weight \(8, 64, 4\) \(expected \(8, 64, 8\)\)"
    ):
        from_sglang(wrong, cfg, config)

    with pytest.raises(SglangLayoutError, match="layout is 'peft'"):
        from_sglang(tensors, dict(cfg, inkwell=dict(cfg["inkwell"], layout="peft")), config)
    with pytest.raises(SglangLayoutError, match="format_version 2"):
        from_sglang(tensors, dict(cfg, inkwell=dict(cfg["inkwell"], format_version=2)), config)
    with pytest.raises(SglangLayoutError, match="r=16.*disagree"):
        from_sglang(tensors, dict(cfg, r=16), config)
    with pytest.raises(SglangLayoutError, match="'inkwell' is not a mapping with a 'spec'"):
        from_sglang(tensors, dict(cfg, inkwell="sglang"), config)
    with pytest.raises(SglangLayoutError, match="DoRA"):
        from_sglang(tensors, dict(cfg, use_dora=True), config)
    with pytest.raises(SglangLayoutError, match="peft_type is 'IA3'"):
        from_sglang(tensors, dict(cfg, peft_type="IA3"), config)


def test_from_sglang_rejects_nonzero_rank_padding(tiny_model_dir, config):
    spec = LoraSpec(rank=8, alpha=16, targets=["attn", "lm_head"], ranks={"attn": 4})
    adapter = init_adapter(config, spec, base_model_identity(tiny_model_dir), b_std=0.02)
    tensors, cfg = to_sglang(adapter, config)
    name = "language_model.layers.1.attn.wo_ud.lora_A.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][6, 0] = 1.0
    with pytest.raises(SglangLayoutError, match=r"wo_ud: its group has rank 4 but the padding"):
        from_sglang(tensors, cfg, config)


def test_to_sglang_rejects_mismatched_adapter_and_unservable_base(adapter, config):
    partial = Adapter(adapter.spec, {k: v for k, v in adapter.tensors.items() if "layers.3." not in k}, adapter.base)
    with pytest.raises(SglangLayoutError, match=r"adapter does not match its spec.*missing \d+ tensor"):
        to_sglang(partial, config)

    kwargs = dict(PRESETS["inkling-tiny"], mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    odd = InklingTextConfig(**kwargs)
    assert preset_config("inkling-tiny").mlp_layer_types != odd.mlp_layer_types
    mlp_adapter = init_adapter(odd, LoraSpec(rank=4, targets=["attn", "mlp"]), adapter.base)
    with pytest.raises(SglangLayoutError, match=r"layers \[2\] have dense MLPs after the first MoE layer \(1\)"):
        to_sglang(mlp_adapter, odd)
    attn_adapter = init_adapter(odd, LoraSpec(rank=4, targets=["attn"]), adapter.base)
    assert len(to_sglang(attn_adapter, odd)[0]) == 4 * 5 * 2


# Adapters written by other tools (no `inkwell` metadata): any form SGLang's Inkling loader takes.


def _attn_dims(config: InklingTextConfig, layer: int) -> dict[str, tuple[int, int]]:
    local = config.layer_types[layer] == "hybrid_sliding"
    heads = config.swa_num_attention_heads if local else config.num_attention_heads
    kv = config.swa_num_key_value_heads if local else config.num_key_value_heads
    hd = config.swa_head_dim if local else config.head_dim
    h = config.hidden_size
    return {
        "wq_du": (h, heads * hd),
        "wk_dv": (h, kv * hd),
        "wv_dv": (h, kv * hd),
        "wr_du": (h, heads * config.d_rel),
    } | {"wo_ud": (heads * hd, h)}


def release_style(config: InklingTextConfig, rank: int = 4) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as the Inkling HF-format LoRA release (fused dense gate_up, one A)."""
    gen = torch.Generator().manual_seed(5)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.05

    h, f, e, s = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, config.n_shared_experts
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        p = f"language_model.layers.{i}"
        for proj, (fan_in, fan_out) in _attn_dims(config, i).items():
            out[f"{p}.attn.{proj}.lora_A.weight"], out[f"{p}.attn.{proj}.lora_B.weight"] = (
                rnd(rank, fan_in),
                rnd(fan_out, rank),
            )
        if config.mlp_layer_types[i] == "dense":
            fd = config.intermediate_size
            out[f"{p}.mlp.gate_up_proj.lora_A.weight"], out[f"{p}.mlp.gate_up_proj.lora_B.weight"] = (
                rnd(rank, h),
                rnd(2 * fd, rank),
            )
            out[f"{p}.mlp.down_proj.lora_A.weight"], out[f"{p}.mlp.down_proj.lora_B.weight"] = (
                rnd(rank, fd),
                rnd(h, rank),
            )
            continue
        for w in ("w1", "w3"):
            out[f"{p}.mlp.experts.{w}.lora_A.weight"], out[f"{p}.mlp.experts.{w}.lora_B.weight"] = (
                rnd(1, rank, h),
                rnd(e, f, rank),
            )
            out[f"{p}.mlp.shared_experts.{w}.lora_A.weight"] = rnd(rank, h)
            out[f"{p}.mlp.shared_experts.{w}.lora_B.weight"] = rnd(s * f, rank)
        out[f"{p}.mlp.experts.w2.lora_A.weight"], out[f"{p}.mlp.experts.w2.lora_B.weight"] = (
            rnd(e, rank, f),
            rnd(1, h, rank),
        )
        out[f"{p}.mlp.shared_experts.w2.lora_A.weight"], out[f"{p}.mlp.shared_experts.w2.lora_B.weight"] = (
            rnd(rank, s * f),
            rnd(h, rank),
        )
    out["language_model.lm_head.lora_A.weight"], out["language_model.lm_head.lora_B.weight"] = (
        rnd(rank, h),
        rnd(config.vocab_size, rank),
    )
    return out


FOREIGN_CONFIG = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["qkvr", "wo_ud", "gate_up_proj", "down_proj", "lm_head"],
}


def sglang_view(lora) -> dict[str, torch.Tensor]:
    """SGLang's normalized tensors by name from `layers.<i>.` / `lm_head.` on (prefixes differ between tools)."""
    named = {n: t for layer in lora.layers for n, t in layer.weights.items()} | lora.embedding_layers
    return {n[n.index("layers.") if "layers." in n else n.index("lm_head.") :]: t for n, t in named.items()}


def assert_sglang_sees_the_same(sgl, theirs: dict, their_cfg: dict, config, base) -> Adapter:
    """Import `theirs`, re-export it, and require SGLang to normalize both to identical tensors."""
    spec, canonical = from_sglang(theirs, their_cfg, config)
    ours = Adapter(spec, canonical, base)
    a = sglang_view(sglang_load(sgl, theirs, their_cfg, config))
    b = sglang_view(sglang_load(sgl, *to_sglang(ours, config), config))
    assert_same_tensors(b, a)
    return ours


def test_release_style_adapter_imports_as_sglang_sees_it(sgl, adapter, config, tmp_path):
    theirs = release_style(config)
    ours = assert_sglang_sees_the_same(sgl, theirs, FOREIGN_CONFIG, config, adapter.base)
    assert ours.spec == LoraSpec(rank=4, alpha=8, targets=TARGET_GROUPS)
    t = ours.tensors  # the fused dense gate_up shares one A between gate and up
    assert torch.equal(t["model.layers.0.mlp.gate_proj.lora_A"], t["model.layers.0.mlp.up_proj.lora_A"])
    save_file(t, tmp_path / "canonical.safetensors")  # no two tensors share storage


def test_other_sglang_forms_import_as_sglang_sees_them(sgl, adapter, config):
    theirs = {}
    for name, tensor in release_style(config).items():
        theirs["base_model.model.model.llm." + name.removeprefix("language_model.")] = tensor
    p = "base_model.model.model.llm.layers"
    # layer 0: q, k, v, r fused into qkvr with one shared A
    b = torch.cat([theirs.pop(f"{p}.0.attn.{x}.lora_B.weight") for x in ("wq_du", "wk_dv", "wv_dv", "wr_du")])
    a = theirs.pop(f"{p}.0.attn.wq_du.lora_A.weight")
    for x in ("wk_dv", "wv_dv", "wr_du"):
        del theirs[f"{p}.0.attn.{x}.lora_A.weight"]
    theirs[f"{p}.0.attn.qkvr.lora_A.weight"], theirs[f"{p}.0.attn.qkvr.lora_B.weight"] = a, b
    # layer 1: routed experts named gate_proj/down_proj, up (w3) absent
    for old, new in (("w1", "gate_proj"), ("w2", "down_proj")):
        for f in "AB":
            theirs[f"{p}.1.mlp.experts.{new}.lora_{f}.weight"] = theirs.pop(f"{p}.1.mlp.experts.{old}.lora_{f}.weight")
    for f in "AB":
        del theirs[f"{p}.1.mlp.experts.w3.lora_{f}.weight"]
    # layer 2: shared experts in the 3-D shared-outer form
    s, q = config.n_shared_experts, f"{p}.2.mlp.shared_experts"
    for w in ("w1", "w3"):
        theirs[f"{q}.{w}.lora_A.weight"] = theirs[f"{q}.{w}.lora_A.weight"][None]
        theirs[f"{q}.{w}.lora_B.weight"] = theirs[f"{q}.{w}.lora_B.weight"].reshape(s, -1, 4)
    theirs[f"{q}.w2.lora_A.weight"] = theirs[f"{q}.w2.lora_A.weight"].reshape(4, s, -1).transpose(0, 1).contiguous()
    theirs[f"{q}.w2.lora_B.weight"] = theirs[f"{q}.w2.lora_B.weight"][None]
    # the head under PEFT's other name
    for f in "AB":
        theirs[f"base_model.model.model.llm.unembed_tokens.lora_{f}.weight"] = theirs.pop(
            f"base_model.model.model.llm.lm_head.lora_{f}.weight"
        )
    ours = assert_sglang_sees_the_same(sgl, theirs, FOREIGN_CONFIG, config, adapter.base)
    assert not ours.tensors["model.layers.1.mlp.experts.up_proj.lora_B"].any()  # absent target: zero factors


def test_our_export_without_metadata_reads_as_foreign(adapter, config):
    tensors, cfg = to_sglang(adapter, config)
    spec, back = from_sglang(tensors, {k: v for k, v in cfg.items() if k != "inkwell"}, config)
    assert spec == LoraSpec(rank=8, alpha=16, targets=TARGET_GROUPS)
    assert sorted(back) == sorted(adapter.tensors)
    assert all(torch.equal(back[k], v) for k, v in adapter.tensors.items())


def test_foreign_adapter_errors_name_the_tensor(config):
    theirs = release_style(config)
    cases = [
        (
            {"language_model.embed_tokens.lora_A.weight": torch.zeros(4, 8)},
            "embed_tokens.lora_A.weight: not an Inkling",
        ),
        (
            {"language_model.layers.1.mlp.gate_up_proj.lora_A.weight": torch.zeros(4, 128)},
            "layer 1 of this base model has no mlp",
        ),
        (
            {"language_model.layers.1.mlp.experts.w1.lora_A.weight": torch.zeros(8, 4, 128)},
            r"per-expert lora_A \(expert dim 8\)",
        ),
        (
            {"language_model.layers.0.mlp.gate_up_proj.lora_B.weight": torch.zeros(500, 4)},
            "500 output rows, expected 512",
        ),
    ]
    for change, message in cases:
        with pytest.raises(SglangLayoutError, match=message):
            from_sglang(dict(theirs, **change), FOREIGN_CONFIG, config)
    half = {k: v for k, v in theirs.items() if k != "language_model.lm_head.lora_B.weight"}
    with pytest.raises(SglangLayoutError, match="lm_head: has only one of lora_A / lora_B"):
        from_sglang(half, FOREIGN_CONFIG, config)
    with pytest.raises(SglangLayoutError, match="not a usable LoRA config"):
        from_sglang({}, FOREIGN_CONFIG, config)
    with pytest.raises(SglangLayoutError, match="needs a valid integer 'r'"):
        from_sglang(theirs, {"peft_type": "LORA", "lora_alpha": 8}, config)
