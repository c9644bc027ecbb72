"""A model's requests are submitted in seq_id order whatever order they arrive in (the client sends a
forward_backward's chunks at once, the first one last); a repeated seq_id gets its first answer; a refused
request still takes its turn; a gap that never fills is a 408, which the client retries."""

import asyncio

import pytest

from inkwell.service.errors import APIError
from inkwell.service.tinker.ordering import SeqGate


def test_early_arrivals_wait_for_their_turn():
    async def run() -> list[int]:
        gate, order = SeqGate(), []

        async def submit(seq: int) -> int:
            order.append(seq)
            return seq * 10

        tasks = [asyncio.ensure_future(gate.run(seq, lambda s=seq: submit(s), 5.0)) for seq in (3, 2, 4)]
        await asyncio.sleep(0.05)
        assert order == []  # 1 has not arrived
        first = await gate.run(1, lambda: submit(1), 5.0)
        answers = await asyncio.gather(*tasks)
        again = await gate.run(2, lambda: submit(99), 5.0)  # sent again: the first answer, not a second submit
        return [first, *answers, again, *order]

    assert asyncio.run(run()) == [10, 30, 20, 40, 20, 1, 2, 3, 4]


def test_a_refused_request_takes_its_turn_and_a_gap_times_out():
    async def run() -> None:
        gate = SeqGate()

        async def refuse() -> None:
            raise APIError(400, "invalid_datum", "no")

        async def ok() -> str:
            return "ok"

        with pytest.raises(APIError):
            await gate.run(1, refuse, 1.0)
        with pytest.raises(APIError) as again:
            await gate.run(1, ok, 1.0)
        assert again.value.code == "invalid_datum"
        assert await gate.run(2, ok, 1.0) == "ok"
        with pytest.raises(APIError) as gap:
            await gate.run(4, ok, 0.1)
        assert gap.value.status == 408 and gap.value.details["retryable"]
        assert await gate.run(3, ok, 1.0) == "ok"

    asyncio.run(run())
