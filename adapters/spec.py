"""What a LoRA adapter adapts: rank, alpha, dropout and the target groups of an Inkling model."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TargetGroup = Literal["attn", "mlp", "experts", "shared_experts", "lm_head"]
TARGET_GROUPS: tuple[str, ...] = ("attn", "mlp", "experts", "shared_experts", "lm_head")
DEFAULT_TARGETS: tuple[str, ...] = ("attn", "mlp", "experts", "shared_experts")
MAX_RANK = 256


class LoraSpec(BaseModel):
    """LoRA hyper-parameters. `ranks` overrides `rank` per group; scaling is alpha / rank."""

    # No NaN or infinity: an infinite alpha passes `gt=0` and PostgreSQL's JSON refuses it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rank: int = Field(16, ge=1, le=MAX_RANK, description="rank r of every target group")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: delta = alpha / r * B @ A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: tuple[TargetGroup, ...] = Field(DEFAULT_TARGETS, min_length=1)
    ranks: dict[TargetGroup, int] = Field(default_factory=dict, description="per-group rank overrides")

    @field_validator("targets", mode="before")
    @classmethod
    def _known_targets(cls, value):
        # A list only: a bare string would otherwise be read as one group (or, by pydantic, as its characters),
        # and null or a number reached the loop below as a TypeError, a 500 in the API.
        if isinstance(value, str):
            raise ValueError(f"targets must be a list of target groups, e.g. [{value!r}], not a bare string")
        if not isinstance(value, list | tuple):
            raise ValueError(f"targets must be a list of target groups from {', '.join(TARGET_GROUPS)}")
        for group in value:
            if group not in TARGET_GROUPS:
                raise ValueError(f"unknown target group {group!r}; choose from {', '.join(TARGET_GROUPS)}")
        return tuple(dict.fromkeys(value))

    @model_validator(mode="after")
    def _ranks_legal(self):
        for group, r in self.ranks.items():
            if group not in self.targets:
                raise ValueError(f"ranks[{group!r}] is set but {group!r} is not in targets")
            if not 1 <= r <= MAX_RANK:
                raise ValueError(f"ranks[{group!r}] = {r}: a rank must be between 1 and {MAX_RANK}")
        return self

    def rank_for(self, group: str) -> int:
        return self.ranks.get(group, self.rank)

    def scaling_for(self, group: str) -> float:
        return self.alpha / self.rank_for(group)

    @property
    def max_rank(self) -> int:
        return max(self.rank_for(g) for g in self.targets)
