"""The `inkwell` command line: each area mounts its own typer app here."""

import typer

from inkwell.models.cli import app as models_app

app = typer.Typer(help="inkwell: LoRA fine-tuning and multi-adapter serving for Inkling models.", no_args_is_help=True)
app.add_typer(models_app, name="models")
from inkwell.sdk.cli import adapters_app, datasets_app, jobs_app, sessions_app  # noqa: E402

app.add_typer(jobs_app, name="jobs")
app.add_typer(datasets_app, name="datasets")
app.add_typer(adapters_app, name="adapters")
app.add_typer(sessions_app, name="sessions")
from inkwell.service.cli import register as register_service  # noqa: E402

register_service(app)  # `inkwell serve`, `inkwell worker`, `inkwell admin ...`
from inkwell.trainer.cli import train_command  # noqa: E402

app.command("train")(train_command)

if __name__ == "__main__":
    app()
