"""External weights through the real `tinker` 0.38 client and its CLI, unmodified: an adapter trained on a session
and saved with save_weights_external is listed, downloaded through get_external_weights_urls' presigned URLs (no
key) and run outside the service by peft on transformers' Inkling with the trainer's own logprobs; `tinker checkpoint
download` fetches a saved training state the same way (a session from the state, a temporary export, deleted after).
One session worker here and one for the CLI's export: the service's default capacity."""

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import peft
import pytest
import tinker
import torch
from tinker import types

from inkwell.models import load_base_model

ADAM = types.AdamParams(learning_rate=5e-2, beta1=0.9, beta2=0.999, eps=1e-8)
TOKENS = [5, 9, 12, 40, 41, 7, 3, 2, 11, 13, 60, 61]
FILES = {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}


def _datum(tokens: list[int]) -> types.Datum:
    targets = tokens[1:]
    inputs = {"target_tokens": targets, "weights": [1.0] * len(targets)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def client(service, tenant) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(base_url=service.url, api_key=tenant[1]) as c:
        yield c


@pytest.fixture(scope="module")
def rest(service, tenant) -> tinker.RestClient:
    return tinker.RestClient(base_url=service.url, api_key=tenant[1])


@pytest.fixture(scope="module")
def trained(client) -> tinker.TrainingClient:
    """A session whose adapter a few SFT steps moved away from the base (a fresh LoRA's B is zero)."""
    training = client.create_lora_training_client("inkling-tiny", rank=4, seed=5).result()
    for _ in range(3):
        training.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        training.optim_step(ADAM).result()
    return training


def trainer_logprobs(training: tinker.TrainingClient) -> list[float]:
    return training.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def outside_logprobs(base_dir: Path, adapter_dir: Path | None) -> list[float]:
    """The targets' logprobs of transformers' Inkling, with the adapter loaded by peft when given."""
    model = load_base_model(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        logits = model.eval()(torch.tensor([TOKENS[:-1]])).logits[0]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].tolist()


def test_external_weights_run_outside_the_service_with_the_trainers_logprobs(trained, rest, base_dir, tmp_path):
    saved = trained.save_weights_external("final").result()
    run_id = saved.path.removeprefix("tinker://").split("/")[0]
    assert saved.path == f"tinker://{run_id}/external_weights/final"
    signed = rest.get_external_weights_urls(saved.path).result()
    assert set(signed.urls) == FILES and signed.expires > datetime.now(UTC)
    for name, url in signed.urls.items():  # presigned: no key, straight from the object store
        (tmp_path / name).write_bytes(httpx.get(url).raise_for_status().content)
    ours = trainer_logprobs(trained)
    assert outside_logprobs(base_dir, tmp_path) == pytest.approx(ours, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(outside_logprobs(base_dir, None), ours, strict=True)) > 1e-2

    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert listed["external_weights/final"].checkpoint_type == "external"
    assert listed["external_weights/final"].size_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    info = rest.get_weights_info_by_tinker_path(saved.path).result()
    assert (info.base_model, info.lora_rank) == ("inkling-tiny", 4)
    rest.set_checkpoint_ttl_from_tinker_path(saved.path, 3600).result()  # accepted: inkwell's never expire
    with pytest.raises(tinker.RequestFailedError, match="already has external weights named 'final'"):
        trained.save_weights_external("final").result()
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(saved.path).result()
    assert "external_weights/final" not in {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_encrypted_exports_and_bad_paths_are_refused(trained, rest):
    recipient = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"
    with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients: inkwell does not encrypt"):
        trained.save_weights_external("sealed", age_encryption_recipients=[recipient]).result()
    state = trained.save_state("not-external").result().path
    run_id = state.removeprefix("tinker://").split("/")[0]
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(f"tinker://{run_id}/external_weights/never-saved").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds: 5 is not between 3600"):
        rest.set_checkpoint_ttl_from_tinker_path(state, 5).result()


def test_the_tinker_cli_downloads_a_training_state_as_external_weights(
    trained, rest, service, tenant, base_dir, tmp_path
):
    """`tinker checkpoint download tinker://<run>/weights/<name>`: the CLI starts a session from the state, exports it
    as temporary external weights, downloads them and deletes them."""
    state = trained.save_state("for-the-cli").result().path
    env = {**os.environ, "TINKER_BASE_URL": service.url, "TINKER_API_KEY": tenant[1]}
    command = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    assert {p.name for p in folder.iterdir()} == FILES
    assert outside_logprobs(base_dir, folder) == pytest.approx(trainer_logprobs(trained), abs=1e-4)
    exports = [
        c
        for r in rest.list_training_runs().result().training_runs
        for c in rest.list_checkpoints(r.training_run_id).result().checkpoints
        if c.checkpoint_type == "external"
    ]
    assert exports == []  # the CLI's temporary export is gone
