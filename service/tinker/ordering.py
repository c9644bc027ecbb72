"""Each training model's requests reach its session in `seq_id` order, whatever order they arrive in.

The client numbers a model's requests 1, 2, 3, ... and POSTs request n+1 once POST n has returned, except the
chunks of one forward_backward: it sends them at once, the first one last, and waits for the POSTs of the later
chunks before it sends the first. So every request is answered at once (its future), and a request that arrives
early is started, in order, once every one before it has been. A request sent again (the client retries a POST
that timed out) gets the answer its first arrival got; one refused on arrival still takes its turn; one whose
predecessor never arrives is abandoned after a while (its future fails) and the missing ones are passed over, so
nothing waits forever and the model goes on.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from inkwell.service.errors import APIError

ANSWERS_KEPT = 256  # per model: a retry comes back within the client's retry window, long before this many requests


@dataclass
class Admitted[T]:
    """A request taken in: what the client gets now, how to start it in its turn, how to give it up."""

    answer: T
    start: Callable[[], Awaitable[None]]
    abandon: Callable[[str], None]


class SeqGate:
    def __init__(self, next_seq: int = 1) -> None:
        self.next_seq = next_seq
        self._answers: OrderedDict[int, object] = OrderedDict()
        self._waiting: dict[int, Admitted | None] = {}  # None: refused or abandoned, nothing to start
        self._turn = asyncio.Lock()
        self._starting: set[asyncio.Future] = set()

    async def admit[T](self, seq_id: int, accept: Callable[[], Awaitable[Admitted[T]]], wait_seconds: float) -> T:
        """`accept()` the request now (an APIError refuses it, and it still takes its turn); start every admitted
        request whose turn has come; return this one's answer (the first one's for a repeated seq_id)."""
        if seq_id not in self._answers:
            if seq_id < self.next_seq:
                raise APIError(
                    400,
                    "stale_seq_id",
                    f"seq_id {seq_id} was already used by this model (next is {self.next_seq}); number requests "
                    "1, 2, 3, ...",
                )
            try:
                admitted: Admitted[T] | None = await accept()
                answer: object = admitted.answer
            except APIError as exc:
                admitted, answer = None, exc
            if seq_id not in self._answers:  # not taken in meanwhile by a copy of this request
                self._remember(seq_id, answer)
                self._waiting[seq_id] = admitted
                if admitted is not None and seq_id > self.next_seq:
                    asyncio.get_running_loop().call_later(wait_seconds, self._give_up, seq_id, wait_seconds)
            await self._start_due()
        answer = self._answers[seq_id]
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    async def _start_due(self) -> None:
        async with self._turn:
            while self.next_seq in self._waiting:
                admitted = self._waiting.pop(self.next_seq)
                self.next_seq += 1
                if admitted is not None:
                    await admitted.start()

    def _give_up(self, seq_id: int, waited: float) -> None:
        """Abandon `seq_id` and pass over the seq_ids before it that never arrived, so the model's later requests
        run (waiting for a lost request, every later one would be given up in turn, for good)."""
        admitted = self._waiting.get(seq_id)
        if admitted is None:
            return
        missing = [seq for seq in range(self.next_seq, seq_id) if seq not in self._waiting]
        if not missing:  # every one before it is here, the earliest still starting: it runs in its turn
            return
        reason = f"seq_id {seq_id} waited {waited:.0f}s for seq_id {missing[0]}, which never arrived"
        for seq in missing:
            self._waiting[seq] = None
            self._remember(
                seq,
                APIError(
                    400,
                    "seq_id_passed_over",
                    f"seq_id {seq} came too late: seq_id {seq_id} waited {waited:.0f}s for it and the model went on",
                ),
            )
        self._waiting[seq_id] = None
        admitted.abandon(reason)
        task = asyncio.ensure_future(self._start_due())  # those after it, already here, run now
        self._starting.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._starting.discard)

    def _remember(self, seq_id: int, answer: object) -> None:
        self._answers[seq_id] = answer
        while len(self._answers) > ANSWERS_KEPT:
            self._answers.popitem(last=False)
