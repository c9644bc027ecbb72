"""Routing replay: record the experts each MoE layer chose, and make the MoE use given ids.

RL recomputes log-probs of sampled tokens under the routing the sampler used. Replayed ids
replace the router's top-k choice; the routing weights are still computed from the current
router logits at those ids (the shared experts in the same normalisation), so they stay
differentiable. Ids are [tokens, top_k] per MoE layer, tokens in this rank's (batch, sequence)
order; a token whose row is -1 routes itself (padding, a datum without a trace).
"""

import contextlib
from collections.abc import Iterator

import torch

from inkwell.trainer.model import InklingGPT


@contextlib.contextmanager
def record_routing(model: InklingGPT) -> Iterator[dict[int, torch.Tensor]]:
    """Yields a dict filled on exit with each MoE layer's chosen expert ids of the last forward."""
    routers = model.routers()
    for router in routers.values():
        router.last_ids = None
    recorded: dict[int, torch.Tensor] = {}
    yield recorded
    recorded.update({layer: r.last_ids for layer, r in routers.items() if r.last_ids is not None})


@contextlib.contextmanager
def replay_routing(model: InklingGPT, ids_by_layer: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the block, MoE layer L routes to ids_by_layer[L] (layers not given route themselves)."""
    routers = model.routers()
    unknown = sorted(set(ids_by_layer) - set(routers))
    if unknown:
        raise ValueError(f"routing replay for layers {unknown}: not MoE layers (MoE layers: {sorted(routers)})")
    try:
        for layer, ids in ids_by_layer.items():
            routers[layer].replay_ids = ids.long()
        yield
    finally:
        for router in routers.values():
            router.replay_ids = None
