"""Inkling base models: presets, the byte-level tokenizer, and checkpoint directories."""

from inkwell.models.base import (
    BaseModelIdentity,
    base_model_identity,
    base_model_name,
    check_base_model,
    config_identity,
    init_base_model,
    load_base_model,
    load_base_weights,
)
from inkwell.models.checkpoint import BaseCheckpoint
from inkwell.models.config import BaseModelError, load_base_config
from inkwell.models.names import installed_weight_names
from inkwell.models.presets import PRESETS, preset_config
from inkwell.models.tokenizer import encode_chat, encode_prompt_completion, load_tokenizer, stop_token_ids

__all__ = [
    "PRESETS",
    "BaseCheckpoint",
    "BaseModelError",
    "BaseModelIdentity",
    "base_model_identity",
    "base_model_name",
    "check_base_model",
    "config_identity",
    "encode_chat",
    "encode_prompt_completion",
    "init_base_model",
    "installed_weight_names",
    "load_base_config",
    "load_base_model",
    "load_base_weights",
    "load_tokenizer",
    "preset_config",
    "stop_token_ids",
]
