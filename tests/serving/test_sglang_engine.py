"""The `sglang` engine: its mappings to SGLang 0.5.23 on the CPU, and SGLang itself where it can run.

On a CPU host the pure pieces are checked against SGLang's own code (ServerArgs, SamplingParams,
its target-module normalization and Inkling config) and against the native engine (the token
by token stream logic replays the native engine's outputs); the converted checkpoint is read back
by transformers. The end-to-end test needs a CUDA device and an SGLang install that imports.
"""

import importlib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import InklingConfig, InklingForConditionalGeneration

from inkwell.adapters.layouts.sglang import to_sglang
from inkwell.models import load_base_config, load_base_weights, load_tokenizer, stop_token_ids
from inkwell.models.released import released_config
from inkwell.serving.contract import ENGINES, Choice, EngineConfig, Request, SamplingParams, make_engine
from inkwell.serving.native.engine import Engine
from inkwell.serving.rules import Finisher
from inkwell.serving.sglang.checkpoint import write_sglang_checkpoint
from inkwell.serving.sglang.engine import (
    INSTALL_HINT,
    ChoiceStream,
    SglangEngine,
    SglangUnavailableError,
    import_sglang_engine,
    server_args,
    sglang_sampling_params,
)
from tests.sglang_import import sglang_fixture

PROMPT = list(range(10, 40))


sgl = sglang_fixture(
    "ServerArgs SamplingParams normalize_targets InklingMMConfig",
    "SGLang's pure-Python pieces: server arguments, sampling parameters, target names, Inkling's config.",
)


# ---- registry and the missing extra ----------------------------------------------------------


def test_engines_entry_resolves_without_importing_sglang():
    module, _, name = ENGINES["sglang"].partition(":")
    code = f"import sys; import {module} as m; assert m.{name}.__name__ == {name!r}; print('sglang' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # the extra is imported only when an engine starts
    assert getattr(importlib.import_module(module), name) is SglangEngine


def test_missing_sglang_error_names_the_extra(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", None)  # any import of it now fails
    with pytest.raises(SglangUnavailableError) as info:
        make_engine("sglang", tiny_model_dir, EngineConfig(device="cuda", dtype="bfloat16"))
    assert INSTALL_HINT in str(info.value) and "inkwell[sglang]" in INSTALL_HINT
    assert isinstance(info.value, ImportError)


# ---- server args, sampling params, adapters --------------------------------------------------


def test_server_args_are_sglang_server_args_and_cover_every_adapter(sgl, tiny_model_dir, tiny_adapters):
    config = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, max_seqs=8, dtype="bfloat16", device="cuda:1")
    kwargs = server_args("/models/x", config, 512)
    args = sgl.ServerArgs(**kwargs)  # unknown keyword arguments raise TypeError
    assert (args.enable_lora, args.max_lora_rank, args.max_loras_per_batch) == (True, 16, 3)
    assert (args.base_gpu_id, args.context_length, args.max_running_requests) == (1, 512, 8)
    assert args.experts_shared_outer_loras and args.skip_tokenizer_init
    served = sgl.normalize_targets(kwargs["lora_target_modules"])
    base = load_base_config(tiny_model_dir)
    for adapter in tiny_adapters:  # SGLang refuses an adapter whose modules the server did not enable
        _, adapter_config = to_sglang(adapter, base)
        assert sgl.normalize_targets(adapter_config["target_modules"]) <= served
    attn_only = server_args("/m", EngineConfig(lora_groups=("attn",), device="cuda"), 512)["lora_target_modules"]
    assert attn_only == ["qkvr", "wo_ud"]
    with pytest.raises(ValueError, match="CUDA"):
        server_args("/m", EngineConfig(device="cpu"), 512)


