"""inkwell end to end on one machine: train two LoRA adapters, publish them, serve them mixed, then RL.

Starts the embedded service (SQLite + SeaweedFS + a job worker + the CPU serving tier) in a
fresh data directory, then uses only the public SDK and the `openai` client: trains one adapter
per task on `inkling-tiny`, waits with progress bars, and sends held-out prompts for both tasks
to the base model and to each adapter in one mixed batch. It prints a per-task accuracy table
and writes a loss-curve PNG per job. Then it runs GRPO on a training session (`inkwell.recipes.rl`)
on the bundled `letter-case` task, printing reward and KL per step and writing a reward PNG. It stops
everything it started on exit, Ctrl-C included.
"""

import argparse
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from openai import OpenAI  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedded import EmbeddedService, free_port  # noqa: E402
from tasks import TASKS, Example, is_correct, make_split  # noqa: E402

from inkwell import sdk, terminal  # noqa: E402
from inkwell.models import load_tokenizer  # noqa: E402
from inkwell.recipes.rl import StepReport, grpo  # noqa: E402
from inkwell.recipes.tasks import TASKS as RL_TASKS  # noqa: E402
from inkwell.trainer.verifiers import verifier  # noqa: E402

BASE = "inkling-tiny"
console = terminal.console()


def to_records(examples: list[Example]) -> list[dict]:
    return [{"prompt": e.prompt, "completion": e.completion} for e in examples]


