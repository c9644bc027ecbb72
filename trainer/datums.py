"""A datum (one sequence of a training session's request) and the rules every request must follow.

Tinker's convention: `tokens` is the model's input and every `loss_fn_inputs` array has one value per token,
position i of the input predicting `target_tokens[i]` (cross_entropy may give K targets per token: `target_tokens`
and `weights` both [N, K], one K per request). A datum may also carry the sampler's routing trace
(`inkwell.models.routing`), one entry per token in the same alignment, which the forward replays. `check_request`
runs before anything is computed, so a refused request changes nothing (no gradient is half-accumulated); its
`DatumError` names the field and the datum. Token ids may arrive as whole-number floats (a JSON body typed as
floats): they are checked as ids.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inkwell.models.routing import RoutingShape
from inkwell.trainer.losses import LOSSES, TARGETS, Loss

# a routing trace: nested lists [tokens][MoE layers][top_k] of expert ids, or an integer array (torch, numpy)
type Trace = list[list[list[int]]] | torch.Tensor


@dataclass(frozen=True)
class Datum:
    """One sequence: the model's input tokens, the loss's per-token inputs and, to replay the sampler's experts,
    its routing trace."""

    tokens: list[int]
    loss_fn_inputs: dict[str, list[int] | list[float]]
    routing: Trace | None = None


class DatumError(ValueError):
    """A request the trainer refuses. `field` names what is wrong (`loss_fn`, `loss_fn_config.beta`, `data`,
    `tokens`, `loss_fn_inputs.weights`, ...), `index` the datum it is in (None: the request as a whole), `reason`
    what is wrong without the place in front."""

    def __init__(self, field: str, reason: str, index: int | None = None):
        super().__init__(f"{field if index is None else f'data[{index}].{field}'}: {reason}")
        self.field, self.index, self.reason = field, index, reason


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed: its loss, its full config, and each datum's tokens and inputs as tensors of one
    length per datum (token ids long, everything else float32; the loss's `per_target` inputs [N, K] where K
    targets per token were given), and its routing trace [tokens, MoE layers, top_k] (long) or None."""

    loss: Loss
    config: dict[str, float]
    tokens: list[torch.Tensor]
    inputs: list[dict[str, torch.Tensor]]
    routing: list[torch.Tensor | None]


def _finite_number(value: object) -> bool:
    try:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _config(loss: Loss, given: Mapping[str, object] | None) -> dict[str, float]:
    config = dict(loss.defaults)
    takes = ", ".join(loss.defaults) or "no keys"
    for key, value in (given or {}).items():
        field = f"loss_fn_config.{key}"
        if key not in loss.defaults:
            raise DatumError(field, f"{loss.name} does not take this key; it takes {takes}")
        if not _finite_number(value):
            raise DatumError(field, f"{value!r} is not a finite number")
        config[key] = float(value)
    problem = loss.config_problem(config)
    if problem:
        raise DatumError(f"loss_fn_config.{problem[0]}", problem[1])
    return config


def _values(values: object, field: str, index: int, vocab_size: int | None, per_target: bool = False) -> torch.Tensor:
    """`values` as a 1-D tensor (or, `per_target`, [N, K] where given so: K values per token): token ids (long,
    inside the vocabulary) when `vocab_size` is given, else float32. Converted and checked whole (numpy): a
    request's lists are long, and this runs on every call."""
    try:
        if not isinstance(values, list | tuple):
            raise TypeError
        given = np.asarray(values)  # anything but numbers (None, strings, ints beyond 64 bits) makes no number array
    except (TypeError, ValueError, OverflowError):
        raise DatumError(field, "must be a list of numbers", index) from None
    if given.dtype.kind not in "biuf":
        raise DatumError(field, "must be a list of numbers", index)
    if given.ndim != 1 and not (per_target and given.ndim == 2 and given.shape[1] > 0):
        many = " (or, for K targets per token, a list of K numbers per token)" if per_target else ""
        raise DatumError(field, f"must be a flat list of numbers, one per token{many}", index)
    with np.errstate(over="ignore"):  # beyond float32: refused as not finite
        array = given.astype(np.float64 if vocab_size is not None else np.float32)
    bad = np.argwhere(~np.isfinite(array))
    if len(bad):
        at = _place(bad[0])
        raise DatumError(field, f"value {_at(values, bad[0])!r} at {at} is not a finite number (as float32)", index)
    if vocab_size is None:
        return torch.from_numpy(array)
    bad = np.argwhere((array != np.round(array)) | (array < 0) | (array >= vocab_size))
    if len(bad):
        at = _place(bad[0])
        raise DatumError(
            field, f"{_at(values, bad[0])!r} at {at} is not a token id of the vocabulary (0..{vocab_size - 1})", index
        )
    return torch.from_numpy(array.astype(np.int64))


def _place(where: np.ndarray) -> str:
    """'position 3', or for K values per token 'position 3, target 1'."""
    return f"position {where[0]}" + (f", target {where[1]}" if len(where) > 1 else "")


def _at(values: Sequence, where: np.ndarray) -> object:
    """The value at `where` (a position, or a position and a target) as the caller wrote it."""
    for i in where:
        values = values[int(i)]
    return values