def test_sampling_params_map_to_sglang(sgl, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)

    def mapped(params: SamplingParams, index: int = 0) -> dict:  # a 10-token prompt, a context of 100, EOS 2 and 3
        return sglang_sampling_params(params, index, Finisher(tokenizer, params, 10, (2, 3), 100))

    greedy = mapped(SamplingParams(max_tokens=5, temperature=0.0))
    assert greedy["max_new_tokens"] == 5 and greedy["stop_token_ids"] == [2, 3] and greedy["sampling_seed"] is None
    parsed = sgl.SamplingParams(**greedy)
    parsed.verify(384)
    assert parsed.top_k == 1  # SGLang's greedy decoding

    params = SamplingParams(max_tokens=None, temperature=0.7, top_p=0.9, seed=5, n=2, stop_token_ids=(7,))
    first, second = (mapped(params, i) for i in (0, 1))
    assert first["max_new_tokens"] == 90  # the rest of the context
    assert first["stop_token_ids"] == [2, 3, 7] and not first["ignore_eos"]
    assert (first["temperature"], first["top_p"]) == (0.7, 0.9)
    assert first["sampling_seed"] != second["sampling_seed"]
    sgl.SamplingParams(**first).verify(384)

    no_eos = mapped(SamplingParams(ignore_eos=True, stop_token_ids=(7,)))
    assert no_eos["stop_token_ids"] == [7] and no_eos["ignore_eos"]
    assert mapped(SamplingParams(ignore_eos=True))["stop_token_ids"] is None


# ---- the released-format checkpoint SGLang loads ----------------------------------------------


def test_checkpoint_reads_back_in_transformers_and_sglang(sgl, tiny_model_dir, tmp_path):
    out = write_sglang_checkpoint(tiny_model_dir, tmp_path / "sglang")
    ours = load_base_config(tiny_model_dir)
    # transformers' conversion mapping reads the released names back into exactly our tensors
    small_towers = dict(
        vision_config=dict(patch_size=2, temporal_patch_size=2, num_hidden_layers=3),
        audio_config=dict(n_mel_bins=4, mel_vocab_size=4),
    )
    data = json.loads((out / "config.json").read_text())
    config = InklingConfig(**{**data, **small_towers})
    model = InklingForConditionalGeneration.from_pretrained(out, config=config)
    back = {
        k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items() if "_tower." not in k
    }
    weights = load_base_weights(tiny_model_dir)
    assert sorted(back) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(back[name], tensor), name
    read, written = config.text_config.to_dict(), ours.to_dict()
    assert {k: read[k] for k in written if k != "architectures"} == {
        k: v for k, v in written.items() if k != "architectures"
    }

    # SGLang's own config class sees the same geometry under its names
    text = sgl.InklingMMConfig(**data).text_config
    assert text.local_layer_ids == [0, 2] and text.dense_mlp_idx == 1
    assert (text.intermediate_size, text.dense_intermediate_size) == (
        ours.moe_intermediate_size,
        ours.intermediate_size,
    )
    assert (text.swa_head_dim, text.head_dim, text.d_rel, text.rel_extent) == (32, 32, 8, 48)
    assert (text.sconv_kernel_size, text.n_shared_experts, text.padded_vocab_size) == (4, 2, ours.vocab_size)
    assert text.use_sconv and text.use_embed_norm and text.use_global_scale and text.use_gate_bias
    assert text.shared_expert_sink and text.gate_activation == "sigmoid"


def test_dense_layer_after_moe_is_refused():
    config = SimpleNamespace(mlp_layer_types=["dense", "sparse", "dense"])
    with pytest.raises(ValueError, match="dense MLPs only before"):
        released_config(config)


# ---- the stream logic against the native engine ------------------------------------------------


def sglang_chunk(native: Choice, extra: list[int], upto: int, finish: dict | None) -> dict:
    """SGLang's cumulative streaming chunk after `upto` output tokens of native + extra tokens."""
    ids = native.token_ids + extra
    logprobs = [(lp.logprob, lp.token_id, None) for lp in native.logprobs] + [(-1.0, t, None) for t in extra]
    tops = [[(v, t, None) for t, v in lp.top] for lp in native.logprobs] + [[] for _ in extra]
    meta: dict = {"finish_reason": finish, "output_token_logprobs": logprobs[:upto], "output_top_logprobs": tops[:upto]}
    if native.prompt_logprobs is not None:
        meta["input_token_logprobs"] = [(lp, 0, None) for lp in native.prompt_logprobs]
        meta["input_top_logprobs"] = [None] + [[(v, t, None) for t, v in top] for top in native.prompt_top_logprobs[1:]]
    return {"output_ids": ids[:upto], "meta_info": meta}


