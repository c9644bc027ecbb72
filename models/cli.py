"""`inkwell models ...`: create and inspect Inkling base-model checkpoints.

What needs torch is imported by the command that uses it: every `inkwell` command loads this module.
"""

from pathlib import Path

import typer

from inkwell import terminal
from inkwell.models import PRESETS

app = typer.Typer(help="Create and inspect Inkling base models.", no_args_is_help=True)
console = terminal.console()


@app.command("init")
def init(
    preset: str = typer.Argument(..., help=f"one of: {', '.join(PRESETS)}"),
    out_dir: Path = typer.Argument(..., help="directory to write config.json, weights and tokenizer to"),
    seed: int = typer.Option(0, help="weights are a deterministic function of the seed"),
    name: str = typer.Option(None, help="name recorded in config.json (default: the preset)"),
    overwrite: bool = typer.Option(False, help="write into OUT_DIR even when it holds files"),
) -> None:
    """Write a deterministic HF-format checkpoint of a preset."""
    if preset not in PRESETS:
        terminal.print_error(console, f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        raise typer.Exit(2)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:  # a checkpoint there would be replaced
        terminal.print_error(console, f"{out_dir} is not empty; choose another directory or pass --overwrite")
        raise typer.Exit(2)
    if out_dir.exists() and not out_dir.is_dir():
        terminal.print_error(console, f"{out_dir} is a file; give a directory")
        raise typer.Exit(2)
    from inkwell.models import init_base_model

    path = init_base_model(preset, out_dir, seed=seed, name=name)
    terminal.print_plain(console, f"wrote {preset} (seed {seed}) to {path}")


@app.command("show")
def show(model_dir: Path) -> None:
    """Print a base model's identity and shape."""
    from inkwell.models import BaseModelError, base_model_identity, load_base_config

    try:
        config = load_base_config(model_dir)
        identity = base_model_identity(model_dir)
    except BaseModelError as exc:
        terminal.print_error(console, str(exc))
        raise typer.Exit(2) from exc
    console.print(f"{identity.name}  config sha256 {identity.config_sha256[:16]}…")
    console.print(
        f"hidden {config.hidden_size}, layers {config.num_hidden_layers}, "
        f"experts {config.n_routed_experts} (top {config.num_experts_per_tok}) + {config.n_shared_experts} shared"
    )
