"""Each training model's requests run in `seq_id` order, whatever order they arrive in.

The client numbers a model's requests 1, 2, 3, ... and POSTs request n+1 once POST n has returned, except the
chunks of one forward_backward, which it sends at once with the first chunk last. A request arriving early waits
here until every earlier one has been submitted to the session (its queue then keeps the order). A request sent
again (the client retries a timed-out POST) gets the answer its first arrival got; a failed request counts as
done, so the ones after it still run.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from inkwell.service.errors import APIError

ANSWERS_KEPT = 256  # per model: a retry comes back within the client's retry window, long before this many requests


class SeqGate:
    def __init__(self, next_seq: int = 1) -> None:
        self.next_seq = next_seq
        self._turn = asyncio.Condition()
        self._answers: OrderedDict[int, object] = OrderedDict()

    async def run[T](self, seq_id: int, submit: Callable[[], Awaitable[T]], wait_seconds: float) -> T:
        """`submit()` once every request before `seq_id` has been; the first answer again for a repeated seq_id.
        408 (which the client retries) when an earlier request has not arrived within `wait_seconds`."""
        async with self._turn:
            try:
                await asyncio.wait_for(self._turn.wait_for(lambda: self.next_seq >= seq_id), wait_seconds)
            except TimeoutError:
                raise APIError(
                    408,
                    "request_timeout",
                    f"seq_id {seq_id} waited {wait_seconds:.0f}s for seq_id {self.next_seq}, which has not arrived",
                    retryable=True,
                ) from None
            if seq_id in self._answers:
                return self._replay(seq_id)
            if seq_id < self.next_seq:
                raise APIError(
                    400,
                    "stale_seq_id",
                    f"seq_id {seq_id} was already used by this model (next is {self.next_seq}); number requests 1, 2, "
                    "3, ...",
                )
            try:
                answer: object = await submit()
            except Exception as exc:  # noqa: BLE001 - kept and raised again: a failed request still takes its turn
                answer = exc
            self._answers[seq_id] = answer
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
            self.next_seq = seq_id + 1
            self._turn.notify_all()
            return self._replay(seq_id)

    def _replay(self, seq_id: int):
        answer = self._answers[seq_id]
        if isinstance(answer, Exception):
            raise answer
        return answer
