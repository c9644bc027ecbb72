"""The real `tinker` 0.38 client, unmodified, against inkwell's /api/v1 on inkling-tiny (fp32, CPU): a LoRA
training client runs every supported loss, forward_backward_custom, optim_step and save_state; a client made from
the state with its optimizer takes the step the first one took; sampler weights sample with logprobs that
compute_logprobs and the trainer agree with; the REST client lists, inspects and deletes checkpoints. Two session
workers in all (the service's default capacity)."""

import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
import torch
from tinker import types

from inkwell.service.routers.tinker import CLIENT_CONFIG
from tests.service.helpers import sqlite_write_lock

ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
TOKENS = [5, 9, 12, 40, 41, 7, 3, 2, 11, 13]


def _datum(tokens: list[int], **extra) -> types.Datum:
    n = len(tokens) - 1
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * n} if not extra else {"target_tokens": tokens[1:]}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={**inputs, **extra})


def _logprobs(out: types.ForwardBackwardOutput) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


@pytest.fixture(scope="module")
def client(service, tenant) -> Iterator[tinker.ServiceClient]:
    """A client told to send each datum of a forward_backward as its own chunk: the chunks go out at once, the
    first one last, so every multi-datum call below also checks the server's seq_id ordering."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CLIENT_CONFIG, "fwdbwd_max_chunk_len", 1)
        with tinker.ServiceClient(base_url=service.url, api_key=tenant[1]) as c:
            yield c


@pytest.fixture(scope="module")
def training(client) -> tinker.TrainingClient:
    return client.create_lora_training_client("inkling-tiny", rank=2, seed=3).result()


def test_info_and_tokenizer(training, base_dir):
    info = training.get_info()
    assert info.model_data.model_name == "inkling-tiny" and info.lora_rank == 2 and info.is_lora
    tokenizer = training.get_tokenizer()  # the base model's own tokenizer, from its directory, offline
    assert tokenizer.decode(tokenizer.encode("hello", add_special_tokens=False)) == "hello"


def test_every_supported_loss_and_a_custom_one(training):
    data = [_datum(TOKENS), _datum(TOKENS[:6])]
    ce = training.forward_backward(data, "cross_entropy").result()
    logprobs = _logprobs(ce)
    assert [len(x) for x in logprobs] == [9, 5]
    assert ce.metrics["loss:sum"] == pytest.approx(-sum(map(sum, logprobs)), rel=1e-5)
    forward = training.forward(data, "cross_entropy").result()
    assert _flat(_logprobs(forward)) == pytest.approx(_flat(logprobs), abs=1e-6)  # no step since: same weights
    for loss, config in [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("gspo", None),
        ("cispo", None),
        ("dro", {"beta": 0.1}),
    ]:
        # gspo: the sequence ratio over all but each datum's first target (tinker-cookbook's rl_loop marks its samples)
        masks = [{"sequence_ratio_mask": [0.0] + [1.0] * (n - 1)} if loss == "gspo" else {} for n in (9, 5)]
        rl = [
            _datum(TOKENS, logprobs=logprobs[0], advantages=[1.0] * 9, **masks[0]),
            _datum(TOKENS[:6], logprobs=logprobs[1], advantages=[-0.5] * 5, **masks[1]),
        ]
        out = training.forward_backward(rl, loss, config).result()
        assert _flat(_logprobs(out)) == pytest.approx(_flat(logprobs), abs=1e-5), loss
        # the sampler's own logprobs: ratio 1, so every loss's sum is -sum(A) (cispo and dro: -sum(A log p))
        expected = {
            "importance_sampling": -(9 * 1.0 - 5 * 0.5),
            "ppo": -(9 * 1.0 - 5 * 0.5),
            "gspo": -(9 * 1.0 - 5 * 0.5),
            "cispo": -(sum(logprobs[0]) - 0.5 * sum(logprobs[1])),
            "dro": -(sum(logprobs[0]) - 0.5 * sum(logprobs[1])),
        }[loss]
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4), loss
        if loss in ("ppo", "gspo", "cispo"):
            assert out.metrics["clip_fraction:mean"] == 0.0

    def custom(data, logprobs_list):
        loss = sum((-2.0 * lp).sum() for lp in logprobs_list)
        return loss, {"custom:sum": loss.item()}

    out = training.forward_backward_custom(data, custom).result()
    assert out.metrics["loss:sum"] == pytest.approx(-2 * sum(map(sum, logprobs)), rel=1e-5)
    assert out.metrics["custom:sum"] == pytest.approx(out.metrics["loss:sum"])
    assert "surrogate_loss:sum" in out.metrics
    step = training.optim_step(ADAM).result()
    assert step.metrics["step:max"] == 1.0 and step.metrics["grad_norm:mean"] > 0


def test_k_targets_per_token_as_the_cookbooks_distillation_sends_them(training):
    """cross_entropy with target_tokens and weights [N, K] (tinker-cookbook's off-policy distillation: the teacher's
    top K tokens per position, weighted by their probabilities): logprobs come back [N, K], column k that of target
    k alone, and the loss is -sum w log p."""
    n, alternatives = len(TOKENS) - 1, torch.tensor([[7, 40]] * (len(TOKENS) - 1))
    targets = torch.cat([torch.tensor(TOKENS[1:])[:, None], alternatives], 1)
    weights = torch.tensor([[0.6, 0.3, 0.1]] * n)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_torch(targets),
            "weights": tinker.TensorData.from_torch(weights),
        },
    )
    out = training.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert tuple(logprobs.shape) == (n, 3)
    for k in range(3):
        alone = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": targets[:, k].tolist(), "weights": [1.0] * n},
        )
        assert logprobs[:, k].tolist() == pytest.approx(
            _logprobs(training.forward([alone], "cross_entropy").result())[0], abs=1e-5
        )
    assert out.metrics["loss:sum"] == pytest.approx(-(weights * logprobs).sum().item(), rel=1e-5)


@pytest.mark.parametrize("loss", ["stable_reinforce", "custom"])
def test_unsupported_losses_are_refused_by_name(training, loss):
    with pytest.raises(tinker.RequestFailedError) as err:  # the client's own error shape: {error, category}
        training.forward_backward([_datum(TOKENS)], loss).result()
    assert err.value.category == "user" and "unsupported_loss" in str(err.value)
    supported = ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dro")
    assert all(name in str(err.value) for name in supported)


def test_a_bad_datum_is_refused_by_field_and_the_client_goes_on(training):
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 10**6], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.RequestFailedError) as err:
        training.forward([_datum(TOKENS), bad], "cross_entropy").result()
    assert err.value.category == "user" and "invalid_datum" in str(err.value) and "target_tokens" in str(err.value)
    assert len(_logprobs(training.forward([_datum(TOKENS)], "cross_entropy").result())[0]) == 9


def test_a_body_refused_on_arrival_takes_its_turn_and_the_client_goes_on(training):
    """Datums that cannot be decoded (3-D weights) and a body that does not validate (a NaN learning rate) fail
    through their futures in their turn: refused at the POST, their seq_ids never reached the model, and every
    later request waited 50 s for them and failed."""
    deep = types.TensorData.from_torch(torch.ones(len(TOKENS) - 1, 2, 2))
    with pytest.raises(tinker.RequestFailedError) as err:
        training.forward_backward([_datum(TOKENS, weights=deep)], "cross_entropy").result()
    assert err.value.category == "user" and "invalid_body" in str(err.value) and "shape [9, 2, 2]" in str(err.value)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.optim_step(types.AdamParams(learning_rate=float("nan"))).result()
    assert "validation_error" in str(err.value) and "learning_rate" in str(err.value)
    started = time.monotonic()
    assert len(_logprobs(training.forward([_datum(TOKENS)], "cross_entropy").result())[0]) == 9
    assert time.monotonic() - started < 20  # not held for the refused ones' seq_ids


def test_a_state_resumes_with_its_optimizer_to_the_same_step(client, training):
    data = [_datum(TOKENS)]
    saved = training.save_state("before-two").result()
    run_id = saved.path.removeprefix("tinker://").split("/")[0]
    assert saved.path == f"tinker://{run_id}/weights/before-two"
    training.forward_backward(data, "cross_entropy")
    training.optim_step(ADAM).result()
    expected = _logprobs(training.forward(data, "cross_entropy").result())
    resumed = client.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.get_info().model_data.model_name == "inkling-tiny" and resumed.get_info().lora_rank == 2
    resumed.forward_backward(data, "cross_entropy")
    assert resumed.optim_step(ADAM).result().metrics["step:max"] == 2.0
    assert _logprobs(resumed.forward(data, "cross_entropy").result()) == expected  # float for float


def test_sampling_clients_agree_with_the_trainer(client, training):
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    sampler = training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(prompt, 2, greedy).result()
    first, second = out.sequences
    assert first.tokens == second.tokens and 1 <= len(first.tokens) <= 6
    assert first.stop_reason == ("length" if len(first.tokens) == 6 else "stop")
    assert first.sequence_id and first.sequence_id != second.sequence_id
    full = TOKENS[:4] + first.tokens
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None and len(scored) == len(full)
    assert scored[4:] == pytest.approx(first.logprobs, abs=1e-4)
    trained = _logprobs(training.forward([_datum(full)], "cross_entropy").result())[0]
    assert trained[3:] == pytest.approx(first.logprobs, abs=1e-4)
    with_prompt = sampler.sample(prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert with_prompt.prompt_logprobs[0] is None and with_prompt.prompt_logprobs[1:] == pytest.approx(scored[1:4])
    assert with_prompt.topk_prompt_logprobs[1][0][1] >= with_prompt.prompt_logprobs[1] - 1e-5
    # the top 3 tokens at each sampled position (topk_sample_logprobs) beside the prompt's top 2: greedy picks the
    # first of them, with its own logprob; each side keeps its own k
    both = sampler.sample(
        prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=3
    )
    top = both.result().sequences[0].topk_logprobs
    assert len(top) == len(first.tokens) and all(len(row) == 3 for row in top)
    assert [row[0][0] for row in top] == first.tokens
    assert [row[0][1] for row in top] == pytest.approx(first.logprobs, abs=1e-5)
    assert all(row[0][1] >= row[1][1] >= row[2][1] for row in top)
    assert all(len(row) == 2 for row in both.result().topk_prompt_logprobs[1:])
    assert out.sequences[0].topk_logprobs is None  # not asked for
    seeded = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    assert sampler.sample(prompt, 1, seeded).result().sequences[0].tokens == (
        sampler.sample(prompt, 1, seeded).result().sequences[0].tokens
    )

    named = training.save_weights_for_sampler("final").result()
    assert named.path.endswith("/sampler_weights/final")
    by_path = client.create_sampling_client(model_path=named.path).result()
    assert by_path.get_base_model() == "inkling-tiny"
    assert by_path.sample(prompt, 1, greedy).result().sequences[0].tokens == first.tokens
    base = client.create_sampling_client(base_model="inkling-tiny").result().sample(prompt, 1, greedy).result()
    assert base.sequences[0].logprobs != first.logprobs  # the adapter, not the base, answered


def test_samples_and_checkpoint_reads_do_not_wait_for_the_databases_writer(service, tenant, client, training):
    """A sample, a run's checkpoint list and a checkpoint's info only read the registry, so they are answered while
    another process holds SQLite's write lock: an RL loop's samples queued behind a writer would each wait up to the
    60 s busy timeout."""
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    named = training.save_weights_for_sampler("while-locked").result()
    samplers = [training.save_weights_and_get_sampling_client().result()]
    samplers.append(client.create_sampling_client(model_path=named.path).result())
    rest = tinker.RestClient(base_url=service.url, api_key=tenant[1])
    run_id = named.path.removeprefix("tinker://").split("/")[0]
    with sqlite_write_lock(service.settings):
        answers = [sampler.sample(prompt, 2, greedy) for sampler in samplers]
        assert all(len(answer.result(timeout=20).sequences) == 2 for answer in answers)
        listed = rest.list_checkpoints(run_id).result(timeout=20).checkpoints
        assert "sampler_weights/while-locked" in {c.checkpoint_id for c in listed}
        assert rest.get_weights_info_by_tinker_path(named.path).result(timeout=20).base_model == "inkling-tiny"


def test_stable_reinforces_sampling_is_refused_naming_the_losses_to_use(training):
    """tinker-cookbook's rl_loop and async RL default to stable_reinforce, whose sampler records data inkwell does
    not: the first sample says so and which losses to pass instead."""
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    with pytest.raises(tinker.BadRequestError) as err:
        sampler.sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2)).result()
    for words in ("record_stability_info", "stable_reinforce", "importance_sampling, ppo, gspo, cispo, dro"):
        assert words in str(err.value)


def test_rest_client_lists_inspects_and_deletes_checkpoints(service, tenant, client, training):
    rest = tinker.RestClient(base_url=service.url, api_key=tenant[1])
    sampler_path = training.save_weights_for_sampler("000001").result().path  # the cookbook's digit names
    sampler = client.create_sampling_client(model_path=sampler_path).result()
    run_id = sampler_path.removeprefix("tinker://").split("/")[0]
    listed = rest.list_checkpoints(run_id).result().checkpoints
    ids = {c.checkpoint_id: c for c in listed}
    assert {"weights/before-two", "sampler_weights/final", "sampler_weights/000001"} <= set(ids)
    assert ids["weights/before-two"].checkpoint_type == "training" and ids["weights/before-two"].size_bytes > 0
    run = rest.get_training_run_by_tinker_path(sampler_path).result()
    assert run.training_run_id == run_id and run.base_model == "inkling-tiny" and run.lora_rank == 2
    info = rest.get_weights_info_by_tinker_path(f"tinker://{run_id}/weights/before-two").result()
    assert (info.base_model, info.lora_rank, info.train_mlp, info.train_unembed) == ("inkling-tiny", 2, True, True)
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert "sampler_weights/000001" not in {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    for sample in (  # the deleted weights are named by the path the user knows, not by registry names
        lambda: sampler.sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2)),
        lambda: client.create_sampling_client(model_path=sampler_path),
    ):
        with pytest.raises(tinker.NotFoundError) as err:
            sample().result()
        assert f"{sampler_path}: these sampler weights were deleted or never saved" in str(err.value)
    models = {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    assert "inkling-tiny" in models


def test_errors_have_the_clients_shape(service, tenant, training):
    """Bad keys are 401s with a body; a full service is a 429 with Retry-After (two session workers are open)."""
    url = f"{service.url}/api/v1"
    bad = httpx.post(f"{url}/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"})
    assert bad.status_code == 401 and bad.json()["category"] == "user"
    headers = {"X-API-Key": tenant[1]}
    session = httpx.post(
        f"{url}/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}, headers=headers
    ).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "inkling-tiny", "lora_config": {"rank": 2}}
    full = httpx.post(f"{url}/create_model", json=body, headers=headers)
    assert full.status_code == 429 and full.headers["Retry-After"] == "10", full.text
    assert full.json()["category"] == "server" and full.json()["code"] == "too_many_sessions"
    unknown = httpx.post(f"{url}/get_info", json={"model_id": f"{session}:train:7"}, headers=headers)
    assert unknown.status_code == 404 and unknown.json()["category"] == "user"
    invalid = httpx.post(f"{url}/optim_step", json={"model_id": training.model_id}, headers=headers)
    assert invalid.status_code == 400 and "optim_params" in invalid.json()["error"]
    not_json = httpx.post(
        f"{url}/optim_step", content=b"{model_id", headers={**headers, "content-type": "application/json"}
    )
    assert not_json.status_code == 400 and not_json.json()["category"] == "user"
    assert not_json.json()["error"].startswith("body: not valid JSON (Expecting property name"), not_json.text
