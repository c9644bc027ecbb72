"""Check an adapter against the base model it will be applied to, before any tensor is used."""

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.errors import (
    BaseModelMismatchError,
    MissingModuleError,
    NonFiniteError,
    RankLimitError,
    ShapeMismatchError,
    UnknownModuleError,
)
from inkwell.adapters.spec import MAX_RANK
from inkwell.adapters.targets import model_targets
from inkwell.models.base import BaseModelIdentity


def validate(
    adapter: Adapter,
    config: InklingTextConfig,
    base: BaseModelIdentity | None = None,
    max_rank: int = MAX_RANK,
) -> None:
    """Raise the AdapterError subclass for the first problem found; return None if usable."""
    if base is not None and adapter.base.config_sha256 != base.config_sha256:
        raise BaseModelMismatchError(
            f"adapter was trained on base model {adapter.base.name!r} (config {adapter.base.config_sha256[:12]}), "
            f"not {base.name!r} (config {base.config_sha256[:12]}); use it with its own base model"
        )
    for group in adapter.spec.targets:
        if adapter.spec.rank_for(group) > max_rank:
            raise RankLimitError(
                f"group {group!r} has rank {adapter.spec.rank_for(group)}, over this server's limit {max_rank}; "
                "retrain with a smaller rank or raise the limit"
            )
    expected = {
        f"{target.module}.{factor}": (shape, target.group)
        for target in model_targets(config, adapter.spec)
        for factor, shape in target.shapes(adapter.spec.rank_for(target.group)).items()
    }
    for name in adapter.tensors:
        if name not in expected:
            raise UnknownModuleError(
                f"tensor {name!r} is not a LoRA target of this Inkling model for targets "
                f"{list(adapter.spec.targets)}; remove it or fix its name",
                name,
            )
    for name, (shape, group) in expected.items():
        if name not in adapter.tensors:
            raise MissingModuleError(
                f"tensor {name!r} is missing; an adapter targeting {list(adapter.spec.targets)} needs every "
                "module of those groups",
                name,
            )
        tensor = adapter.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ShapeMismatchError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} for rank "
                f"{adapter.spec.rank_for(group)}; was it trained on another base model?",
                name,
            )
        if not torch.isfinite(tensor).all():
            raise NonFiniteError(f"tensor {name!r} contains NaN or Inf; the training run diverged", name)
