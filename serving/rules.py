"""The serving rules every engine applies the same way, each written once.

- `context_limit`: the context a worker serves, from the model and the configured cap;
- `check_prompt` / `validate_request`: what a request must satisfy before any work (the API runs the first,
  so a bad request gets its 400 before a stream starts; every engine runs the second);
- `check_routing`: whether an engine kind can record the routing traces a request asks for;
- `Finisher`: where and why a choice ends (stop tokens, stop strings, max_tokens, the context);
- `AdapterTable`: which loaded adapters may be unloaded to make room, and when an unload is refused.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable

from transformers import InklingTextConfig, PreTrainedTokenizerBase

from inkwell.adapters.adapter import Adapter
from inkwell.serving.contract import ROUTING_ENGINES, EngineError, Request, SamplingParams
from inkwell.serving.text import TextTracker


def context_limit(config: InklingTextConfig, requested: int | None) -> int:
    """The context (prompt + generated tokens) a worker serves: the model's, or less where `requested` caps it."""
    limit = config.max_position_embeddings
    return min(limit, requested) if requested else limit


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab: int, max_context: int) -> None:
    """EngineError unless `params` are legal and the prompt is non-empty, in the vocabulary and fits the context
    with max_tokens (None takes the rest of the context)."""
    params.validate()
    if not prompt_ids:
        raise EngineError("empty_prompt", "the prompt has no tokens", "prompt")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise EngineError("invalid_token", f"prompt token ids must be in [0, {vocab})", "prompt")
    prompt_len, max_tokens = len(prompt_ids), params.max_tokens
    if prompt_len + (1 if max_tokens is None else max_tokens) <= max_context:
        return
    least = 0 if max_tokens == 0 else 1  # tokens the request must generate
    room = max_context - prompt_len  # the most max_tokens this prompt leaves
    if room < least:
        fix, param = f"shorten the prompt to at most {max_context - least} tokens", "prompt"
    else:
        fix, param = f"lower max_tokens to at most {room}", "max_tokens"
    raise EngineError(
        "context_length_exceeded",
        f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}; together they must fit the "
        f"model's context of {max_context} tokens ({fix})",
        param,
    )


def validate_request(request: Request, adapters: Iterable[str], vocab: int, max_context: int, max_seqs: int) -> None:
    """Every engine's checks of a request before any work: the prompt's, then its adapter and n."""
    check_prompt(request.prompt_ids, request.params, vocab, max_context)
    if request.adapter is not None and request.adapter not in adapters:
        raise EngineError("adapter_not_loaded", f"adapter {request.adapter!r} is not loaded", "model")
    if request.params.n > max_seqs:
        raise EngineError("invalid_n", f"n must be at most {max_seqs} on this engine", "n")


def check_routing(params: SamplingParams, engine_kind: str) -> None:
    """EngineError when `params` ask for a routing trace that engines of `engine_kind` cannot record."""
    if (params.return_routing or params.prompt_routing) and engine_kind not in ROUTING_ENGINES:
        raise EngineError(
            "routing_not_supported",
            f"the {engine_kind} engine cannot record routing traces (return_routing, prompt_routing); serve this "
            f"model with the {' or '.join(ROUTING_ENGINES)} engine, or sample without them",
            "return_routing" if params.return_routing else "prompt_routing",
        )


class Finisher:
    """Ends one choice where every engine ends it, token by token.

    A stop token (the tokenizer's unless `ignore_eos`, and the request's `stop_token_ids`) ends it and is not
    part of the text; a stop string ends it at the string (the text tracker holds back a tail that may still
    become one); max_tokens and the context end it by length.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        prompt_len: int,
        stop_ids: tuple[int, ...],
        max_context: int,
    ):
        self.params, self.prompt_len, self.max_context = params, prompt_len, max_context
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_ids))
        self.text = TextTracker(tokenizer, params.stop)

    def ends_by_length(self, tokens: int) -> bool:
        """Whether a choice holding `tokens` tokens (prompt included) has reached max_tokens or the context."""
        max_tokens = self.params.max_tokens
        return tokens >= self.max_context or (max_tokens is not None and tokens - self.prompt_len >= max_tokens)

    def advance(self, generated: list[int]) -> tuple[str, str | None]:
        """(newly final text, finish reason or None) once `generated` has its newest token last."""
        is_stop_token = generated[-1] in self.stop_ids
        at_length = self.ends_by_length(self.prompt_len + len(generated))
        delta, hit_stop = self.text.update(generated[:-1] if is_stop_token else generated, is_stop_token or at_length)
        return delta, "stop" if is_stop_token or hit_stop else "length" if at_length else None

    def close(self, generated: list[int]) -> tuple[str, bool]:
        """The rest of the text of a choice ended by other means, and whether a stop string cut it."""
        return self.text.update(generated, True)


class AdapterTable:
    """An engine's loaded adapters by key (least recently used first), its pins, and the rules for making room
    and for unloading; `in_use(key)` says whether a queued or running request uses `key`."""

    def __init__(self, limit: int, in_use: Callable[[str], bool]):
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.pinned: set[str] = set()
        self.limit, self.in_use = limit, in_use

    def check_new(self, key: str) -> None:
        if key in self.adapters:
            raise EngineError("adapter_exists", f"adapter {key!r} is already loaded; unload it or use a new key")

    def make_room(self, unload: Callable[[str], None]) -> None:
        """Unload idle (unpinned, unused) adapters, least recently used first, until fewer than `limit` remain;
        EngineError too_many_adapters when every one is pinned or in use."""
        while len(self.adapters) >= self.limit:
            idle = [k for k in self.adapters if k not in self.pinned and not self.in_use(k)]
            if not idle:
                raise EngineError(
                    "too_many_adapters",
                    f"{len(self.adapters)} adapters are loaded and all are pinned or in use "
                    "(raise max_loaded_adapters)",
                )
            unload(idle[0])

    def add(self, key: str, adapter: Adapter, pinned: bool) -> None:
        self.adapters[key] = adapter
        if pinned:
            self.pinned.add(key)

    def touch(self, key: str) -> None:
        """`key` was just used: it is evicted last."""
        self.adapters.move_to_end(key)

    def check_unload(self, key: str) -> None:
        """EngineError unless `key` is loaded and no queued or running request uses it."""
        if key not in self.adapters:
            raise EngineError("adapter_not_loaded", f"adapter {key!r} is not loaded")
        if self.in_use(key):
            raise EngineError("adapter_busy", f"adapter {key!r} has queued or running requests")

    def remove(self, key: str) -> None:
        self.pinned.discard(key)
        del self.adapters[key]
