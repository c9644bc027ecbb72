"""Inkling base models: presets, the byte-level tokenizer, and checkpoint directories.

The names below load their module on first use (PEP 562): most of them need transformers, which imports torch
(seconds), and the `inkwell` command line reaches this package for preset names alone.
"""

import importlib
from typing import Any

# Each public name and the module of this package that defines it.
_HOMES = {
    "BaseModelIdentity": "base",
    "base_model_identity": "base",
    "base_model_name": "base",
    "check_base_model": "base",
    "config_identity": "base",
    "init_base_model": "base",
    "load_base_model": "base",
    "load_base_weights": "base",
    "BaseCheckpoint": "checkpoint",
    "BaseModelError": "config",
    "load_base_config": "config",
    "installed_weight_names": "names",
    "PRESETS": "presets",
    "preset_config": "presets",
    "encode_chat": "tokenizer",
    "encode_prompt_completion": "tokenizer",
    "load_tokenizer": "tokenizer",
    "stop_token_ids": "tokenizer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
