"""What one serving worker has answered: requests, tokens and its recent token rate (the fleet's status route)."""

import threading
import time
from collections import deque

RATE_WINDOW_SECONDS = 10.0


class WorkerStats:
    """Counters a worker's handle updates as requests start and tokens arrive (from its reader thread)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self.requests = 0
        self.tokens = 0
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def request(self) -> None:
        with self._lock:
            self.requests += 1

    def produced(self, tokens: int) -> None:
        if tokens:
            now = time.monotonic()
            with self._lock:
                self.tokens += tokens
                self._recent.append((now, tokens))
                self._drop(now)

    def tokens_per_s(self) -> float:
        """Tokens produced over the last `window` seconds, per second (0 when idle that long)."""
        now = time.monotonic()
        with self._lock:
            self._drop(now)
            return sum(n for _, n in self._recent) / self.window

    def _drop(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()
