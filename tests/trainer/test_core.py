"""The training core driven step by step, as a training session drives it: supervised learning through datums
equals the SFT job on the same batches; datums of any length batch as if alone; importance sampling's gradient is
the ratio-weighted log-likelihood gradient; a saved state continues bit for bit; a refused request changes nothing.
"""

import pytest
import torch

from inkwell.adapters.spec import LoraSpec
from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.trainer import TrainCallbacks, train
from inkwell.trainer.config import parse_config
from inkwell.trainer.core import AdamParams, TrainingCore
from inkwell.trainer.dataset import Rows
from inkwell.trainer.datums import Datum, DatumError
from inkwell.trainer.loop import Trainer, build_core
from inkwell.trainer.parallel import model_parallel
from inkwell.trainer.prepare import prepare
from tests.trainer.conftest import ALL_GROUPS
from tests.trainer.helpers import reverse_sample, tiny_job

SPEC = LoraSpec(rank=2, alpha=4, targets=ALL_GROUPS)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    """The tiny base model, read once: (config, identity, weights)."""
    return load_base_config(tiny_model_dir), base_model_identity(tiny_model_dir), load_base_weights(tiny_model_dir)


def make_core(base, spec: LoraSpec = SPEC, seed: int = 0, **options) -> TrainingCore:
    return TrainingCore(*base, spec, seed=seed, **options)


def datums(lengths: list[int], seed: int = 0) -> list[Datum]:
    """Random sequences with next-token targets and unit weights."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 300, (n + 1,), generator=gen).tolist()
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:], "weights": [1.0] * n}))
    return out


def with_inputs(data: list[Datum], **inputs) -> list[Datum]:
    """The same sequences and targets with other loss inputs (one list per datum for each name)."""
    return [
        Datum(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"], **{k: v[i] for k, v in inputs.items()}})
        for i, d in enumerate(data)
    ]


def grads(core: TrainingCore) -> dict[str, torch.Tensor]:
    return {p.hf_name: p.grad.clone() for p in core.params}


def trained(core: TrainingCore) -> TrainingCore:
    """One large step first, so every LoRA factor (B included) is nonzero and every gradient means something."""
    core.forward_backward(datums([20, 30], seed=9), "cross_entropy")
    core.optim_step(AdamParams(learning_rate=2e-2))
    return core


class Losses(TrainCallbacks):
    def __init__(self):
        self.losses = []

    def on_event(self, event):
        self.losses.append(event.loss)


def sample_datums(batch: Rows, pad_id: int) -> list[Datum]:
    """One datum per packed sample of an SFT batch, weights = its loss mask / completion tokens of the step."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        for segment in batch.segments[r].unique().tolist():
            where = (batch.segments[r] == segment).nonzero().flatten()
            span = slice(int(where[0]), int(where[-1]) + 1)
            if (batch.input_ids[r, span] == pad_id).all():
                continue  # the row's padding tail
            weights = batch.loss_mask[r, span] / batch.loss_tokens
            inputs = {"target_tokens": batch.targets[r, span].tolist(), "weights": weights.tolist()}
            out.append(Datum(batch.input_ids[r, span].tolist(), inputs))
    return out


def test_supervised_datums_through_the_core_equal_the_sft_job(tmp_path, tiny_model_dir):
    """The job packs samples into rows; the same samples as datums, one per row, give the job's losses."""
    data = reverse_sample(tmp_path / "reverse40.jsonl", 40)
    job = tiny_job(tiny_model_dir, data, tmp_path / "job", max_steps=3, learning_rate=5e-3, warmup_steps=1)
    job["weight_decay"] = 0.01
    config = parse_config(job)
    prepared = prepare(config)
    recorder = Losses()
    train(job, recorder)

    with model_parallel(1, 1, "cpu", config.seed) as layout:
        core = build_core(config, prepared)
        trainer = Trainer(config, prepared, layout, TrainCallbacks(), core)  # the job's core, stream and schedule
        losses = []
        for step in range(config.max_steps):
            batch = trainer.stream.rows(step * config.batch_size, config.batch_size)
            samples = sample_datums(batch, prepared.pad_id)
            assert len(samples) > batch.input_ids.shape[0], "the job must pack several samples per row"
            losses.append(trainer.core.forward_backward(samples, "cross_entropy").metrics["loss:sum"])
            trainer.core.optim_step(trainer.adam(step))
    assert len(recorder.losses) == 3 and recorder.losses[-1] < recorder.losses[0]
    for ours, job_loss in zip(losses, recorder.losses, strict=True):
        assert abs(ours - job_loss) / job_loss < 1e-5, (losses, recorder.losses)


