"""What one rank of a tensor- and expert-parallel engine holds: its slices of the base weights and of each adapter.

The group has `tp * ep` ranks, rank = ep_rank * tp + tp_rank. Attention is split by heads over the TP ranks: the
fused q/k/v/r projection keeps each rank's heads (so its K/V ShortConv channels are that rank's own) and the output
projection its input columns, whose partial sums the group adds up. The dense MLP is column- then row-parallel over
TP. Routed experts are split over the EP ranks by id, and so are the shared experts (the engine runs them as experts
after the routed ones); every expert's intermediate size is split over TP. Everything else (embedding, norms, router,
the attention and MLP ShortConvs on the hidden stream, the LM head) is whole on every rank.

A LoRA factor is split the way its base weight is: B on the output rows of a column-parallel weight, A on the input
columns of a row-parallel one, expert factors on the expert and intermediate dims; the other factor is whole. Then
each rank's delta is exactly its share of the full one, and the same sums add them up.
"""

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.models.checkpoint import TP_SIZES, BaseCheckpoint, Cut, shard_index

# Which dims of a tensor (by the end of its canonical name) are split over TP and over EP; unlisted ones are whole.
BASE_SPLITS: list[tuple[str, dict[str, int]]] = [
    (r"self_attn\.[qkvr]_proj\.weight$", {"tp": 0}),
    (r"self_attn\.o_proj\.weight$", {"tp": 1}),
    (r"self_attn\.[kv]_sconv\.conv1d\.weight$", {"tp": 0}),
    (r"mlp\.(gate|up)_proj\.weight$", {"tp": 0}),
    (r"mlp\.down_proj\.weight$", {"tp": 1}),
    (r"experts\.(gate|up)_proj$", {"ep": 0, "tp": 1}),  # the shared experts' [n, F, H]
    (r"experts\.down_proj$", {"ep": 0, "tp": 2}),
]
# The config's sizes that a rank holds a part of over the EP ranks (over the TP ranks: TP_SIZES).
EP_SIZES = ("n_routed_experts", "n_shared_experts")
FUSED_GATE_UP = re.compile(r"mlp\.experts\.gate_up_proj$")  # [E, 2F, H]: gate rows, then up rows
ADAPTER_SPLITS: list[tuple[str, dict[str, int]]] = [
    (r"self_attn\.[qkvr]_proj\.lora_B$", {"tp": 0}),
    (r"self_attn\.o_proj\.lora_A$", {"tp": 1}),
    (r"mlp\.(gate|up)_proj\.lora_B$", {"tp": 0}),
    (r"mlp\.down_proj\.lora_A$", {"tp": 1}),
    (r"experts\.(gate|up)_proj\.lora_B$", {"ep": 0, "tp": 1}),  # [E, F, r]
    (r"experts\.down_proj\.lora_A$", {"ep": 0, "tp": 2}),  # [E, r, F]
]


@dataclass(frozen=True)
class Shard:
    """Rank `tp_rank` of `tp` and `ep_rank` of `ep`: which slices of the model and its adapters it holds."""

    tp: int = 1
    ep: int = 1
    tp_rank: int = 0
    ep_rank: int = 0

    @classmethod
    def of(cls, rank: int, tp: int, ep: int) -> "Shard":
        return cls(tp, ep, rank % tp, rank // tp)

    @property
    def rank(self) -> int:
        return self.ep_rank * self.tp + self.tp_rank

    @property
    def world(self) -> int:
        return self.tp * self.ep

    def check(self, config: InklingTextConfig) -> None:
        """ValueError naming every size of `config` that this split does not divide evenly."""
        sizes = [(name, self.tp, "tensor_parallel") for name in TP_SIZES]
        sizes += [(name, self.ep, "expert_parallel") for name in EP_SIZES]
        bad = [
            f"{name} {getattr(config, name)} by {field}={parts}"
            for name, parts, field in sizes
            if getattr(config, name) % parts
        ]
        if bad:
            raise ValueError(f"the model cannot be split evenly: {'; '.join(bad)}")

    def local_config(self, config: InklingTextConfig) -> InklingTextConfig:
        """`config` with this rank's head, intermediate and expert counts: the shapes of its state and LoRA slots."""
        fields = config.to_dict()
        for name in TP_SIZES:
            fields[name] //= self.tp
        for name in EP_SIZES:
            fields[name] //= self.ep
        return InklingTextConfig(**fields)

    def expert_ids(self, config: InklingTextConfig) -> list[int]:
        """The model-wide ids (routed, then shared after them) of this rank's experts, in its own order."""
        routed, shared = config.n_routed_experts // self.ep, config.n_shared_experts // self.ep
        first_shared = config.n_routed_experts + self.ep_rank * shared
        return [*range(self.ep_rank * routed, (self.ep_rank + 1) * routed), *range(first_shared, first_shared + shared)]

    def _cuts(self, name: str, splits: list[tuple[str, dict[str, int]]]) -> list[Cut]:
        for pattern, dims in splits:
            if re.search(pattern, name):
                parts = {"tp": (self.tp_rank, self.tp), "ep": (self.ep_rank, self.ep)}
                return [(dim, *parts[axis]) for axis, dim in sorted(dims.items())]  # ep before tp
        return []

    def weight_pieces(self, name: str) -> list[list[Cut]]:
        """The cuts of each piece of base weight `name` this rank holds (pieces join along dim 1: the fused gate/up
        weight gives this rank's gate rows and its up rows)."""
        if FUSED_GATE_UP.search(name):
            ep = (0, self.ep_rank, self.ep)
            return [[ep, (1, half, 2), (1, self.tp_rank, self.tp)] for half in (0, 1)]
        return [self._cuts(name, BASE_SPLITS)]

    def weights(self, checkpoint: BaseCheckpoint) -> "ShardedWeights":
        return ShardedWeights(checkpoint, self)

    def adapter(self, adapter: Adapter) -> Adapter:
        """This rank's slices of `adapter` (new tensors on the host: an image of them goes into this rank's slots)."""
        tensors = {}
        for name, tensor in adapter.tensors.items():
            index = shard_index(tuple(tensor.shape), self._cuts(name, ADAPTER_SPLITS))
            tensors[name] = tensor[index].to("cpu", copy=True).contiguous()
        return Adapter(adapter.spec, tensors, adapter.base, dict(adapter.metadata))


class ShardedWeights(Mapping[str, torch.Tensor]):
    """A base checkpoint as one rank's slices: reading a name reads only those rows from disk."""

    def __init__(self, checkpoint: BaseCheckpoint, shard: Shard):
        self.checkpoint, self.shard = checkpoint, shard

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return len(self.checkpoint)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = tuple(self.checkpoint.shape(name))
        pieces = [self.checkpoint.read(name, shard_index(shape, cuts)) for cuts in self.shard.weight_pieces(name)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
