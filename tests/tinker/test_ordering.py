"""A model's requests start in seq_id order whatever order they arrive in, each answered at once (the client
waits for the POSTs of a forward_backward's later chunks before it sends the first); a repeated seq_id gets its
first answer; a request refused on arrival still takes its turn; one whose predecessor never comes is given up,
and the model goes on without that predecessor."""

import asyncio

import pytest

from inkwell.service.errors import APIError
from inkwell.service.tinker.ordering import Admitted, SeqGate


def _request(seq: int, started: list[int], given_up: list[str]):
    async def accept() -> Admitted[int]:
        async def start() -> None:
            started.append(seq)

        return Admitted(seq * 10, start, given_up.append)

    return accept


def test_early_arrivals_are_answered_at_once_and_started_in_order():
    async def run() -> None:
        gate, started, given_up = SeqGate(), [], []
        assert [await gate.admit(seq, _request(seq, started, given_up), 5.0) for seq in (3, 2, 4)] == [30, 20, 40]
        assert started == []  # 1 has not arrived
        assert await gate.admit(1, _request(1, started, given_up), 5.0) == 10
        assert started == [1, 2, 3, 4]
        assert await gate.admit(2, _request(99, started, given_up), 5.0) == 20  # sent again: the first answer
        assert started == [1, 2, 3, 4] and given_up == []
        with pytest.raises(APIError) as stale:
            await _forgotten(gate)
        assert stale.value.code == "stale_seq_id"

    asyncio.run(run())


async def _forgotten(gate: SeqGate) -> int:
    gate._answers.pop(1)  # as if evicted: a seq_id below the next one is then refused, not run twice
    return await gate.admit(1, _request(1, [], []), 5.0)


def test_a_refused_request_takes_its_turn_and_a_gap_is_given_up_and_passed_over():
    async def run() -> None:
        gate, started, given_up = SeqGate(), [], []

        async def refuse() -> Admitted[int]:
            raise APIError(400, "invalid_datum", "no")

        with pytest.raises(APIError):
            await gate.admit(1, refuse, 1.0)
        with pytest.raises(APIError) as again:
            await gate.admit(1, _request(1, started, given_up), 1.0)
        assert again.value.code == "invalid_datum"
        assert await gate.admit(2, _request(2, started, given_up), 1.0) == 20 and started == [2]
        assert await gate.admit(4, _request(4, started, given_up), 0.1) == 40
        assert await gate.admit(6, _request(6, started, given_up), 5.0) == 60  # waits for 3 (and 5) too
        await asyncio.sleep(0.3)
        assert given_up == ["seq_id 4 waited 0s for seq_id 3, which never arrived"]
        assert started == [2]  # 4 was given up: never started; 3 was passed over; 6 still waits for 5
        with pytest.raises(APIError) as late:
            await gate.admit(3, _request(3, started, given_up), 1.0)
        assert late.value.code == "seq_id_passed_over" and "seq_id 4 waited" in late.value.message
        assert await gate.admit(5, _request(5, started, given_up), 1.0) == 50
        assert started == [2, 5, 6]  # the model went on

    asyncio.run(run())


def test_a_request_whose_predecessors_are_all_here_is_not_given_up():
    """Its timer runs out while the one before it is still starting (a slow start): nothing is missing, so it
    waits its turn, and the timer raises nothing in the event loop."""

    async def run() -> None:
        gate, started, given_up, errors = SeqGate(), [], [], []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        release = asyncio.Event()

        async def slow() -> Admitted[int]:
            async def start() -> None:
                await release.wait()
                started.append(1)

            return Admitted(10, start, given_up.append)

        assert await gate.admit(2, _request(2, started, given_up), 0.1) == 20
        first = asyncio.ensure_future(gate.admit(1, slow, 5.0))
        await asyncio.sleep(0.3)  # 2's timer ran out while 1 was starting
        release.set()
        assert await first == 10
        await asyncio.sleep(0)
        assert given_up == [] and started == [1, 2] and errors == []

    asyncio.run(run())
