"""`LoraSpec` refuses what is not a spec with a ValidationError naming the field (the API's 422), never a
TypeError from inside a validator (the API's 500): targets that are not a list, non-finite alpha or dropout."""

import pytest
from pydantic import ValidationError

from inkwell.adapters.spec import TARGET_GROUPS, LoraSpec


@pytest.mark.parametrize(
    "targets, says",
    [
        (None, "must be a list"),
        (5, "must be a list"),
        ({"attn": 1}, "must be a list"),
        ("attn", "not a bare string"),
        ("attn,mlp", "not a bare string"),
    ],
    ids=["null", "number", "mapping", "bare-string", "comma-string"],
)
def test_targets_must_be_a_list(targets, says):
    with pytest.raises(ValidationError, match=says) as info:
        LoraSpec(targets=targets)
    assert info.value.errors()[0]["loc"] == ("targets",)


def test_lists_and_tuples_of_groups_still_work():
    assert LoraSpec(targets=["attn", "mlp", "attn"]).targets == ("attn", "mlp")
    assert LoraSpec(targets=tuple(TARGET_GROUPS)).targets == TARGET_GROUPS
    spec = LoraSpec(targets=["experts"], ranks={"experts": 4})
    assert LoraSpec.model_validate_json(spec.model_dump_json()) == spec  # what manifests hold reads back


@pytest.mark.parametrize("field", ["alpha", "dropout"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(ValidationError) as info:
        LoraSpec(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)
