"""The byte floor of a decode step: the least it must read from GPU memory, over the memory's peak bandwidth.

A step of `rows` sequences reads every weight once, except the embedding (only its rows' rows) and the routed experts
(only those its tokens reach: each token picking k of E, E (1 - (1 - k/E)^rows) of them per MoE layer in expectation
under uniform routing; the shared experts always), and each sequence's state: its keys and values in every attention
layer (a sliding layer's ring holds at most its window) and its ShortConv states. Activations, adapters and what the
step writes are left out, so every real step takes longer. Issue 25's first target, a batch-8 step within 2x of it,
is read against the step's graph replayed alone (`bench_decode_graphs.py --profile`).
"""

from inkwell.serving.native.engine import Engine

# the memory's peak from the cards' data sheets: an H100 SXM's HBM3, an H200's HBM3e
PEAK_BYTES_S = {"H100": 3.35e12, "H200": 4.8e12}


def peak_bytes_s(gpu: str) -> float | None:
    """The peak memory bandwidth of a GPU by its name (`torch.cuda.get_device_name`); None for a card not listed."""
    return next((peak for card, peak in PEAK_BYTES_S.items() if card in gpu), None)


def experts_reached(experts: int, top_k: int, tokens: int) -> float:
    """How many distinct experts `tokens` tokens reach in expectation, each picking `top_k` of `experts` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def decode_step_bytes(engine: Engine, rows: int, seen: int) -> dict[str, float]:
    """Bytes a decode step of `rows` sequences, each `seen` positions in (the step's own included), must read, as
    they lie in the engine's memory: {"weights": ..., "state": keys, values and ShortConv states}."""
    model, state = engine.model, engine.state
    config = model.config
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
    return {"weights": weights, "state": rows * per_row}
