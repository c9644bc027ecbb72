"""Tinker's LoraConfig as inkwell's LoRA spec: what each train_* flag adapts, and refusals that name the field."""

import pytest
from tinker import types

from inkwell.service.errors import APIError
from inkwell.service.tinker.door import LORA_ALPHA, lora_spec


def test_flags_choose_the_targets():
    spec = lora_spec(types.LoraConfig(rank=4, train_attn=False, train_mlp=True, train_unembed=True))
    assert (spec.rank, spec.alpha) == (4, LORA_ALPHA)
    assert spec.targets == ("mlp", "experts", "shared_experts", "lm_head")
    assert lora_spec(None).rank == 32  # the client's default config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (types.LoraConfig(rank=0), "lora_config.rank: Input should be greater than or equal to 1"),
        (types.LoraConfig(rank=4096), "lora_config.rank: Input should be less than or equal to 256"),
        (
            types.LoraConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=False),
            "lora_config: train_attn, train_mlp and train_unembed are all false; set at least one",
        ),
    ],
)
def test_refusals_name_the_field(config, message):
    with pytest.raises(APIError) as err:
        lora_spec(config)
    assert (err.value.status, err.value.code, err.value.message) == (400, "validation_error", message)
