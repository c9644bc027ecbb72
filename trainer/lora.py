"""LoRA on megatron-core's tensor-parallel linears, and how each parameter maps to HF names.

Every parameter of the model carries `hf_name` (the transformers tensor it mirrors, or the
canonical LoRA name from inkwell.adapters) plus the dimensions sharded over tensor and expert
parallelism. The bridge reads only these attributes, so loading any TP/EP layout from an HF
checkpoint and writing it back needs no per-module code.

Column-parallel base (output sharded): A replicated, B sharded on its output rows; the rank-r
activation passes `copy_to_tensor_model_parallel_region` so A sees the full gradient.
Row-parallel base (input sharded): A sharded on its input columns, B replicated; the partial
rank-r activations are summed with `reduce_from_tensor_model_parallel_region`.

Under sequence parallelism the caller all-gathers the input and reduce-scatters the output: a
column-parallel base leaves its input gradient partial (the gather's backward sums it), and a
row-parallel one returns this rank's partial product unreduced. The LoRA factors keep their
all-reduced rank-r activations and gradients, so they see exactly the TP=1 gradient; the replicated
paths enter the sums as shares (`tp_share`, `tp_share_grad`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig
from torch import nn

from inkwell.trainer.parallel import tp_group, tp_share, tp_share_grad


@dataclass(frozen=True)
class LoraSettings:
    """Rank, alpha/r scaling and input dropout of one adapted weight."""

    rank: int
    scaling: float
    dropout: float = 0.0


def mark(
    param: torch.Tensor,
    hf_name: str,
    tp_dim: int | None = None,
    ep_dim: int | None = None,
    chunk: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Record where `param` lives in the HF/canonical state dict (chunk = (dim, index, count))."""
    param.hf_name = hf_name
    param.tp_dim = tp_dim
    param.ep_dim = ep_dim
    param.hf_chunk = chunk
    return param


def lora_param(shape: tuple[int, ...], name: str, tp_dim: int | None = None, ep_dim: int | None = None, device=None):
    """A trainable fp32 LoRA factor (fp32 master weights also under bf16 compute)."""
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device))
    p.is_lora = True
    return mark(p, name, tp_dim=tp_dim, ep_dim=ep_dim)


def lora_dropout(x: torch.Tensor, p: float, training: bool, sharded: bool = False) -> torch.Tensor:
    """Dropout on a LoRA input; a TP-sharded input draws from megatron's model-parallel RNG stream."""
    if p <= 0 or not training:
        return x
    if not sharded:
        return F.dropout(x, p=p)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return F.dropout(x, p=p)


def _noinit(_: torch.Tensor) -> None:
    """Weights come from the HF checkpoint through the bridge; megatron must not initialise them."""


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core 0.19.2's RowParallelLinear hands its matmul tp_group=None, which then warns on every
    call (a graph break per projection under torch.compile); this passes the layer's own group."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class ParallelLinear(nn.Module):
    """A frozen megatron Column/RowParallelLinear plus optional LoRA factors A, B."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        config: TransformerConfig,
        parallel: str,
        hf_name: str,
        lora: LoraSettings | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.parallel = parallel
        self.sequence_parallel = sequence_parallel
        tp = config.tensor_model_parallel_size
        if parallel == "column":
            self.base = tensor_parallel.ColumnParallelLinear(
                in_features,
                out_features,
                config=config,
                init_method=_noinit,
                bias=False,
                gather_output=False,
                disable_grad_reduce=sequence_parallel,
            )
            mark(self.base.weight, f"{hf_name}.weight", tp_dim=0)
        elif parallel == "row":
            self.base = RowParallelLinear(
                in_features,
                out_features,
                config=config,
                init_method=_noinit,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=True,
            )
            mark(self.base.weight, f"{hf_name}.weight", tp_dim=1)
        else:
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.base.weight.requires_grad_(False)
        self.lora = lora
        if lora is not None:
            device = self.base.weight.device
            if parallel == "column":
                self.lora_A = lora_param((lora.rank, in_features), f"{hf_name}.lora_A", device=device)
                self.lora_B = lora_param((out_features // tp, lora.rank), f"{hf_name}.lora_B", tp_dim=0, device=device)
            else:
                self.lora_A = lora_param((lora.rank, in_features // tp), f"{hf_name}.lora_A", tp_dim=1, device=device)
                self.lora_B = lora_param((out_features, lora.rank), f"{hf_name}.lora_B", device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output; under sequence parallelism a row-parallel one is this rank's partial sum."""
        column = self.parallel == "column"
        if self.sequence_parallel and not column:
            y = F.linear(x, self.base.weight)  # reduce-scattered by the caller, after its ShortConv
        else:
            y, _ = self.base(x)
        if self.lora is None:
            return y
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        xa = tp_share_grad(x) if self.sequence_parallel and column else x
        u = F.linear(lora_dropout(xa, self.lora.dropout, self.training, sharded=not column), a)
        if column:
            u = tensor_parallel.copy_to_tensor_model_parallel_region(u, group=tp_group())
        else:
            u = tensor_parallel.reduce_from_tensor_model_parallel_region(u, group=tp_group())
        delta = self.lora.scaling * F.linear(u, b)
        return y + (tp_share(delta) if self.sequence_parallel and not column else delta)