def test_datums_of_any_length_batch_as_if_each_were_alone(base, world_of_one):
    core = trained(make_core(base))
    data = datums([5, 70, 12, 1])  # 70 tokens: rows padded to 128
    alone = [core.forward([d], "cross_entropy").logprobs[0] for d in data]
    together = core.forward(data, "cross_entropy")
    assert [len(lp) for lp in together.logprobs] == [5, 70, 12, 1]
    for ours, ref in zip(together.logprobs, alone, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in core.params), "forward computes no gradient"
    assert together.metrics["loss:sum"] == pytest.approx(-sum(map(sum, alone)), rel=1e-5)

    result = core.forward_backward(data, "cross_entropy")
    for ours, ref in zip(result.logprobs, together.logprobs, strict=True):
        assert ours == ref, "without dropout forward_backward's logprobs are forward's"
    one_batch = grads(core)
    core.optimizer.zero_grad(set_to_none=True)
    core.batch_tokens = 64  # each datum its own forward; the gradients accumulate to the same sum
    core.forward_backward(data, "cross_entropy")
    for name, g in grads(core).items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g, one_batch[name], rtol=1e-4, atol=1e-7, msg=name)


def test_importance_sampling_gradient_is_the_log_likelihood_gradient_weighted_by_the_ratio(base, world_of_one):
    core = trained(make_core(base))
    data = datums([9, 14, 6], seed=1)
    own = core.forward(data, "cross_entropy").logprobs

    def gradient(loss_fn: str, batch: list[Datum]) -> tuple[dict[str, torch.Tensor], float]:
        out = core.forward_backward(batch, loss_fn)
        g = grads(core)
        core.optimizer.zero_grad(set_to_none=True)
        return g, out.metrics["loss:sum"]

    # q = the model's own probabilities, advantage 1: ratio 1, the gradient of cross entropy with unit weights
    ones = [[1.0] * len(d.tokens) for d in data]
    on_policy, value = gradient("importance_sampling", with_inputs(data, logprobs=own, advantages=ones))
    reference, _ = gradient("cross_entropy", data)
    assert value == pytest.approx(-sum(map(len, own)), rel=1e-6)  # -sum(r * A) with r = A = 1
    for name, g in reference.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(on_policy[name], g, rtol=1e-5, atol=1e-8, msg=name)

    # q shifted per token, advantages of both signs: -sum r * A * grad log p, i.e. cross entropy weighted by r * A
    gen = torch.Generator().manual_seed(2)
    shifts = [(torch.rand(len(lp), generator=gen) - 0.5).tolist() for lp in own]
    advantages = [(torch.randn(len(lp), generator=gen)).tolist() for lp in own]
    q = [[a - s for a, s in zip(lp, sh, strict=True)] for lp, sh in zip(own, shifts, strict=True)]
    ratio = [torch.tensor(sh).exp() for sh in shifts]
    off_policy, value = gradient("importance_sampling", with_inputs(data, logprobs=q, advantages=advantages))
    by_hand = [(r * torch.tensor(a)).tolist() for r, a in zip(ratio, advantages, strict=True)]
    reference, _ = gradient("cross_entropy", with_inputs(data, weights=by_hand))
    assert value == pytest.approx(-sum(sum(w) for w in by_hand), rel=1e-4)
    for name, g in reference.items():
        torch.testing.assert_close(off_policy[name], g, rtol=1e-4, atol=1e-7, msg=name)
        assert not torch.allclose(g, on_policy[name]), "the ratio must matter"


