"""benchmarks/byte_floor.py: the bytes a decode step must read, counted on a CPU engine's tensors against the
checkpoint's tensor list (the engine stacks and renames them), the state's shapes and an adapter's own tensors (the
engine's slots lay them out again)."""

import importlib.util
from pathlib import Path

import pytest

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.spec import TARGET_GROUPS, LoraSpec
from inkwell.models import base_model_identity, load_base_config
from inkwell.models.names import expected_tensors
from inkwell.serving.contract import EngineConfig
from inkwell.serving.native.engine import Engine

spec = importlib.util.spec_from_file_location("byte_floor", Path(__file__).parents[1] / "benchmarks" / "byte_floor.py")
byte_floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(byte_floor)


def test_experts_reached_grows_from_top_k_to_every_expert():
    assert byte_floor.experts_reached(16, 4, 1) == pytest.approx(4.0)
    assert byte_floor.experts_reached(16, 4, 8) == pytest.approx(16 * (1 - 0.75**8))  # 14.4: the floor's batch 8
    assert byte_floor.experts_reached(16, 4, 200) == pytest.approx(16.0)


def test_peak_bandwidth_by_card_name():
    assert byte_floor.peak_bytes_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert byte_floor.peak_bytes_s("NVIDIA H200") == 4.8e12
    assert byte_floor.peak_bytes_s("NVIDIA A100-SXM4-80GB") is None


def test_a_step_reads_its_rows_embeddings_the_experts_reached_and_each_rows_window(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=8, dtype="float32"))
    rows, seen = 3, config.sliding_window_size + 6  # past the window: sliding layers hold only its last positions
    routed = config.n_routed_experts
    reached = byte_floor.experts_reached(routed, config.num_experts_per_tok, rows)
    weights = 0.0
    for name, shape in expected_tensors(config).items():
        if name.startswith("model.mtp."):
            continue
        count = shape.numel()
        if name == "model.embed_tokens.weight":
            count = rows * shape[1]
        elif ".mlp.experts." in name:  # routed [E, ...]; the shared experts' own tensors are read whole
            count *= reached / routed
        weights += 4 * count
    kv = sum(
        2 * (config.sliding_window_size if kind == "hybrid_sliding" else seen) * heads * dim * 4
        for kind, heads, dim in (
            ("hybrid_sliding", config.swa_num_key_value_heads, config.swa_head_dim),
            ("hybrid", config.num_key_value_heads, config.head_dim),
        )
        for _ in range(config.layer_types.count(kind))
    )
    width = 2 * config.num_key_value_heads * config.head_dim + 2 * config.hidden_size  # the KV, ATTN and MLP sites
    conv = config.num_hidden_layers * width * (config.conv_kernel_size - 1) * 4
    got = byte_floor.decode_step_bytes(engine, seen, [None] * rows)
    assert got["weights"] == pytest.approx(weights)
    assert got["state"] == pytest.approx(rows * (kv + conv))
    assert got["adapters"] == 0


def test_each_adapter_is_read_once_with_the_routed_experts_its_rows_reach(tiny_model_dir):
    config = load_base_config(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(max_lora_rank=8, dtype="float32"))
    adapter = init_adapter(config, LoraSpec(rank=8, targets=TARGET_GROUPS), base_model_identity(tiny_model_dir))
    routed, top_k = config.n_routed_experts, config.num_experts_per_tok

    def slot_bytes(rows: int) -> float:  # gate/up B and down A of the routed experts are [E, ...]: per expert
        reached = byte_floor.experts_reached(routed, top_k, rows)
        return sum(
            4 * t.numel() * (reached / routed if ".mlp.experts." in name and t.dim() == 3 else 1.0)
            for name, t in adapter.tensors.items()
        )

    got = byte_floor.decode_step_bytes(engine, 40, ["a", "b", "a", None, "a"])
    assert got["adapters"] == pytest.approx(slot_bytes(3) + slot_bytes(1))
    assert slot_bytes(3) > slot_bytes(1)  # the rows of "a" reach more experts than the row of "b"
