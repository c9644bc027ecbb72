"""GRPO with LoRA on a training session, written against the public SDK's primitives only.

    tokenizer = load_tokenizer(model_dir)                        # inkwell.models
    problems = load_problems("problems.jsonl")                   # {"prompt", "answer"} lines
    with client.sessions.create("inkling-tiny", lora={"rank": 8}, seed=0) as session:
        reports = grpo(session, tokenizer, problems, verifier("exact_match"), RLConfig(steps=40))

Each step samples `group_size` completions per prompt from the adapter as it stands, scores them here on the
client, takes reward minus its group's mean as each completion's advantage, trains on the completion tokens
against the sampler's logprobs (the prompt is not trained on), takes an optimizer step and publishes the adapter
for the next step's sampling. With `routing_replay` (the default) the sampler also returns the experts each MoE
layer routed every token to, and each datum carries them back, so the trainer scores the sampled tokens with the
sampler's experts (rollout routing replay: a near-tie routed apart by the two sides' numerics no longer moves
the logprobs). Steps are the session's optimizer steps and a step's prompts and seeds follow from
(seed, step) alone, so a run resumed from a saved state takes the steps the original run would have taken.

The session is anything with those primitives (`inkwell.recipes.primitives`): the SDK's, or the in-process ones an
RL job of the service runs this same loop on (`inkwell.recipes.local`, `inkwell.recipes.job`).
"""

import math
import numbers
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from inkwell.models import encode_prompt_completion
from inkwell.recipes.primitives import Sampler, Session, Weights
from inkwell.recipes.problems import Problem
from inkwell.trainer.verifiers import RewardFn


class RewardError(ValueError):
    """The reward function failed or gave no finite number; the step stops before anything is trained."""


@dataclass(frozen=True)
class RLConfig:
    steps: int = 40  # train until the session has taken this many optimizer steps
    prompts_per_step: int = 8
    group_size: int = 8  # completions per prompt (at most 16 per sampling request)
    max_tokens: int = 8
    temperature: float = 1.0
    learning_rate: float = 1e-3
    loss_fn: Literal["importance_sampling", "ppo", "gspo", "cispo"] = "importance_sampling"
    loss_fn_config: Mapping[str, float] = field(default_factory=dict)
    normalize_advantages: bool = False  # divide by the group's standard deviation as well
    save_every: int = 0  # save_state every this many steps (0: never)
    routing_replay: bool = True  # ask the sampler for its routing traces and replay them in forward_backward
    seed: int = 0
    timeout: float = 600.0  # per request


@dataclass(frozen=True)
class StepReport:
    """One step: its mean reward, its loss (summed over the sampled tokens), how far the trainer's logprobs of the
    sampled tokens were from the sampler's (both under the same weights, so any gap is numerical: KL(sampler ||
    trainer) by the k1 and k3 estimators, the mean and largest |log p - log q| and the share of tokens whose ratio
    p/q left PPO's clip bounds, as forward_backward reports them over the sampled tokens: trainer/consistency.py),
    and where its time went (sampling, forward_backward + optim_step, and sync: save_weights_for_sampler)."""

    step: int
    reward: float
    loss: float
    tokens: int  # sampled (and trained on)
    kl_k1: float
    kl_k3: float
    logprob_diff_mean: float
    logprob_diff_max: float
    clip_fraction: float  # of the sampled tokens, r = p/q outside [0.8, 1.2] (ppo: its clip thresholds)
    sample_seconds: float
    train_seconds: float
    sync_seconds: float
    state: str | None = None  # the state saved after this step, if one was

    def line(self) -> str:
        return (
            f"step {self.step:4d}  reward {self.reward:.3f}  kl k1 {self.kl_k1:+.1e} k3 {self.kl_k3:.1e}  "
            f"|dlogp| mean {self.logprob_diff_mean:.1e} max {self.logprob_diff_max:.1e} clip {self.clip_fraction:.3f}  "
            f"sample {self.sample_seconds:.1f}s train {self.train_seconds:.1f}s sync {self.sync_seconds:.1f}s"
        )


def score(
    problems: Sequence[Problem], picked: Sequence[int], completions: Sequence[Sequence[str]], reward_fn: RewardFn
) -> list[list[float]]:
    """Rewards per picked problem and completion; RewardError names the problem when the function raises or gives
    anything but a finite number."""
    rewards = []
    for index, texts in zip(picked, completions, strict=True):
        row = []
        for sample, text in enumerate(texts):
            where = f"prompt {index} ({problems[index].prompt!r}), sample {sample}"
            try:
                value = reward_fn(text, problems[index].answer)
            except Exception as exc:
                raise RewardError(f"the reward function raised on {where}: {type(exc).__name__}: {exc}") from exc
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(f"the reward function returned {value!r} on {where}; a reward is a finite number")
            row.append(float(value))
        rewards.append(row)
    return rewards


def advantages(rewards: Sequence[float], normalize: bool) -> list[float]:
    """Each reward minus the group's mean (divided by the group's standard deviation when `normalize`)."""
    mean = statistics.fmean(rewards)
    scale = statistics.pstdev(rewards) if normalize else 1.0
    return [(r - mean) / scale if scale > 0 else 0.0 for r in rewards]