def test_k_targets_per_token_are_k_weighted_single_target_cross_entropies(base, world_of_one):
    """Tinker's top-K cross entropy: targets and weights [N, K] give, per token, the logprob of each of its K targets
    and the gradient of -sum w log p: the same as K single-target calls (target k, weights column k) summed."""
    core = trained(make_core(base))
    data = datums([9, 14], seed=3)
    gen = torch.Generator().manual_seed(4)
    alternatives = [torch.randint(3, 300, (len(d.tokens), 2), generator=gen) for d in data]
    targets = [
        torch.cat([torch.tensor(d.loss_fn_inputs["target_tokens"])[:, None], alt], 1)
        for d, alt in zip(data, alternatives, strict=True)
    ]
    weights = [torch.rand(len(d.tokens), 3, generator=gen) for d in data]
    wide = [
        Datum(d.tokens, {"target_tokens": t.tolist(), "weights": w.tolist()})
        for d, t, w in zip(data, targets, weights, strict=True)
    ]

    def gradient(batch: list[Datum]):
        out = core.forward_backward(batch, "cross_entropy")
        g = grads(core)
        core.optimizer.zero_grad(set_to_none=True)
        return out, g

    out, together = gradient(wide)
    assert [torch.tensor(lp).shape for lp in out.logprobs] == [(9, 3), (14, 3)]
    summed, value = {}, 0.0
    for k in range(3):
        column = [
            Datum(d.tokens, {"target_tokens": t[:, k].tolist(), "weights": w[:, k].tolist()})
            for d, t, w in zip(data, targets, weights, strict=True)
        ]
        single, g = gradient(column)
        for got, want in zip(out.logprobs, single.logprobs, strict=True):
            assert torch.tensor(got)[:, k].tolist() == pytest.approx(want, abs=1e-5)
        summed = {name: summed.get(name, 0) + grad for name, grad in g.items()}
        value += single.metrics["loss:sum"]
    assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-5)
    for name, g in summed.items():
        torch.testing.assert_close(together[name], g, rtol=1e-4, atol=1e-7, msg=name)


def moments(core: TrainingCore) -> dict[str, torch.Tensor]:
    return {f"{p.hf_name}.{k}": v for p in core.params for k, v in core.optimizer.state[p].items()}


def test_a_saved_state_continues_bit_for_bit(base, world_of_one, tmp_path):
    """LoRA dropout, weight decay and clipping on: the RNG, moments and step count all have to come back."""
    spec = SPEC.model_copy(update={"dropout": 0.2})
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)
    data = datums([11, 23, 7], seed=3)
    core = make_core(base, spec)
    for _ in range(2):
        core.forward_backward(data, "cross_entropy")
        core.optim_step(adam)
    saved_adapter = core.adapter().tensors
    path = core.save_state(tmp_path / "state")
    uninterrupted = core.forward_backward(data, "cross_entropy")
    core.optim_step(adam)

    resumed = make_core(base, spec, seed=5)  # another init: everything must come from the state
    resumed.load_state(path)
    assert resumed.step == 2
    result = resumed.forward_backward(data, "cross_entropy")
    metrics = resumed.optim_step(adam)
    assert metrics["step:max"] == 3.0 and resumed.step == core.step
    assert result.logprobs == uninterrupted.logprobs, "the same dropout masks"
    adapter = resumed.adapter({"name": "x"})
    assert adapter.base == base[1] and adapter.spec == spec and adapter.metadata == {"name": "x"}
    for name, tensor in core.adapter().tensors.items():
        assert torch.equal(adapter.tensors[name], tensor), name
    ours, ref = moments(resumed), moments(core)
    assert ours.keys() == ref.keys() and len(ref) == 3 * len(core.params)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name

    weights_only = make_core(base, spec, seed=5)
    weights_only.load_state(path, with_optimizer=False)
    assert weights_only.step == 0 and not weights_only.optimizer.state
    for name, tensor in weights_only.adapter().tensors.items():
        assert torch.equal(tensor, saved_adapter[name]), name


