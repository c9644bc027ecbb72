"""Our megatron-core Inkling computes exactly transformers' InklingForCausalLM (fp32, eager)."""

import pytest
import torch

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.reference import apply_lora
from inkwell.adapters.spec import LoraSpec
from inkwell.models import load_base_config, load_base_model, load_base_weights
from inkwell.trainer.bridge import gather_state, is_lora, marked_tensors
from inkwell.trainer.replay import record_routing, replay_routing
from tests.trainer.conftest import ALL_GROUPS, build_model, identity

# 70 tokens cross the sliding window (24), the relative extent (48) and the log-scaling floor (16).
SEQ = 70


@pytest.fixture(scope="module")
def token_ids():
    return torch.randint(3, 263, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_logits_equal_transformers_without_adapter(tiny_model_dir, world_of_one, token_ids):
    model = build_model(tiny_model_dir, None)
    with torch.no_grad():
        ours = model(token_ids)
        ref = load_base_model(tiny_model_dir)(token_ids).logits
    assert ref.abs().max() > 0.1
    assert (ours - ref).abs().max().item() < 1e-4


def test_logits_equal_reference_lora_on_every_target_group(tiny_model_dir, world_of_one, token_ids):
    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=4, alpha=16, targets=ALL_GROUPS, ranks={"experts": 2})
    adapter = init_adapter(config, spec, identity(tiny_model_dir), seed=3, b_std=0.05)
    model = build_model(tiny_model_dir, spec, adapter.tensors)
    hf = load_base_model(tiny_model_dir)
    with torch.no_grad():
        base = hf(token_ids).logits
        apply_lora(hf, adapter)
        ref = hf(token_ids).logits
        ours = model(token_ids)
    assert (ref - base).abs().max() > 0.05, "the adapter must change the logits for this test to mean anything"
    assert (ours - ref).abs().max().item() < 1e-4


def test_bridge_writes_back_the_checkpoint_it_loaded(tiny_model_dir, world_of_one):
    model = build_model(tiny_model_dir, None)
    original = load_base_weights(tiny_model_dir)
    written = gather_state(model, lora=False)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name


def test_packed_samples_do_not_see_each_other(tiny_model_dir, world_of_one):
    """Two samples packed in one row give the logits each gives alone (conv, attention, positions reset)."""
    model = build_model(tiny_model_dir, None)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 263, (1, 30), generator=gen), torch.randint(3, 263, (1, 40), generator=gen)
    packed_ids = torch.cat([a, b], dim=1)
    segments = torch.cat([torch.zeros(1, 30), torch.ones(1, 40)], dim=1).long()
    with torch.no_grad():
        packed = model(packed_ids, segments)
        alone_a, alone_b = model(a), model(b)
        unsegmented = model(packed_ids)
    assert (packed[:, :30] - alone_a).abs().max().item() < 1e-5
    assert (packed[:, 30:] - alone_b).abs().max().item() < 1e-5
    assert (unsegmented[:, 30:] - alone_b).abs().max().item() > 1e-2, "without segments state would leak"


def test_routing_replay_of_own_ids_reproduces_the_loss_exactly(tiny_model_dir, world_of_one, token_ids):
    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=4, alpha=8)
    model = build_model(tiny_model_dir, spec, init_adapter(config, spec, identity(tiny_model_dir), 0, 0.05).tensors)

    def loss():
        return torch.nn.functional.cross_entropy(model(token_ids).flatten(0, 1), token_ids.roll(-1, 1).flatten())

    with record_routing(model) as recorded:
        own = loss()
    assert set(recorded) == {1, 2, 3} and recorded[1].shape == (2 * SEQ, config.num_experts_per_tok)
    with replay_routing(model, recorded):
        replayed = loss()
    assert torch.equal(own, replayed)

    # other ids: the MoE must follow them, with weights recomputed from the current router (and differentiable)
    shifted = {layer: (ids + 1) % config.n_routed_experts for layer, ids in recorded.items()}
    with replay_routing(model, shifted):
        other = loss()
    assert not torch.equal(own, other)
    other.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora" in n and p.grad is not None]
    assert lora_grads and any(g.abs().sum() > 0 for g in lora_grads)
    with pytest.raises(ValueError, match="routing replay ids"), replay_routing(model, {1: recorded[1][:5]}):
        loss()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_lora_gradients_equal_the_reference(tiny_model_dir, world_of_one, token_ids, attention):
    """Backward too: every LoRA factor's gradient equals autograd through transformers + apply_lora
    (the fused SDPA path, used on GPUs, included)."""
    config = load_base_config(tiny_model_dir)
    spec = LoraSpec(rank=4, alpha=8, targets=ALL_GROUPS)
    adapter = init_adapter(config, spec, identity(tiny_model_dir), seed=1, b_std=0.02)
    model = build_model(tiny_model_dir, spec, adapter.tensors, attention)
    for tensor in adapter.tensors.values():
        tensor.requires_grad_(True)
    hf = load_base_model(tiny_model_dir)
    apply_lora(hf, adapter)

    def next_token_loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), token_ids[:, 1:].flatten())

    next_token_loss(hf(token_ids).logits).backward()
    next_token_loss(model(token_ids)).backward()
    checked = 0
    for tensor in marked_tensors(model):
        if is_lora(tensor):
            ref = adapter.tensors[tensor.hf_name].grad
            assert ref.abs().max() > 0, tensor.hf_name
            torch.testing.assert_close(tensor.grad, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
            checked += 1
    assert checked == len(adapter.tensors)
