"""`inkwell train --config job.yaml|json`: run an SFT job with a progress bar."""

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from inkwell import terminal
from inkwell.trainer.config import TrainCallbacks, TrainConfigError, TrainEvent, TrainingCancelled, load_job_config

console = terminal.console()


class ProgressCallbacks(TrainCallbacks):
    """Advance a rich progress bar with loss, lr and throughput; note checkpoints."""

    def __init__(self, progress: Progress, task, console: Console):
        self.progress, self.task, self.console = progress, task, console

    def on_event(self, event: TrainEvent) -> None:
        note = f"loss {event.loss:.4f}  lr {event.lr:.2e}  {event.tokens_per_s:,.0f} tok/s"
        if event.eval_loss is not None:
            self.console.print(f"step {event.step}: eval loss {event.eval_loss:.4f}")
        self.progress.update(self.task, completed=event.step, total=event.total_steps, note=note)

    def on_checkpoint(self, step: int, path: Path) -> None:
        terminal.print_plain(self.console, f"step {step}: checkpoint {path}")


def train_command(
    config: Path = typer.Option(
        ..., "--config", "-c", help="job file (.yaml/.yml or .json) with TrainJobConfig fields"
    ),
) -> None:
    """Train a LoRA adapter (SFT) and export it in the sglang and peft layouts."""
    try:
        job = load_job_config(config)
    except TrainConfigError as exc:
        terminal.print_error(console, str(exc))
        raise typer.Exit(2) from exc
    from inkwell.trainer.api import train  # megatron-core loads only when a job really runs: not for a bad file

    columns = (TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TextColumn("{task.fields[note]}"), TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("train", total=job.max_steps, note="starting")
        try:
            result = train(job, ProgressCallbacks(progress, task, console))
        except TrainConfigError as exc:
            progress.stop()  # the bar's last state, then the reason as the last line
            terminal.print_error(console, str(exc))
            raise typer.Exit(2) from exc
        except TrainingCancelled as exc:
            progress.stop()
            terminal.print_plain(console, str(exc), "yellow")
            raise typer.Exit(130) from exc
    console.print(
        f"done: {result.steps} steps, loss {result.first_loss:.4f} -> {result.final_loss:.4f}"
        + (f", eval {result.initial_eval_loss:.4f} -> {result.final_eval_loss:.4f}" if result.final_eval_loss else "")
    )
    for layout, path in result.adapter_dirs.items():
        terminal.print_plain(console, f"adapter ({layout}): {path}")