def plot_rewards(reports: list[StepReport], title: str, path: Path) -> None:
    """Mean reward per GRPO step."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r.step for r in reports], [r.reward for r in reports], "o-", markersize=3)
    ax.set(xlabel="step", ylabel="mean reward", ylim=(-0.02, 1.02), title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_grpo(client: sdk.Client, model_dir: Path, png: Path, steps: int | None) -> bool:
    """GRPO on the bundled `letter-case` task from a fresh adapter, for `steps` steps (None: the task's); whether it
    raised the reward by 0.3 or more: the best mean of 3 steps in a row after the first 3 against the first 3 (the
    policy before its updates show). Not the last steps' mean: at the task's learning rate a run can fall back for a
    few steps after it has learned (`recipes.tasks` says how often), which a last-10 mean counts as not learning."""
    task = RL_TASKS["letter-case"]
    if steps is not None:
        task = replace(task, config=replace(task.config, steps=steps))
    problems = task.problems()
    example = escape(f"{problems[0].prompt!r} -> {problems[0].answer!r}")
    console.print(
        f"GRPO on [bold]{task.name}[/] ({len(problems)} prompts such as {example}, verifier {task.verifier}): "
        f"{task.config.steps} steps of {task.config.prompts_per_step} prompts x {task.config.group_size} samples"
    )
    began = time.monotonic()
    with client.sessions.create(BASE, lora=task.lora, seed=task.config.seed, adapter_name=task.name) as session:
        reports = grpo(session, load_tokenizer(model_dir), problems, verifier(task.verifier), task.config)
    rewards = [r.reward for r in reports]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-10:])
    after = rewards[3:] or rewards  # (a run of 3 steps or fewer has nothing after its first 3)
    best = max(statistics.fmean(after[i : i + 3]) for i in range(max(1, len(after) - 2)))
    plot_rewards(reports, f"GRPO on {task.name} ({session.id})", png)
    console.print(
        f"  mean reward {first:.2f} over the first 3 steps, {best:.2f} over the best 3 after them, {last:.2f} over "
        f"the last 10, in {time.monotonic() - began:.0f} s with the session's start; reward curve: {png}"
    )
    return best >= first + 0.3


def evaluate(openai: OpenAI, models: list[str], held_out: dict[str, list[Example]]) -> dict:
    """Accuracy per (model, task), every request sent at once so the server batches them mixed."""
    requests = [(model, task, ex) for task, exs in held_out.items() for ex in exs for model in models]

    def ask(item):
        model, task, ex = item
        out = openai.completions.create(model=model, prompt=ex.prompt, max_tokens=10, temperature=0)
        return model, task, is_correct(ex, out.choices[0].text)

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(ask, requests))
    return {
        (model, task): sum(ok for m, t, ok in results if (m, t) == (model, task)) / len(held_out[task])
        for model in models
        for task in held_out
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".demo"), help="everything the demo writes")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per adapter")
    parser.add_argument("--train-examples", type=int, default=600)
    parser.add_argument("--eval-examples", type=int, default=40, help="held-out prompts per task")
    parser.add_argument("--min-accuracy", type=float, default=0.8, help="an adapter must reach this on its task")
    parser.add_argument("--grpo-steps", type=int, help="GRPO steps (default: the letter-case task's)")
    args = parser.parse_args()

    workdir = args.workdir.resolve()
    shutil.rmtree(workdir / "service", ignore_errors=True)  # a fresh service every run
    (workdir / "service").mkdir(parents=True)
    service = EmbeddedService(workdir / "service", free_port(), workdir / "service.log")

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    try:
        console.rule("[bold]inkwell demo")
        console.print(f"starting the embedded service at {service.url} (log: {service.log_path})")
        key = service.start()
        console.print(f"web console while the demo runs: [bold]{service.url}/console/[/] (log in with the key {key})")
        client = sdk.Client(service.url, key)
        splits = {
            task: make_split(task, args.train_examples + args.eval_examples, seed=i) for i, task in enumerate(TASKS)
        }
        held_out = {task: exs[args.train_examples :] for task, exs in splits.items()}
        jobs = {}
        for task, examples in splits.items():
            jobs[task] = client.train(
                BASE,
                to_records(examples[: args.train_examples]),
                lora={"rank": 16, "alpha": 32, "targets": ["attn", "mlp", "experts", "shared_experts", "lm_head"]},
                adapter_name=task,
                wait=False,
                max_steps=args.steps,
                learning_rate=3e-3,
                batch_size=8,
                seq_len=256,
                warmup_steps=5,
                eval_every=20,
                eval_fraction=0.1,
            )
            console.print(f"submitted job {jobs[task].id}: adapter [bold]{task}[/]")
        for task, job in jobs.items():
            console.print(f"training [bold]{task}[/] ({job.id})")
            job.wait(progress=True)
            console.print(f"  published {task} version {job.adapter.version}")
            console.print(f"  loss curve: {job.plot(workdir)['loss']}")

        openai = OpenAI(base_url=f"{service.url}/v1", api_key=key)
        models = [BASE] + [f"{BASE}:{task}" for task in TASKS]
        console.print(f"asking {len(models)} models {sum(map(len, held_out.values()))} held-out prompts each, mixed")
        accuracy = evaluate(openai, models, held_out)
        table = Table(title="held-out accuracy (exact match)")
        table.add_column("model")
        for task in TASKS:
            table.add_column(task, justify="right")
        for model in models:
            table.add_row(model, *(f"{accuracy[(model, task)]:.0%}" for task in TASKS))
        console.print(table)
        sample = held_out["sentiment"][0]
        for model in models:
            text = openai.completions.create(model=model, prompt=sample.prompt, max_tokens=10, temperature=0)
            console.print(f"{model:>24} | {sample.prompt.splitlines()[0]!r} -> {text.choices[0].text!r}")
        ok = all(
            accuracy[(f"{BASE}:{task}", task)] >= args.min_accuracy
            and accuracy[(f"{BASE}:{task}", task)] > accuracy[(BASE, task)] + 0.3
            and all(
                accuracy[(f"{BASE}:{task}", task)] > accuracy[(f"{BASE}:{o}", task)] + 0.3 for o in TASKS if o != task
            )
            for task in TASKS
        )
        console.print("[green]each adapter does its own task[/]" if ok else "[red]an adapter did not learn its task[/]")

        console.rule("[bold]RL on a training session")
        rl_ok = run_grpo(client, workdir / "service" / "models" / BASE, workdir / "grpo-reward.png", args.grpo_steps)
        console.print("[green]GRPO raised the reward[/]" if rl_ok else "[red]GRPO did not raise the reward[/]")
        return 0 if ok and rl_ok else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping the service[/]")
        return 130
    finally:
        service.stop()


if __name__ == "__main__":
    sys.exit(main())
