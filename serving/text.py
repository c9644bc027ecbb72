"""Incremental detokenization with stop strings, safe for streaming.

Text is only released once it cannot change: a trailing partial UTF-8 character (the byte-level
tokenizer emits one byte per token) and any tail that could still grow into a stop string are
held back, so a streamed response never shows text that the final response would not contain.
"""

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextTracker:
    """Follows one sequence's generated tokens; `update` returns the newly final text.

    Decoding is incremental, as in vLLM: each update decodes only the tokens since the last committed
    chunk, with that chunk as context, so a step's work does not grow with the length of the generation
    (decoding every generated token on every step made a 2,000-token answer's last steps hundreds of times
    dearer than its first; benchmarks/bench_detokenize.py). A chunk is committed once it does not end in a
    partial character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.emitted = 0
        self.text = ""  # the committed text: that of token_ids[:read]
        self.prefix = 0  # token_ids[prefix:read], the last committed chunk, is the next decode's context
        self.read = 0

    def update(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text, hit a stop string) after the generated tokens became `token_ids` (only ever extended)."""
        text = self._decoded(token_ids, final)
        hit = self._first_stop(text)
        if hit is not None:
            return self._release(text[:hit]), True
        if final:
            return self._release(text), False
        safe = len(text.rstrip(REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe = min(safe, len(text[:safe]) - k)
                    break
        return self._release(text[: max(safe, self.emitted)]), False

    def _decoded(self, token_ids: list[int], final: bool) -> str:
        """The text of all of `token_ids`: the committed text plus the decoded tail, which is committed unless it
        ends in a partial character (more bytes may complete it) and the sequence goes on."""
        context = self._decode(token_ids[self.prefix : self.read])
        tail = self._decode(token_ids[self.prefix :])[len(context) :]
        if final or not tail.endswith(REPLACEMENT):
            self.text += tail
            self.prefix, self.read = self.read, len(token_ids)
            return self.text
        return self.text + tail

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _release(self, text: str) -> str:
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta
