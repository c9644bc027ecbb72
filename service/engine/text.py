"""Incremental detokenization with stop strings, safe for streaming.

Text is only released once it cannot change: a trailing partial UTF-8 character (the byte-level
tokenizer emits one byte per token) and any tail that could still grow into a stop string are
held back, so a streamed response never shows text that the final response would not contain.
"""

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextTracker:
    """Follows one sequence's generated tokens; `update` returns the newly final text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.emitted = 0
        self.text = ""

    def update(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text, hit a stop string) after the generated tokens became `token_ids`."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
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

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _release(self, text: str) -> str:
        delta = text[self.emitted :]
        self.emitted = len(text)
        self.text = text
        return delta
