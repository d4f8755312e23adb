"""``rpc.sequence_stream``, the body of every step stream (gRPC ``*Stream`` RPCs and the step
socket): requests read ahead of their answers (pipelining), steps started in the order read,
answers in that order, and nothing left running when the stream ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from splitspec.errors import FailedPrecondition, InvalidArgument
from splitspec.transport.rpc import PIPELINE_DEPTH, sequence_stream


@dataclass
class Request:
    sequence_id: str
    n: int
    opens: bool = False


class Steps:
    """A step function whose steps finish when the test says so; it logs reads and starts."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.finish: dict[int, asyncio.Future] = {}
        self.cancelled: list[int] = []

    async def requests(self, requests: list[Request]):
        for r in requests:
            self.log.append(("read", r.n))
            yield r

    async def step(self, request: Request, _context) -> int:
        self.log.append(("start", request.n))
        self.finish[request.n] = asyncio.get_running_loop().create_future()
        try:
            return await self.finish[request.n]
        except asyncio.CancelledError:
            self.cancelled.append(request.n)
            raise

    def answer(self, n: int, value=None) -> None:
        if isinstance(value, BaseException):
            self.finish[n].set_exception(value)
        else:
            self.finish[n].set_result(n if value is None else value)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_requests_are_read_ahead_and_answered_in_order():
    async def scenario():
        s = Steps()
        answers = sequence_stream(s.requests([Request("a", n) for n in range(4)]), None, s.step)
        first = asyncio.ensure_future(anext(answers))
        await settle()
        # Two requests read and both steps started before any answer; the third waits unread.
        assert PIPELINE_DEPTH == 2 and sorted(s.log) == [("read", 0), ("read", 1), ("start", 0), ("start", 1)]
        s.answer(1)
        await settle()
        assert not first.done()  # the second step finished first; the first answer still leads
        s.answer(0)
        assert await first == 0
        await settle()
        assert ("read", 2) in s.log and ("start", 2) in s.log and ("read", 3) not in s.log
        assert await anext(answers) == 1
        for n in (2, 3):
            await settle()
            s.answer(n)
            assert await anext(answers) == n
        with pytest.raises(StopAsyncIteration):
            await anext(answers)

    asyncio.run(scenario())


def test_an_error_comes_after_the_answers_before_it_and_stops_the_steps_behind_it():
    async def scenario():
        s = Steps()
        # A request naming another sequence: refused once the answers before it are out.
        mixed = sequence_stream(s.requests([Request("a", 0), Request("a", 1), Request("b", 2)]), None, s.step)
        got = []
        task = asyncio.ensure_future(anext(mixed))
        await settle()
        s.answer(0)
        got.append(await task)
        await settle()
        s.answer(1)
        got.append(await anext(mixed))
        with pytest.raises(InvalidArgument, match="'b' on the stream of sequence 'a'"):
            await anext(mixed)
        assert got == [0, 1]

        # A step that fails ends the stream; the step started behind it is cancelled first.
        s = Steps()
        failing = sequence_stream(s.requests([Request("a", n) for n in range(3)]), None, s.step)
        task = asyncio.ensure_future(anext(failing))
        await settle()
        s.answer(0, FailedPrecondition("lost"))
        with pytest.raises(FailedPrecondition):
            await task
        assert s.cancelled == [1] and ("read", 2) not in s.log

    asyncio.run(scenario())


def test_closing_the_stream_cancels_the_steps_it_started():
    async def scenario():
        s = Steps()
        answers = sequence_stream(s.requests([Request("a", n) for n in range(5)]), None, s.step)
        task = asyncio.ensure_future(anext(answers))
        await settle()
        s.answer(0)
        assert await task == 0
        await settle()
        await answers.aclose()  # the client went away with steps 1 and 2 in flight
        assert sorted(s.cancelled) == [1, 2]

    asyncio.run(scenario())


def test_an_opening_call_finishes_before_the_next_step_starts():
    """The step socket's Prefill does not queue with the steps: the step after it must not start
    while it runs, or it would reach the engine before the sequence exists."""

    async def scenario():
        s = Steps()
        requests = [Request("a", 0, opens=True), Request("a", 1), Request("a", 2)]
        answers = sequence_stream(s.requests(requests), None, s.step, alone=lambda r: r.opens)
        task = asyncio.ensure_future(anext(answers))
        await settle()
        assert ("start", 1) not in s.log
        s.answer(0)
        assert await task == 0
        await settle()
        assert ("start", 1) in s.log and ("start", 2) in s.log  # ordinary steps pipeline again
        for n in (1, 2):
            s.answer(n)
            assert await anext(answers) == n

    asyncio.run(scenario())