def rl_datum(
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs: Sequence[float],
    advantage: float,
    routing: Sequence | None = None,
    sequence_ratio: bool = False,
) -> dict:
    """Prompt and completion as one datum: position i predicts token i + 1; only completion tokens carry the
    sampler's logprobs and the advantage (the prompt's positions get 0 and are not trained on). `routing`, the
    sampler's routing trace of the datum's tokens (`routing_trace`), is replayed by the trainer's forward. With
    `sequence_ratio` (GSPO) the completion's tokens are the ones its sequence ratio is taken over."""
    tokens = [*prompt, *completion]
    untrained = [0.0] * (len(prompt) - 1)
    datum = {
        "tokens": tokens[:-1],
        "loss_fn_inputs": {
            "target_tokens": tokens[1:],
            "logprobs": untrained + list(logprobs),
            "advantages": untrained + [advantage] * len(completion),
        },
    }
    if sequence_ratio:
        datum["loss_fn_inputs"]["sequence_ratio_mask"] = untrained + [1.0] * len(completion)
    if routing is not None:
        datum["routing"] = routing
    return datum


def routing_trace(prompt_routing: Sequence, routing: Sequence) -> list:
    """A datum's routing trace from a sample's: the prompt's (whose first entry is None: the first token is scored
    by no forward) after its first entry, then the completion's; one entry per datum token, aligned as its
    logprobs are (entry i: the forward of tokens[i], which scored token i + 1)."""
    return [*prompt_routing[1:], *routing]


def rl_step(
    session: Session,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    reward_fn: RewardFn,
    config: RLConfig,
    step: int,
) -> tuple[StepReport, Weights]:
    """One GRPO step from the sampler's weights (the session's `step`); its report and the weights after it."""
    rng = random.Random(f"{config.seed}:{step}")
    picked = rng.sample(range(len(problems)), min(config.prompts_per_step, len(problems)))
    prompts = [encode_prompt_completion(tokenizer, problems[i].prompt)[0] for i in picked]
    traced = {"return_routing": True, "prompt_routing": True} if config.routing_replay else {}
    began = time.perf_counter()
    pending = [
        sampler.sample(
            prompt,
            config.group_size,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=rng.randrange(2**31),
            **traced,
        )
        for prompt in prompts
    ]
    outs = [future.result(config.timeout) for future in pending]
    sampled = time.perf_counter()
    texts = [[tokenizer.decode(s["tokens"], skip_special_tokens=True) for s in out["sequences"]] for out in outs]
    rewards = score(problems, picked, texts, reward_fn)
    advantage = [a for row in rewards for a in advantages(row, config.normalize_advantages)]
    samples = [(prompt, out, s) for prompt, out in zip(prompts, outs, strict=True) for s in out["sequences"]]
    data = [
        rl_datum(
            p,
            s["tokens"],
            s["logprobs"],
            a,
            routing_trace(out["prompt_routing"], s["routing"]) if traced else None,
            sequence_ratio=config.loss_fn == "gspo",
        )
        for (p, out, s), a in zip(samples, advantage, strict=True)
    ]
    out = session.forward_backward(data, config.loss_fn, config.loss_fn_config).result(config.timeout)
    session.optim_step(learning_rate=config.learning_rate).result(config.timeout)
    trained = time.perf_counter()
    weights = session.save_weights_for_sampler().result(config.timeout)
    synced = time.perf_counter()
    state = None
    if config.save_every and weights.step % config.save_every == 0:
        state = session.save_state(f"step-{weights.step:06d}").result(config.timeout)["state"]
    metrics = out["metrics"]
    report = StepReport(
        step,
        statistics.fmean(r for row in rewards for r in row),
        metrics["loss:sum"],
        sum(len(s["tokens"]) for _, _, s in samples),
        *(metrics[k] for k in ("kl_k1:mean", "kl_k3:mean", "logprob_diff:mean", "logprob_diff:max")),
        metrics["ratio_clip_fraction:mean"],
        sample_seconds=sampled - began,
        train_seconds=trained - sampled,
        sync_seconds=synced - trained,
        state=state,
    )
    return report, weights


def grpo(
    session: Session,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    reward_fn: RewardFn,
    config: RLConfig,
    *,
    resume_from: str | None = None,
    progress: bool = True,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Train `session` by GRPO until it has taken `config.steps` optimizer steps (from a saved state's step with
    `resume_from`, '<session>/<name>'); one report per step, also printed under a progress bar and handed to
    `on_step` (which may raise to stop the run after that step)."""
    if resume_from is not None:
        session.load_state(resume_from).result(config.timeout)
    weights = session.save_weights_for_sampler().result(config.timeout)
    reports: list[StepReport] = []
    bar = tqdm(total=config.steps, initial=weights.step, unit="step", desc="grpo", disable=not progress)
    with bar:
        for step in range(weights.step, config.steps):
            report, weights = rl_step(
                session, session.sampling_client(weights), tokenizer, problems, reward_fn, config, step
            )
            reports.append(report)
            if on_step is not None:
                on_step(report)
            if progress:
                bar.write(report.line(), file=sys.stderr)
            seconds = report.sample_seconds + report.train_seconds + report.sync_seconds
            bar.set_postfix(reward=f"{report.reward:.3f}", kl=f"{report.kl_k3:.1e}", step_s=f"{seconds:.1f}")
            bar.update()
    return reports
