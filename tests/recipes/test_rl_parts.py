"""The GRPO recipe's parts without a service: group advantages, datums, rewards checked; and the GRPO job's loop
in process with GSPO's sequence ratio."""

import math
from pathlib import Path

import pytest

from inkwell.recipes.job import GrpoCallbacks, rl_config, run_grpo
from inkwell.recipes.problems import Problem
from inkwell.recipes.rl import RewardError, StepReport, advantages, rl_datum, routing_trace, score
from inkwell.recipes.tasks import DATA, TASKS
from inkwell.trainer.config import GrpoJobConfig

PROBLEMS = [Problem("1+1=", "2"), Problem("2+2=", "4")]


def test_advantages_are_centred_per_group_and_optionally_scaled():
    assert advantages([1.0, 0.0, 0.0, 1.0], normalize=False) == [0.5, -0.5, -0.5, 0.5]
    assert advantages([1.0, 0.0, 0.0, 1.0], normalize=True) == [1.0, -1.0, -1.0, 1.0]
    assert advantages([1.0, 1.0], normalize=True) == [0.0, 0.0]  # no spread: nothing to learn, no division by 0


def test_a_datum_trains_the_completion_only():
    datum = rl_datum([1, 10, 11], [20, 2], [-0.5, -0.25], 0.75)
    assert datum["tokens"] == [1, 10, 11, 20]
    inputs = datum["loss_fn_inputs"]
    assert inputs["target_tokens"] == [10, 11, 20, 2]  # position i predicts token i + 1
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -0.25]
    assert inputs["advantages"] == [0.0, 0.0, 0.75, 0.75]
    assert "routing" not in datum


def test_a_gspo_datum_marks_its_completion_for_the_sequence_ratio():
    datum = rl_datum([1, 10, 11], [20, 2], [-0.5, -0.25], 0.75, sequence_ratio=True)
    assert datum["loss_fn_inputs"]["sequence_ratio_mask"] == [0.0, 0.0, 1.0, 1.0]
    assert "sequence_ratio_mask" not in rl_datum([1, 10, 11], [20, 2], [-0.5, -0.25], 0.75)["loss_fn_inputs"]


def test_a_gspo_job_trains_on_each_completions_sequence_ratio(tiny_model_dir, tmp_path):
    """The GRPO job's loop in process with loss_fn gspo: its datums carry the mask the trainer requires of a gspo
    datum (without it the first step is refused), and each step trains: a finite loss, the trainer's logprobs of the
    sampled tokens the sampler's."""
    steps: list[StepReport] = []

    class Noted(GrpoCallbacks):
        def on_step(self, report: StepReport, total_steps: int) -> None:
            steps.append(report)

    task = TASKS["letter-case"]
    config = GrpoJobConfig(
        base_model_dir=tiny_model_dir,
        dataset_path=DATA / f"{task.name}.jsonl",
        output_dir=tmp_path / "out",
        lora=task.lora,
        verifier=task.verifier,
        loss_fn="gspo",
        max_steps=2,
        prompts_per_step=4,
        group_size=4,
        max_tokens=2,
    )
    run_grpo(config, Noted())
    assert [r.step for r in steps] == [0, 1]
    assert all(math.isfinite(r.loss) and r.tokens > 0 for r in steps)
    assert max(r.logprob_diff_max for r in steps) < 1e-4


def test_a_datum_carries_the_samplers_routing_of_its_tokens():
    """The prompt's trace (None first: its first token is scored by no forward) past its first entry, then the
    completion's: entry i is the forward of tokens[i], as the logprobs are aligned."""
    prompt_routing = [None, [[0, 1]], [[2, 3]]]  # one MoE layer, top 2
    trace = routing_trace(prompt_routing, [[[4, 5]], [[6, 7]]])
    datum = rl_datum([1, 10, 11], [20, 2], [-0.5, -0.25], 0.75, trace)
    assert datum["routing"] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert len(datum["routing"]) == len(datum["tokens"]) == 4


def test_a_grpo_job_replays_the_samplers_routing_unless_told_not_to():
    paths = {"base_model_dir": Path("m"), "dataset_path": Path("p.jsonl"), "output_dir": Path("o")}
    assert GrpoJobConfig(**paths).routing_replay and rl_config(GrpoJobConfig(**paths)).routing_replay
    assert not rl_config(GrpoJobConfig(**paths, routing_replay=False)).routing_replay


def test_rewards_are_scored_per_problem():
    assert score(PROBLEMS, [1, 0], [["4", "5"], ["2", "2"]], lambda c, a: float(c == a)) == [[1.0, 0.0], [1.0, 1.0]]


@pytest.mark.parametrize(
    ("reward_fn", "message"),
    [
        (lambda c, a: 1 / 0, r"raised on prompt 1 \('2\+2='\), sample 0: ZeroDivisionError"),
        (lambda c, a: math.nan, r"returned nan on prompt 1 \('2\+2='\), sample 0; a reward is a finite number"),
        (lambda c, a: "1", r"returned '1' on prompt 1"),
        (lambda c, a: None, r"returned None on prompt 1"),
    ],
)
def test_a_failing_reward_names_the_prompt(reward_fn, message):
    with pytest.raises(RewardError, match=message):
        score(PROBLEMS, [1, 0], [["4"], ["2"]], reward_fn)
