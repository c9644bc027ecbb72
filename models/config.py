"""A base model's `config.json`: transformers' `InklingTextConfig`, or the released multimodal config around it.

Inkling is published as `InklingForConditionalGeneration` (model_type `inkling_mm_model`): the language model's
fields sit under `text_config`, beside vision and audio towers that inkwell neither trains nor serves. Either way
the result is the `InklingTextConfig` every other part of inkwell reads; transformers maps the released field
names (`local_layer_ids`, `dense_mlp_idx`, `dense_intermediate_size`, `sconv_kernel_size`) itself.
"""

import json
from pathlib import Path

from transformers import InklingTextConfig

CONFIG_FILE = "config.json"
TEXT_MODEL_TYPE = "inkling_text"
MULTIMODAL_MODEL_TYPE = "inkling_mm_model"
# Without these transformers falls back to the released 200B model's geometry, and every tensor looks misshapen.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_NOT_CONFIG = {"inkwell_name", "transformers_version"}


class BaseModelError(ValueError):
    """A base-model directory that cannot be used, with what to do about it."""


def read_config_json(model_dir: str | Path) -> dict:
    """config.json as a dict, or a BaseModelError naming the file."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise BaseModelError(
            f"{path}: missing; a base model directory needs {CONFIG_FILE} "
            f"(create one with `inkwell models init inkling-tiny DIR`)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BaseModelError(f"{path}: not valid JSON ({exc}); restore the file from the checkpoint") from exc
    if not isinstance(data, dict):
        raise BaseModelError(f"{path}: not a JSON object; restore the file from the checkpoint")
    return data


def is_multimodal(data: dict) -> bool:
    return data.get("model_type") == MULTIMODAL_MODEL_TYPE


def load_base_config(model_dir: str | Path) -> InklingTextConfig:
    """The (text) config of a base-model directory, or a BaseModelError saying what is wrong."""
    path = Path(model_dir) / CONFIG_FILE
    data = read_config_json(model_dir)
    model_type = data.get("model_type")
    if model_type == MULTIMODAL_MODEL_TYPE:
        data = data.get("text_config")
        if not isinstance(data, dict):
            raise BaseModelError(f"{path}: an {MULTIMODAL_MODEL_TYPE} config without a text_config object")
        where = "text_config"
    elif model_type == TEXT_MODEL_TYPE:
        where = "config"
    else:
        raise BaseModelError(
            f"{path}: model_type is {model_type!r}, not {TEXT_MODEL_TYPE!r} or {MULTIMODAL_MODEL_TYPE!r}; "
            "inkwell serves and trains Inkling models only"
        )
    absent = [key for key in REQUIRED_FIELDS if key not in data]
    if absent:
        raise BaseModelError(f"{path}: the {where} lacks {', '.join(absent)}")
    try:
        return InklingTextConfig(**{k: v for k, v in data.items() if k not in _NOT_CONFIG | {"model_type"}})
    except (TypeError, ValueError) as exc:
        raise BaseModelError(f"{path}: the {where} is not a valid InklingTextConfig ({exc})") from exc