def test_a_refused_request_leaves_the_accumulated_gradients_as_they_were(base, world_of_one):
    core = trained(make_core(base))
    data = datums([6, 8, 5], seed=4)
    core.forward_backward(data, "cross_entropy")
    before = grads(core)
    ragged = data[:2] + with_inputs(data[2:], weights=[[1.0] * 4])
    refused = [
        (ragged, "cross_entropy", None, ("loss_fn_inputs.weights", 2)),
        (data, "ppo", None, ("loss_fn_inputs.weights", 0)),
        (data, "stable_reinforce", None, ("loss_fn", None)),
        (data, "cross_entropy", {"beta": 1.0}, ("loss_fn_config.beta", None)),
        ([], "cross_entropy", None, ("data", None)),
    ]
    for batch, loss_fn, config, where in refused:
        with pytest.raises(DatumError) as info:
            core.forward_backward(batch, loss_fn, config)
        assert (info.value.field, info.value.index) == where
        for name, g in grads(core).items():
            assert torch.equal(g, before[name]), (where, name)
    assert core.optim_step(AdamParams())["step:max"] == 2.0


# Adam's first step moves each weight by about lr * g / (|g| + eps): for a gradient that sums to nearly zero (one of
# gate_B's is 1e-8 out of terms near 1e-3), the ranks' other summation order alone changes the step by more than the
# tolerance when eps is tiny. An eps above that fp32 noise keeps the compared step well-conditioned.
DP_ADAM = AdamParams(learning_rate=1e-2, eps=1e-6, grad_clip_norm=0.1)


def ppo_datums() -> list[Datum]:
    """Sampler logprobs of -5 and advantages of both signs: some tokens inside the clip bounds, some outside."""
    data = datums([9, 30, 4])
    sizes = [len(d.tokens) for d in data]
    return with_inputs(
        data, logprobs=[[-5.0] * n for n in sizes], advantages=[[(-1.0) ** i for i in range(n)] for n in sizes]
    )


def _rank(rank: int, port: int, base_dir: str, out: str) -> None:
    """One of two gloo processes (EP=2, so the ranks are also two data-parallel ranks)."""
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    with model_parallel(1, 2, "cpu", 0):
        core = TrainingCore.create(base_dir, SPEC)
        result = core.forward_backward(ppo_datums(), "ppo")  # three datums: one rank also gets an empty row
        metrics = core.optim_step(DP_ADAM)
        adapter = core.adapter().tensors
        if rank == 0:
            torch.save({"result": result, "metrics": metrics, "adapter": adapter}, out)


def test_data_parallel_ranks_split_the_datums_and_gather_their_logprobs(base, tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks.pt"
    torch.multiprocessing.spawn(_rank, (port, str(tiny_model_dir), str(out)), nprocs=2)
    ranks = torch.load(out, weights_only=False)

    with model_parallel(1, 1, "cpu", 0):
        core = make_core(base)
        result = core.forward_backward(ppo_datums(), "ppo")
        metrics = core.optim_step(DP_ADAM)
        adapter = core.adapter().tensors
    assert [len(lp) for lp in ranks["result"].logprobs] == [9, 30, 4]
    for ours, ref in zip(ranks["result"].logprobs, result.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert ranks["result"].metrics == pytest.approx(result.metrics, rel=1e-5)
    assert ranks["metrics"]["grad_norm:mean"] == pytest.approx(metrics["grad_norm:mean"], rel=1e-4)
    for name, tensor in adapter.items():
        torch.testing.assert_close(ranks["adapter"][name], tensor, rtol=0, atol=1e-5, msg=name)
