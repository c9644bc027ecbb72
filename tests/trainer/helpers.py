"""Inputs shared by the trainer tests: a slice of the bundled `reverse` data and a short job on it."""

from pathlib import Path

from inkwell.trainer.dataset import bundled_dataset


def reverse_sample(path: Path, lines: int) -> Path:
    """The first `lines` examples of the bundled `reverse` dataset at `path` (written only if it is missing)."""
    if not path.exists():
        path.write_text("".join(bundled_dataset("reverse").read_text().splitlines(keepends=True)[:lines]))
    return path


def tiny_job(base: Path, data: Path, output: Path, **fields) -> dict:
    """A rank-2 LoRA job on `data` in batches of 2 sequences of 64 tokens, with `fields` added."""
    return {
        "base_model_dir": str(base),
        "dataset_path": str(data),
        "output_dir": str(output),
        "lora": {"rank": 2, "alpha": 4},
        "batch_size": 2,
        "seq_len": 64,
        **fields,
    }