def replay(side: SimpleNamespace, native: Choice, request: Request, sizes: list[int], extra: list[int], finish=None):
    """Feed SGLang-style chunks of `sizes` tokens to a ChoiceStream until it ends; gather its outputs."""
    finisher = Finisher(side.tokenizer, request.params, len(request.prompt_ids), side.stop_ids, 1024)
    stream = ChoiceStream(request, 0, finisher)
    total, got = len(native.token_ids) + len(extra), Choice()
    upto = 0
    for size in sizes:
        upto = min(upto + size, total)
        stream.latest = sglang_chunk(native, extra, upto, finish if upto == total else None)
        stream.stream_done = finish is not None and upto == total
        out = stream.collect()
        if out is not None:
            got.extend(out)
            if out.finish_reason is not None:
                return got
    raise AssertionError("the stream never ended")


@pytest.fixture(scope="module")
def native(tiny_model_dir) -> SimpleNamespace:
    """The native engine on the CPU, and what a ChoiceStream needs from the model directory."""
    tokenizer = load_tokenizer(tiny_model_dir)
    return SimpleNamespace(
        engine=Engine(tiny_model_dir, EngineConfig(max_lora_rank=16)),
        tokenizer=tokenizer,
        stop_ids=tuple(stop_token_ids(tokenizer)),
    )


def same(a: Choice, b: Choice) -> None:
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert [(x.token_id, x.logprob, x.top) for x in a.logprobs] == [(x.token_id, x.logprob, x.top) for x in b.logprobs]
    assert (a.prompt_logprobs, a.prompt_top_logprobs) == (b.prompt_logprobs, b.prompt_top_logprobs)


@pytest.mark.parametrize("sizes", [[1] * 40, [3] * 20, [40]])
def test_stream_ends_where_the_native_engine_ends(native, sizes):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = native.engine.generate([Request("f", PROMPT, greedy)])["f"][0]
    stop = full.text[3:5]
    beyond = [5, 6, 7]  # SGLang knows no stop strings: it may run past them
    cases = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(full.token_ids[2],), logprobs=0),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(full.token_ids[4],)),
    ]
    for i, params in enumerate(cases):
        request = Request(f"r{i}", PROMPT, params)
        expected = native.engine.generate([request])[request.request_id][0]
        same(replay(native, expected, request, sizes, beyond), expected)


def test_stream_ended_by_sglang_keeps_its_reason_and_flushes_text(native):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    request = Request("a", PROMPT, params)
    full = native.engine.generate([request])["a"][0]
    cut = Choice(token_ids=full.token_ids[:4])
    got = replay(native, cut, request, [2, 2], [], finish={"type": "abort", "message": "x"})
    assert got.token_ids == full.token_ids[:4] and got.finish_reason == "abort"
    assert got.text == native.tokenizer.decode(full.token_ids[:4], skip_special_tokens=True)


def test_scoring_the_prompt_only(native):
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=True, logprobs=1)
    request = Request("s", PROMPT, params)
    expected = native.engine.generate([request])["s"][0]
    got = replay(native, expected, request, [1], [], finish={"type": "length", "length": 0})
    same(got, expected)


# ---- SGLang itself (a CUDA device and an SGLang that imports) -----------------------------------


@pytest.mark.gpu
def test_mixed_batch_equals_the_native_engines_greedy_tokens(tiny_model_dir, tiny_adapters):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        import_sglang_engine()
    except SglangUnavailableError as exc:
        pytest.skip(str(exc))
    config = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, dtype="bfloat16", device="cuda")
    chosen = {"a0": tiny_adapters[0], "a2": tiny_adapters[2]}  # every group at rank 8; experts at rank 16
    sglang = make_engine("sglang", tiny_model_dir, config)
    native_engine = Engine(tiny_model_dir, config)
    try:
        for key, adapter in chosen.items():
            sglang.load_adapter(key, adapter)
            native_engine.load_adapter(key, adapter)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        requests = [Request(f"{k}-{p}", PROMPT[p:], greedy, k) for k in (None, "a0", "a2") for p in (0, 5)]
        expected = native_engine.generate(requests)
        got: dict[str, Choice] = {r.request_id: Choice() for r in requests}
        for request in requests:
            sglang.add_request(request)
        while sglang.has_work():
            for out in sglang.step():
                got[out.request_id].extend(out)
        for request in requests:
            assert got[request.request_id].finish_reason == "length"
            assert got[request.request_id].token_ids == expected[request.request_id][0].token_ids, request.request_id
        for p in (0, 5):  # the adapters really are applied
            assert any(got[f"{k}-{p}"].token_ids != got[f"None-{p}"].token_ids for k in chosen)
        sglang.unload_adapter("a0")
        assert list(sglang.adapters) == ["a2"]
    finally:
        sglang.shutdown()
