"""The training core: one LoRA model resident on its device with its AdamW optimizer, driven by Tinker's primitives.

`forward_backward` adds the gradient of a loss over some datums to the accumulated ones, `optim_step` applies
them, `save_state` / `load_state` make a later step equal, bit for bit, the step an uninterrupted run would take.
SFT jobs (trainer/loop.py) run on the same core: their packed rows go straight to `forward_rows` with the
cross-entropy loss, and each step ends in `optim_step`. Built inside `model_parallel`; every rank calls every
method with the same arguments.

Datums become rows padded to a multiple of ROW_MULTIPLE tokens, the padding its own segment (attention and
ShortConv never see it) and outside the loss. A datum's routing trace is replayed (trainer/replay.py); padding and
datums without one route themselves. Under data parallelism each rank runs its share of the rows and the
logprobs are gathered. Non-expert LoRA gradients are summed over the data-parallel group (which spans EP ranks:
shared-outer factors are replicated across EP), per-expert factors over the expert-data-parallel group; the grad
norm counts every distinct shard once.
"""

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter, init_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import BaseModelIdentity, base_model_identity, load_base_config, load_base_weights
from inkwell.models.routing import RoutingShape
from inkwell.trainer import checkpoint as ckpt
from inkwell.trainer.bridge import gather_state, is_lora, load_state
from inkwell.trainer.consistency import consistency_metrics, ratio_bounds
from inkwell.trainer.dataset import Rows
from inkwell.trainer.datums import CheckedRequest, Datum, check_request
from inkwell.trainer.losses import TARGETS, Config, Inputs, Loss, metrics
from inkwell.trainer.model import InklingGPT
from inkwell.trainer.parallel import all_reduce_, current_layout, seed_generators
from inkwell.trainer.replay import replay_routing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# transformers' own eager arithmetic everywhere; on GPUs each layer is compiled, which fuses the bias,
# mask and softmax (faster than SDPA and FlexAttention here: docs/benchmarks.md)
ATTENTION = {"cpu": "eager", "cuda": "eager"}
# Datum rows are padded to a multiple of this many tokens: few distinct shapes for compiled layers, and rows
# that split evenly over any power-of-two TP group under sequence parallelism. Under CUDA graphs (one recorded
# graph per shape) they are padded to a power of two instead: a handful of graphs for any mix of lengths.
ROW_MULTIPLE = 64


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyper-parameters, with Tinker's defaults (tinker 0.38 `types.AdamParams`)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0  # decoupled (AdamW)
    grad_clip_norm: float = 0.0  # the global gradient norm is scaled down to this; 0: no clipping


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p of each target under vocab-parallel `logits` [b, s, V/tp]: targets [b, s] through megatron's fused op,
    or [b, s, K] (K targets per position, which only training sessions send, and they run on one TP rank) from one
    log-softmax over the whole vocabulary."""
    if targets.dim() < logits.dim():
        return -vocab_parallel_cross_entropy(logits, targets)
    if ps.get_tensor_model_parallel_world_size() > 1:
        raise ValueError("K targets per position need the whole vocabulary on one rank (tp=1), as sessions run")
    return torch.log_softmax(logits, -1).gather(-1, targets)


@dataclass(frozen=True)
class ForwardResult:
    """Per datum, the logprob of each target token (a list of K per token where K targets per token were given);
    the loss's `name:reduction` metrics (see trainer/losses.py), and for a loss of the sampler's logprobs the
    consistency metrics (trainer/consistency.py)."""

    logprobs: list[list]
    metrics: dict[str, float]


class TrainingCore:
    """This rank's LoRA model, its adapter parameters and their AdamW optimizer; `step` counts optimizer steps."""

    def __init__(
        self,
        hf_config: InklingTextConfig,
        identity: BaseModelIdentity,
        base_weights: dict[str, torch.Tensor],
        lora: LoraSpec,
        *,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        compile_mode: str | None = None,
        sequence_parallel: bool = False,
        batch_tokens: int = 16384,
    ):
        """A fresh adapter (seeded) on the given base. `batch_tokens` bounds one rank's forward over datums
        (rows x padded length); larger requests run as several forwards, their gradients accumulated."""
        self.hf_config, self.identity, self.lora = hf_config, identity, lora
        self.routing_shape = RoutingShape.of(hf_config)
        self.layout = current_layout()
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        # CUDA-graph trees treat every call without autograd as a new step that may overwrite an output still in
        # use: no-grad passes (and routing replay, a per-call input the graphs do not see) run the layers eagerly
        self.graphs = compile_mode == "reduce-overhead"
        self.eager_stance = "force_eager" if self.graphs else "default"
        self.batch_tokens = batch_tokens
        self.model = InklingGPT(
            hf_config, lora, DTYPES[dtype], device, ATTENTION[device], compile_mode, sequence_parallel
        )
        load_state(self.model, base_weights, lora=False)
        self.params = [p for p in self.model.parameters() if is_lora(p)]
        self.reset(seed)

    @classmethod
    def create(cls, base_model_dir: Path, lora: LoraSpec, **options) -> "TrainingCore":
        """The core on the base model stored in `base_model_dir` (options as for the constructor)."""
        return cls(
            load_base_config(base_model_dir),
            base_model_identity(base_model_dir),
            load_base_weights(base_model_dir),
            lora,
            **options,
        )

    def reset(self, seed: int) -> None:
        """Start where a new core on this base starts with `seed`: the adapter initialised from it, no optimizer
        moments, step 0, no gradients, and torch's and megatron's generators (LoRA dropout) seeded with it. The
        model, its compiled layers and their CUDA graphs stay: a kept core (trainer/core_cache.py) trains the next
        job bit for bit as a new one would."""
        self.seed = seed
        load_state(self.model, init_adapter(self.hf_config, self.lora, self.identity, seed=seed).tensors, lora=True)
        # every hyper-parameter is set by each optim_step
        self.optimizer = torch.optim.AdamW(self.params, fused=self.device.type == "cuda")
        self._zero_grads()
        self.step = 0
        self.model.train()
        seed_generators(seed)

    # ---- forward passes ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """No autograd, no LoRA dropout, eager layers under CUDA graphs; training mode again after."""
        self.model.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance(self.eager_stance):
                yield
        finally:
            self.model.train()

    def forward_rows(
        self,
        rows: Rows,
        loss: Loss,
        config: Config,
        inputs: Inputs,
        backward: bool,
        routing: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The one forward of every path (SFT steps and evaluation, sessions' forward_backward and forward).

        `rows` (on the device) are this rank's; a position takes part in the loss where `rows.loss_mask` is
        nonzero; `inputs` are the loss's per-token inputs besides the targets, shaped like the rows; `routing`, the
        expert ids to replay per MoE layer (trainer/replay.py). With `backward` the gradient of the loss is added to
        the accumulated ones. Returns the targets' logprobs [b, s] and the batch's `Loss.sums`, detached and on the
        device: nothing here waits for the device.
        """
        replay = replay_routing(self.model, routing) if routing else contextlib.nullcontext()
        with contextlib.nullcontext() if backward else self._inference(), replay:
            logits = self.model(rows.input_ids, rows.segments)
            logp = target_logprobs(logits.float(), rows.targets)
            sums = loss.sums(logp, {TARGETS: rows.targets, **inputs}, config, rows.loss_mask > 0)
            if backward:
                sums["loss"].backward()
        return logp.detach(), {name: value.detach() for name, value in sums.items()}

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, object] | None = None
    ) -> ForwardResult:
        """Add the gradient of `loss_fn` over `data` to the accumulated gradients (they add up until optim_step).
        A refused request (DatumError) changes nothing."""
        return self._run(data, loss_fn, loss_fn_config, backward=True)

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, object] | None = None
    ) -> ForwardResult:
        """The logprobs and loss metrics of `data` without gradients (and without LoRA dropout)."""
        return self._run(data, loss_fn, loss_fn_config, backward=False)

    def _run(self, data, loss_fn, loss_fn_config, backward: bool) -> ForwardResult:
        hf = self.hf_config
        request = check_request(
            data, loss_fn, loss_fn_config, hf.vocab_size, hf.max_position_embeddings, self.routing_shape
        )
        lengths = [len(t) for t in request.tokens]
        groups: list[tuple[torch.Tensor, int]] = []  # per group: every rank's logprob rows, how many hold datums
        totals: dict[str, torch.Tensor] = {}
        replayed = any(trace is not None for trace in request.routing)
        with torch.compiler.set_stance("default" if backward and not replayed else self.eager_stance):
            for group in self._groups(lengths):
                rows, inputs, routing = self._datum_rows(request, group)
                logp, sums = self.forward_rows(rows, request.loss, request.config, inputs, backward, routing)
                groups.append((self._gathered(logp), len(group)))
                totals = {name: totals.get(name, 0) + value.double() for name, value in sums.items()}
        reduced = all_reduce_(torch.stack(list(totals.values())), ps.get_data_parallel_group())
        # one trip to the host per call, after the last group: the sums, then the rows (float32 in float64: exact)
        host = torch.cat([reduced, *(logp.flatten().double() for logp, _ in groups)]).cpu().numpy()
        out = metrics(dict(zip(totals, host[: len(totals)].tolist(), strict=True)))
        datum_rows, start = [], len(totals)
        for logp, datums in groups:
            datum_rows += list(host[start : start + logp.numel()].reshape(logp.shape)[:datums])
            start += logp.numel()
        logprobs = [row[:n] for row, n in zip(datum_rows, lengths, strict=True)]
        if "logprobs" in request.loss.inputs:  # the sampler's: how far the two sides are apart
            given, bounds = request.inputs, ratio_bounds(request.loss.name, request.config)
            sampler, advantages = [i["logprobs"] for i in given], [i["advantages"] for i in given]
            out |= consistency_metrics(logprobs, sampler, advantages, bounds)
        return ForwardResult([row.tolist() for row in logprobs], out)

    def _width(self, n: int) -> int:
        """The padded row width of datums of at most `n` tokens."""
        return max(ROW_MULTIPLE, 1 << (n - 1).bit_length()) if self.graphs else _round_up(n)

    def _groups(self, lengths: list[int]) -> Iterator[list[int]]:
        """Consecutive datums whose padded rows fit `batch_tokens` per rank (at least one datum each)."""
        dp, group, longest = self.layout.dp, [], 0
        for i, n in enumerate(lengths):
            padded = self._width(max(longest, n))
            if group and math.ceil((len(group) + 1) / dp) * padded > self.batch_tokens:
                yield group
                group, longest = [], 0
            group.append(i)
            longest = max(longest, n)
        yield group

    def _datum_rows(
        self, request: CheckedRequest, group: list[int]
    ) -> tuple[Rows, dict[str, torch.Tensor], dict[int, torch.Tensor] | None]:
        """This rank's rows of the datums `group`: one datum per row from position 0, then a padding segment;
        the group is padded with empty rows to split evenly over the data-parallel ranks. With the rows, the loss
        inputs and, where a datum of the group has a routing trace, the ids to replay per MoE layer."""
        per_rank = math.ceil(len(group) / self.layout.dp)
        mine = group[self.layout.dp_rank * per_rank :][:per_rank]
        width = self._width(max(len(request.tokens[i]) for i in group))
        ids = torch.zeros((per_rank, width), dtype=torch.long)
        segments = torch.ones((per_rank, width), dtype=torch.long)
        mask = torch.zeros((per_rank, width))
        inputs = {  # a trailing K where K targets per token were given (one K per request)
            name: torch.zeros((per_rank, width, *t.shape[1:]), dtype=t.dtype)
            for name, t in request.inputs[group[0]].items()
        }
        for row, i in enumerate(mine):
            n = len(request.tokens[i])
            ids[row, :n] = request.tokens[i]
            segments[row, :n] = 0
            mask[row, :n] = 1.0
            for name, values in request.inputs[i].items():
                inputs[name][row, :n] = values
        targets = inputs.pop(TARGETS)
        rows = Rows(ids, segments, targets, mask).to(self.device)
        return (
            rows,
            {name: t.to(self.device) for name, t in inputs.items()},
            self._replayed([request.routing[i] for i in mine], ids.shape),
        )

    def _replayed(self, traces: list[torch.Tensor | None], rows: torch.Size) -> dict[int, torch.Tensor] | None:
        """Per MoE layer, the ids [b * s, top_k] to replay in rows of shape [b, s] whose first rows hold datums
        with these `traces` (-1 where a token routes itself); None when none has a trace."""
        if all(trace is None for trace in traces):
            return None
        shape = self.routing_shape
        ids = torch.full((*rows, len(shape.moe_layers), shape.top_k), -1, dtype=torch.long)
        for row, trace in enumerate(traces):
            if trace is not None:
                ids[row, : len(trace)] = trace
        return {
            layer: ids[:, :, j].reshape(-1, shape.top_k).to(self.device) for j, layer in enumerate(shape.moe_layers)
        }

    def _gathered(self, logp: torch.Tensor) -> torch.Tensor:
        """Every rank's logprob rows of one group, in datum order (then the padding rows), on the device."""
        group = ps.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return logp
        parts = [torch.empty_like(logp) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logp.contiguous(), group=group)
        return torch.cat(parts)

    # ---- the optimizer -------------------------------------------------------------------------------------

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """Apply the accumulated gradients: sum them over the data-parallel ranks, clip their global norm to
        `params.grad_clip_norm` (0: no clipping), take one AdamW step with `params`, zero them.

        Returns `grad_norm:mean` (before clipping), `learning_rate:mean` and `step:max` (steps taken so far).
        """
        for group in self.optimizer.param_groups:
            group["lr"], group["betas"], group["eps"] = params.learning_rate, (params.beta1, params.beta2), params.eps
            group["weight_decay"] = params.weight_decay
        self._reduce_grads()
        norm = self.grad_norm()
        if params.grad_clip_norm > 0:
            limit = params.grad_clip_norm
            scale = torch.where(norm > limit, limit / (norm + 1e-6), 1.0).float()  # the grads' dtype (fp32 LoRA)
            torch._foreach_mul_([p.grad for p in self.params], scale)
        self.optimizer.step()
        self._zero_grads()
        self.step += 1
        return {"grad_norm:mean": norm.item(), "learning_rate:mean": params.learning_rate, "step:max": float(self.step)}

    def _reduce_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        groups = {
            "dense": (ps.get_data_parallel_group(), [p for p in self.params if p.ep_dim is None]),
            "expert": (ps.get_expert_data_parallel_group(), [p for p in self.params if p.ep_dim is not None]),
        }
        for group, params in groups.values():
            if not params or dist.get_world_size(group) == 1:
                continue
            flat = _flatten_dense_tensors([p.grad for p in params])
            dist.all_reduce(flat, group=group)
            for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params]), strict=True):
                p.grad.copy_(g)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm (float64, on the device): each parameter's squared norm divided by how many ranks hold
        the same shard. One fused norm per kind of shard, not kernels per parameter: after a session's
        forward_backward has waited for its logprobs, nothing on the GPU hides these launches."""
        lay = self.layout
        shards: dict[int, list[torch.Tensor]] = {}  # grads by how many distinct shards their parameter has
        for p in self.params:
            distinct = (lay.tp if p.tp_dim is not None else 1) * (lay.ep if p.ep_dim is not None else 1)
            shards.setdefault(distinct, []).append(p.grad)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for distinct, grads in shards.items():
            total += torch.stack(torch._foreach_norm(grads)).double().square().sum() * distinct / lay.world
        all_reduce_(total, dist.group.WORLD)
        return total.sqrt()

    # ---- state ---------------------------------------------------------------------------------------------

    def meta(self) -> dict:
        """What a saved state records besides its tensors: the base model, the LoRA spec, the layout, the seed."""
        return {
            "base_model": self.identity.to_dict(),
            "lora": self.lora.model_dump(mode="json"),
            "layout": {"tp": self.layout.tp, "ep": self.layout.ep, "nproc": self.layout.world},
            "seed": self.seed,
        }

    def save_state(self, path: Path) -> Path:
        """Collective: adapter, AdamW moments, step and every rank's RNG at `path` (trainer/checkpoint.py).
        Gradients accumulated since the last optim_step are not part of the state."""
        return ckpt.save_checkpoint(path, self.step, self.params, self.optimizer, self.meta(), self.layout.is_main)

    def load_state(self, path: Path, with_optimizer: bool = True) -> None:
        """Continue from the state at `path` (same base model and LoRA spec; any layout): the adapter, and with
        the optimizer its moments, step and (same layout) RNG, so the next step equals the uninterrupted one.
        Without the optimizer: those weights with fresh moments at step 0. Accumulated gradients are dropped."""
        meta = ckpt.read_meta(path)
        ckpt.check_compatible(meta, self.identity, self.lora.model_dump(mode="json"))
        optimizer = self.optimizer if with_optimizer else None
        same_layout = meta["layout"] == self.meta()["layout"]
        step = ckpt.load_checkpoint(path, self.params, optimizer, restore_rng=same_layout)
        if not with_optimizer:
            self.optimizer.state.clear()
        self.step = step if with_optimizer else 0
        self._zero_grads()

    def _zero_grads(self) -> None:
        """Drop the accumulated gradients. Under CUDA graphs they stay allocated (zeroed): a gradient that backward
        adopted as the graph's own output buffer would be overwritten by the next replay, so it must add into
        tensors of its own (which is what lets forward_backward accumulate over calls there)."""
        self.optimizer.zero_grad(set_to_none=not self.graphs)
        if self.graphs:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def adapter(self, metadata: dict | None = None) -> Adapter:
        """Collective: a snapshot of the LoRA tensors (later steps leave it as it is), gathered whole on every rank,
        as an Adapter of this base."""
        tensors = {name: t.clone() for name, t in gather_state(self.model, lora=True).items()}
        return Adapter(self.lora, tensors, self.identity, metadata or {})


def _round_up(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