def _trace(trace: object, index: int, tokens: int, shape: RoutingShape | None) -> torch.Tensor:
    """`trace` as a long tensor [tokens, MoE layers, top_k] of distinct routed expert ids per layer and position."""
    if shape is None:
        raise DatumError("routing", "routing traces are not taken here; send the datum without one", index)
    layers, top_k = len(shape.moe_layers), shape.top_k
    want = f"expert ids shaped [tokens][MoE layers][top_k] = [{tokens}][{layers}][{top_k}]"
    try:
        ids = torch.as_tensor(trace)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise DatumError("routing", f"must be {want}", index) from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or ids.ndim != 3:
        raise DatumError("routing", f"must be {want}", index)
    if len(ids) != tokens:
        raise DatumError(
            "routing",
            f"{len(ids)} positions for {tokens} tokens; a trace has one entry per token (position i: the forward "
            "of tokens[i], aligned as the sampler's logprobs are)",
            index,
        )
    if ids.shape[1:] != (layers, top_k):
        raise DatumError("routing", f"shaped {list(ids.shape)}; must be {want}", index)
    bad = ((ids < 0) | (ids >= shape.experts)).nonzero()
    if len(bad):
        at = bad[0].tolist()
        raise DatumError(
            "routing", f"{int(ids[tuple(at)])} at {at} is not a routed expert (0..{shape.experts - 1})", index
        )
    ordered = ids.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1).nonzero()
    if len(repeated):
        raise DatumError("routing", f"{repeated[0].tolist()} names one expert twice", index)
    return ids.long()


def _datum(datum: Datum, index: int, loss: Loss, vocab_size: int, max_tokens: int, routing: RoutingShape | None):
    tokens = _values(datum.tokens, "tokens", index, vocab_size)
    if len(tokens) == 0:
        raise DatumError("tokens", "empty; a datum needs at least one token", index)
    if len(tokens) > max_tokens:
        raise DatumError(
            "tokens", f"{len(tokens)} tokens, longer than the model's context ({max_tokens} positions)", index
        )
    given = datum.loss_fn_inputs
    if not isinstance(given, Mapping):
        raise DatumError("loss_fn_inputs", "must map input names to per-token lists", index)
    needs = ", ".join(loss.inputs)
    for name in given:
        if name not in loss.inputs:
            raise DatumError(f"loss_fn_inputs.{name}", f"not an input of {loss.name}, which takes {needs}", index)
    inputs = {}
    for name in loss.inputs:
        field = f"loss_fn_inputs.{name}"
        if name not in given:
            raise DatumError(field, f"missing; {loss.name} needs {needs}", index)
        vocab = vocab_size if name == TARGETS else None
        inputs[name] = _values(given[name], field, index, vocab, name in loss.per_target)
        if len(inputs[name]) != len(tokens):
            raise DatumError(field, f"{len(inputs[name])} values for {len(tokens)} tokens; give one per token", index)
    shapes = {name: list(inputs[name].shape) for name in loss.per_target}
    if len({tuple(shape) for shape in shapes.values()}) > 1:
        given_shapes = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise DatumError(
            f"loss_fn_inputs.{loss.per_target[-1]}",
            f"shaped unlike the others ({given_shapes}); K targets per token come as [N, K] in each of them",
            index,
        )
    if problem := loss.datum_problem(inputs):
        raise DatumError(f"loss_fn_inputs.{problem[0]}", problem[1], index)
    trace = None if datum.routing is None else _trace(datum.routing, index, len(tokens), routing)
    return tokens, inputs, trace


def check_request(
    data: Sequence[Datum],
    loss_fn: str,
    loss_fn_config: Mapping[str, object] | None,
    vocab_size: int,
    max_tokens: int,
    routing: RoutingShape | None = None,
) -> CheckedRequest:
    """The request as tensors, or the first DatumError: unknown loss or config key, a bad config value, no datums,
    an empty or too long datum, inputs missing, unknown or of the wrong length, ids outside the vocabulary,
    values that are not finite numbers, a routing trace not of the model's `routing` shape and the datum's length
    (None: datums may not carry one)."""
    if loss_fn not in LOSSES:
        raise DatumError("loss_fn", f"{loss_fn!r} is not supported; use one of {', '.join(LOSSES)}")
    loss = LOSSES[loss_fn]
    config = _config(loss, loss_fn_config)
    if not data:
        raise DatumError("data", "no datums; send at least one")
    checked = [_datum(datum, i, loss, vocab_size, max_tokens, routing) for i, datum in enumerate(data)]
    tokens, inputs, traces = (list(column) for column in zip(*checked, strict=True))
    for i, given in enumerate(inputs[1:], start=1):
        if loss.per_target and given[TARGETS].shape[1:] != inputs[0][TARGETS].shape[1:]:
            raise DatumError(
                f"loss_fn_inputs.{TARGETS}",
                f"{_targets_per_token(given)} target(s) per token where data[0] has {_targets_per_token(inputs[0])}; "
                "give every datum of a request the same number",
                i,
            )
    return CheckedRequest(loss, config, tokens, inputs, traces)


def _targets_per_token(inputs: Mapping[str, torch.Tensor]) -> int:
    targets = inputs[TARGETS]
    return targets.shape[1] if targets.dim() == 2 else 1
