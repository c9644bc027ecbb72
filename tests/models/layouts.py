"""A base model rewritten in each of the ways checkpoints come: transformers' or the released tensor names, one
file or 3 shards with an index, a text config or the multimodal one (with small vision and audio tower tensors)."""

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inkwell.models import load_base_weights, load_tokenizer
from inkwell.models.released import ReleasedWeights, released_config
from inkwell.models.shards import INDEX_FILE, WEIGHTS_FILE, write_shards

SMALL_TOWERS = {  # what transformers builds for these in a second, for the configs' sake
    "vision_config": {"patch_size": 2, "temporal_patch_size": 2, "num_hidden_layers": 3},
    "audio_config": {"n_mel_bins": 4, "mel_vocab_size": 4},
}
TOWERS = {  # a few tower tensors (of those configs' shapes) under each format's names: the loader must skip them
    "released": {"model.visual.layers.linear_0.weight": (64, 12), "model.audio.final_norm.weight": (128,)},
    "transformers": {
        "model.vision_tower.encoder_layers.0.projection.weight": (64, 12),
        "model.audio_tower.norm.weight": (128,),
    },
}


@dataclass(frozen=True)
class Layout:
    names: str  # "transformers" | "released"
    shards: int  # 1 | 3
    config: str  # "text" | "multimodal"

    @property
    def id(self) -> str:
        return f"{self.names}-{self.shards}-{self.config}"


LAYOUTS = [Layout(*combo) for combo in itertools.product(("transformers", "released"), (1, 3), ("text", "multimodal"))]


def write_layout(source: Path, out: Path, layout: Layout) -> Path:
    """`source` (a transformers-format, one-file, text-config base model) rewritten in `layout` under `out`."""
    out.mkdir(parents=True)
    weights = load_base_weights(source)
    text = json.loads((source / "config.json").read_text())
    multimodal = layout.config == "multimodal"
    if layout.names == "released":
        tensors = dict(ReleasedWeights(weights))
        config = {**released_config(weights.config), **SMALL_TOWERS} if multimodal else text
    else:  # the multimodal model nests the language model (`save_pretrained(save_original_format=False)`)
        nest = "model.language_model." if multimodal else "model."
        tensors = {name.replace("model.", nest, 1): tensor for name, tensor in weights.items()}
        config = {"model_type": "inkling_mm_model", "text_config": text, **SMALL_TOWERS} if multimodal else text
    if multimodal:
        tensors |= {name: torch.ones(shape) for name, shape in TOWERS[layout.names].items()}
    write_shards(tensors, out, layout.shards)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    load_tokenizer(source).save_pretrained(str(out))
    return out


def file_of(model_dir: Path, name: str) -> Path:
    """The weight file holding stored tensor `name`."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return model_dir / WEIGHTS_FILE
    return model_dir / json.loads(index.read_text())["weight_map"][name]
