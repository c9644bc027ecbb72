"""The byte floor of a decode step: the least it must read from GPU memory, over the memory's peak bandwidth.

A step of `rows` sequences reads every weight once, except the embedding (only its rows' rows) and the routed experts
(only those its tokens reach: each token picking k of E, E (1 - (1 - k/E)^rows) of them per MoE layer in expectation
under uniform routing; the shared experts always), and each sequence's state: its keys and values in every attention
layer (a sliding layer's ring holds at most its window) and its ShortConv states; and each adapter its rows use, once:
every factor of its slot, the routed experts' own factors only for the experts its rows reach. Activations and what
the step writes are left out, so every real step takes longer. Issue 25's targets (a batch-8 step within 2x of it; 8
distinct adapters within 3% of 1) are read against the step's graph replayed alone (`bench_decode_graphs.py
--profile`).
"""

import math
from collections import Counter

from inkwell.serving.native.engine import Engine

# the memory's peak from the cards' data sheets: an H100 SXM's HBM3, an H200's HBM3e
PEAK_BYTES_S = {"H100": 3.35e12, "H200": 4.8e12}


def peak_bytes_s(gpu: str) -> float | None:
    """The peak memory bandwidth of a GPU by its name (`torch.cuda.get_device_name`); None for a card not listed."""
    return next((peak for card, peak in PEAK_BYTES_S.items() if card in gpu), None)


def experts_reached(experts: int, top_k: int, tokens: int) -> float:
    """How many distinct experts `tokens` tokens reach in expectation, each picking `top_k` of `experts` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def adapter_bytes(engine: Engine, rows: int) -> float:
    """Bytes of one adapter's slot that a step whose `rows` sequences use it must read: every factor of every
    target, at the slots' rank; the routed experts' own factors ([E, ...]: gate/up B, down A) only for the experts
    those rows reach."""
    layout, config = engine.lora.layout, engine.model.config
    routed = config.n_routed_experts
    reached = experts_reached(routed, config.num_experts_per_tok, rows) / routed
    elements = 0.0
    for entry in layout.entries:
        for shape in (entry.a_shape, entry.b_shape):
            elements += math.prod(shape) * (reached if entry.group == "experts" and len(shape) == 3 else 1.0)
    return elements * layout.dtype.itemsize


def decode_step_bytes(engine: Engine, seen: int, adapters: list[str | None]) -> dict[str, float]:
    """Bytes a decode step must read, as they lie in the engine's memory, for rows that are each `seen` positions
    in (the step's own included), row i on adapter `adapters[i]` (None: the base model): {"weights", "state": keys,
    values and ShortConv states, "adapters"}."""
    model, state = engine.model, engine.state
    config = model.config
    rows = len(adapters)
    routed, shared = config.n_routed_experts, config.n_shared_experts
    reached = experts_reached(routed, config.num_experts_per_tok, rows)
    weights = 0.0
    for name, tensor in model.w.items():
        size = tensor.numel() * tensor.element_size()
        if name == "model.embed_tokens.weight":
            size *= rows / tensor.shape[0]
        elif ".all_experts." in name:  # the routed experts' weights, then the shared experts' (`InklingModel`)
            size *= (reached + shared) / (routed + shared)
        weights += size
    per_row = state.conv_state[0].numel() * state.conv_state.element_size()
    for keys, sliding in zip(state.keys, state.sliding, strict=True):
        entries = min(seen, state.window) if sliding else seen
        per_row += 2 * entries * keys[0, 0].numel() * keys.element_size()  # keys and values alike
    used = Counter(key for key in adapters if key is not None)
    return {
        "weights": weights,
        "state": rows * per_row,
        "adapters": sum(adapter_bytes(engine, count) for count in used.values()),
    }
