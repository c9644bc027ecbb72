"""A base model in the released Inkling checkpoint format, the only one SGLang 0.5.23 loads.

SGLang's `InklingForConditionalGeneration` reads an `inkling_mm_model` config with a `text_config` in its own
field names and weights under the released names (`model.llm.layers.N.attn.wq_du`, interleaved `w13` expert
weights, ...). `inkwell.models.released` holds that mapping (the one the base-model loader reads released
checkpoints with); this writes any base model through it, shard by shard, so transformers loading the written
directory gets back exactly the weights we started from.
"""

import json
import math
from pathlib import Path

from inkwell.models import load_base_weights, load_tokenizer
from inkwell.models.released import ReleasedWeights, released_config
from inkwell.models.shards import write_shards

SHARD_BYTES = 4 << 30  # about this much per shard (write_shards splits the tensors evenly by count)


def write_sglang_checkpoint(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write base model `model_dir` as a released-format checkpoint SGLang can load (with its tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = load_base_weights(model_dir)
    (out / "config.json").write_text(json.dumps(released_config(weights.config), indent=2) + "\n")
    write_shards(ReleasedWeights(weights), out, shards=math.ceil(weights.nbytes / SHARD_BYTES))
    load_tokenizer(model_dir).save_pretrained(str(out))
    return out
