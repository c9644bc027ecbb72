"""Everything checked before training starts, so bad input fails fast with the field or line named."""

from dataclasses import dataclass, field

import torch
from transformers import InklingTextConfig

from inkwell.models import BaseModelError, BaseModelIdentity, base_model_identity, load_base_config, load_tokenizer
from inkwell.trainer import checkpoint as ckpt
from inkwell.trainer.config import TrainConfigError, TrainJobConfig
from inkwell.trainer.dataset import Example, load_examples, split_eval
from inkwell.trainer.model import layout_problem


@dataclass
class Prepared:
    hf_config: InklingTextConfig
    identity: BaseModelIdentity
    pad_id: int
    train: list[Example]
    eval: list[Example]
    resume_meta: dict | None = field(default=None)


def _check_layout(config: TrainJobConfig, hf: InklingTextConfig) -> None:
    problem = layout_problem(hf, config.tp, config.ep)
    if problem:
        raise TrainConfigError(problem[1], field=problem[0])
    if hf.unpadded_vocab_size is not None and hf.unpadded_vocab_size < hf.vocab_size:
        raise TrainConfigError(
            "base_model_dir: models with unpadded_vocab_size < vocab_size are not supported by the trainer",
            field="base_model_dir",
        )
    if config.device == "cuda" and torch.cuda.device_count() < config.nproc:
        raise TrainConfigError(
            f"device: cuda needs {config.nproc} GPU(s), this host has {torch.cuda.device_count()}", field="device"
        )


def prepare(config: TrainJobConfig) -> Prepared:
    """Load and validate the base model, datasets, layout and resume checkpoint; raise TrainConfigError."""
    try:
        hf = load_base_config(config.base_model_dir)
        identity = base_model_identity(config.base_model_dir)
        tokenizer = load_tokenizer(config.base_model_dir)
    except (BaseModelError, OSError) as exc:
        raise TrainConfigError(f"base_model_dir: {exc}", field="base_model_dir") from exc
    if config.seq_len > hf.max_position_embeddings:
        raise TrainConfigError(
            f"seq_len: {config.seq_len} exceeds the model's max_position_embeddings ({hf.max_position_embeddings})",
            field="seq_len",
        )
    _check_layout(config, hf)
    limits = {"seq_len": config.seq_len, "max_positions": hf.max_position_embeddings}
    examples = load_examples(config.dataset_path, tokenizer, field="dataset_path", **limits)
    if config.eval_dataset_path is not None:
        train, held = examples, load_examples(config.eval_dataset_path, tokenizer, field="eval_dataset_path", **limits)
    else:
        train, held = split_eval(examples, config.eval_fraction, config.seed)
    adapters = config.output_dir / "adapters"
    if adapters.exists():
        raise TrainConfigError(
            f"output_dir: {adapters} already exists (a finished run); choose a new output_dir", field="output_dir"
        )
    resume_meta = None
    if config.resume_from is not None:
        resume_meta = ckpt.read_meta(config.resume_from)
        ckpt.check_compatible(resume_meta, identity, config.lora.model_dump(mode="json"))
        if resume_meta["step"] >= config.max_steps:
            raise TrainConfigError(
                f"resume_from: checkpoint is at step {resume_meta['step']}, max_steps is {config.max_steps}",
                field="resume_from",
            )
    return Prepared(hf, identity, tokenizer.pad_token_id, train, held, resume_meta)
