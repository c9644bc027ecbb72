"""The tensor names every inkwell model uses (transformers 5.19's `InklingForCausalLM`), and what a config expects.

Checkpoints spell some of them differently: transformers 5.17 keeps the embedding norm beside the embedding, and
transformers' multimodal `InklingForConditionalGeneration` (saved with `save_original_format=False`) nests the
language model under `model.language_model`. Tensors of the towers inkwell does not run are ignored.
"""

from collections.abc import Mapping

import torch
from transformers import InklingForCausalLM, InklingTextConfig

_RENAMED = {"model.embed_norm.weight": "model.embed_tokens.embed_norm.weight"}  # transformers 5.17
NESTED_PREFIX = "model.language_model."  # the multimodal model's language model
# Prefixes of the parts of a released checkpoint that are not the language model, in transformers' and the
# released names: what they are, for the message saying they were ignored.
IGNORED = {
    "model.vision_tower.": "vision tower",
    "model.visual.": "vision tower",
    "model.audio_tower.": "audio tower",
    "model.audio.": "audio tower",
    "model.mtp.": "multi-token-prediction layers",
}


def canonical_name(name: str) -> str:
    """A transformers-format checkpoint's tensor name under the names every inkwell model uses."""
    if name.startswith(NESTED_PREFIX):
        name = "model." + name[len(NESTED_PREFIX) :]
    return _RENAMED.get(name, name)


def spellings(name: str) -> list[str]:
    """Every name `canonical_name` maps to canonical `name` (itself first): how a checkpoint may store it."""
    names = [name] + [old for old, new in _RENAMED.items() if new == name]
    return names + [NESTED_PREFIX + n.removeprefix("model.") for n in names if n.startswith("model.")]


def ignored_part(name: str) -> str | None:
    """What `name` belongs to when it is part of a tower (or MTP layers) inkwell does not run; None otherwise."""
    return next((part for prefix, part in IGNORED.items() if name.startswith(prefix)), None)


def expected_tensors(config: InklingTextConfig) -> dict[str, torch.Size]:
    """Every tensor of the text model `config` describes, by canonical name, with its shape (transformers decides)."""
    with torch.device("meta"):
        model = InklingForCausalLM(config)
    return {canonical_name(name): tensor.shape for name, tensor in model.state_dict().items()}


def installed_weight_names(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of canonical names under the names `model` (the installed transformers) expects."""
    expected = model.state_dict().keys()
    back = {new: old for old, new in _RENAMED.items() if old in expected and new not in expected}
    return {back.get(name, name): tensor for name, tensor in state.items()}
