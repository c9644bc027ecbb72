"""`sdk.train(method="grpo")` end to end: the real service and job worker run the recipe's GRPO loop (recipes/rl.py)
in process on the bundled `letter-case` task, scored by the built-in `regex` verifier; the job's events carry reward
and KL per step, its adapter is published, its PNGs are drawn from its events. Bad input is refused at submission,
naming the field. (The reward's rise over 30 steps is tests/recipes/test_rl.py's.)"""

import pytest

from inkwell import sdk
from inkwell.recipes.tasks import DATA, TASKS
from tests.service.helpers import assert_error

TASK = TASKS["letter-case"]
SHORT = {"max_steps": 4, "prompts_per_step": 8, "group_size": 4, "max_tokens": 1, "checkpoint_every": 2}


def test_a_grpo_job_reports_reward_and_kl_per_step_and_publishes(training_service, tmp_path, capsys):
    _, key = training_service.new_tenant("grpo")
    with sdk.Client(training_service.url, key) as client:
        job = sdk.train(
            "inkling-tiny",
            DATA / "letter-case.jsonl",
            lora=TASK.lora,
            method="grpo",
            adapter_name="letter-case",
            client=client,
            timeout=600,
            verifier=TASK.verifier,
            learning_rate=TASK.config.learning_rate,
            **SHORT,
        )
        assert job.state == "succeeded" and job.info.method == "grpo"
        bar = capsys.readouterr().err
        assert "letter-case" in bar and "4/4" in bar and "reward=" in bar

        events = list(job.events())
        steps = [e.data for e in events if e.type == "progress"]
        assert [d["step"] for d in steps] == [1, 2, 3, 4]
        for d in steps:
            assert 0.0 <= d["reward"] <= 1.0 and d["tokens"] == 8 * 4  # one token per sample
            # the trainer scores the sampled tokens as the in-process engine did (fp32, same adapter): KL ~ 0
            assert abs(d["kl_k1"]) < 1e-4 and 0.0 <= d["kl_k3"] < 1e-6 and d["logprob_diff_max"] < 1e-3
            assert d["clip_fraction"] == 0.0  # no sampled token's ratio p/q left [0.8, 1.2]
            assert d["sample_seconds"] > 0 and d["train_seconds"] > 0 and d["sync_seconds"] > 0
        assert [e.data["step"] for e in events if e.type == "checkpoint"] == [2]
        assert job.info.progress.step == 4 and job.info.progress.reward == steps[-1]["reward"]

        assert job.adapter is not None and job.adapter.version == 1
        assert job.adapter.lineage.job_id == job.id and job.adapter.metrics["final_reward"] == steps[-1]["reward"]
        paths = job.plot(tmp_path)
        for curve in ("loss", "reward"):
            assert paths[curve] == tmp_path / f"letter-case-{curve}.png"
            assert paths[curve].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def refused(sqlite_service):
    """A tenant's SDK and HTTP clients, and the ids of a prompt/answer and a prompt/completion dataset of theirs."""
    _, key = sqlite_service.new_tenant("grpo-bad")
    with sdk.Client(sqlite_service.url, key) as client, sqlite_service.client(key) as http:
        answers = client.datasets.upload(DATA / "letter-case.jsonl").id
        completions = client.datasets.upload([{"prompt": "One letter of PIANO", "completion": "P"}]).id
        yield client, http, answers, completions


def job(dataset_id: str, method: str = "grpo", **hyperparameters) -> dict:
    body = {"base_model": "inkling-tiny", "dataset_id": dataset_id, "adapter_name": "refused", "method": method}
    return body | {"hyperparameters": hyperparameters}


def test_an_unknown_verifier_is_refused_naming_the_known_ones(refused):
    client, http, answers, _ = refused
    err = assert_error(http.post("/v1/jobs", json=job(answers, verifier="fuzzy")), 422, "validation_error")
    assert err["details"]["errors"][0]["loc"][-2:] == ["hyperparameters", "verifier"]
    assert "verifier: unknown verifier 'fuzzy'; built in: exact_match, regex" in err["message"]
    err = assert_error(http.post("/v1/jobs", json=job(answers, group_size=2, batch_size=4)), 422, "validation_error")
    assert err["details"]["errors"][0]["loc"][-1] == "batch_size"  # an SFT knob is no GRPO knob
    with pytest.raises(sdk.ValidationError, match="verifier: unknown verifier 'fuzzy'"):
        sdk.train("inkling-tiny", answers, method="grpo", verifier="fuzzy", client=client)


def test_a_dataset_without_answers_is_refused_at_submission(refused):
    _, http, answers, completions = refused
    err = assert_error(http.post("/v1/jobs", json=job(completions, verifier="regex")), 422, "invalid_job")
    assert err["details"]["field"] == "dataset_id" and "has no answers" in err["message"]
    # with verifier_arg every prompt is scored against it: prompts are enough
    ok = http.post("/v1/jobs", json=job(completions, verifier="regex", verifier_arg="[A-Z]"))
    assert ok.status_code == 201 and http.post(f"/v1/jobs/{ok.json()['id']}/cancel").json()["state"] == "cancelled"
    # and SFT has nothing to learn from answers
    err = assert_error(http.post("/v1/jobs", json=job(answers, method="sft")), 422, "invalid_job")
    assert err["details"]["field"] == "dataset_id" and "SFT learns from completions" in err["message"]
