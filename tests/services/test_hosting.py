"""Where ``EngineHost`` runs a step (on the event loop's thread while one sequence is live, on the
engine thread otherwise or when ``SPLITSPEC_INLINE_STEPS=0``), and the numbered draft contexts
of ``SequenceTable``."""

import asyncio
import threading
import time

import pytest

from services.worker.hosting import EngineHost, SequenceTable
from splitspec.errors import Aborted


class ThreadRecordingEngine:
    """Stands in for a target or draft engine: its step reports the thread it ran on."""

    def __init__(self, live: int) -> None:
        self.sequences = SequenceTable()
        for i in range(live):
            self.sequences.add(f"s{i}", object())

    def verify(self, sequence_id: str) -> str:
        return threading.current_thread().name

    def prefill(self, seconds: float) -> None:
        time.sleep(seconds)


async def step_thread(live: int) -> str:
    host = EngineHost("target")
    host.attach(ThreadRecordingEngine(live), None)
    try:
        return await host.step(lambda engine: engine.verify("s0"))
    finally:
        host.executor.shutdown()


@pytest.mark.parametrize("live,inline", [(0, True), (1, True), (2, False)])
def test_a_step_runs_on_the_loop_while_one_sequence_is_live(live, inline):
    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    ran_on = asyncio.run(step_thread(live))
    assert (ran_on == loop_thread) is inline
    assert inline or ran_on.startswith("target-engine")


def test_the_environment_sends_every_step_to_the_engine_thread(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_INLINE_STEPS", "0")
    assert asyncio.run(step_thread(1)).startswith("target-engine")


def test_a_step_never_overtakes_work_on_the_engine_thread():
    """A step issued while a prefill runs on the engine thread queues behind it there (the engine
    is used from one thread at a time), though one sequence is live."""

    async def scenario():
        host = EngineHost("target")
        host.attach(ThreadRecordingEngine(1), None)
        prefill = asyncio.ensure_future(host.call(lambda engine: engine.prefill(0.2)))
        await asyncio.sleep(0.01)
        ran_on = await host.step(lambda engine: engine.verify("s0"))
        done_first = prefill.done()
        host.executor.shutdown()
        return ran_on, done_first

    ran_on, prefill_done_first = asyncio.run(scenario())
    assert ran_on.startswith("target-engine") and prefill_done_first


def test_numbered_contexts_released_or_replaced_are_refused():
    table = SequenceTable()
    first = table.claim("s", 1, list)
    assert table.claim("s", 1, list) is first  # the live context, not a new one
    assert table.claim("s", 0, list) is first  # unnumbered steps take whatever is live
    second = table.claim("s", 2, list)  # a newer context replaces the live one
    assert second is not first and len(table) == 1
    with pytest.raises(Aborted, match="context 1 of sequence 's' was replaced by context 2"):
        table.claim("s", 1, list)
    assert table.pop("s", 2) and not table.pop("s", 2)
    for stale in (1, 2):  # a step still in flight when its context was released cannot bring it back
        with pytest.raises(Aborted, match="start context 3 or later"):
            table.claim("s", stale, list)
    assert len(table) == 0
    assert table.claim("s", 3, list) == [] and len(table) == 1


def test_a_release_ahead_of_its_contexts_first_step_is_remembered():
    """The race it exists for: the gateway gave up on a context's first step and released the
    context before the step reached the engine."""
    table = SequenceTable()
    assert not table.pop("s", 1)
    with pytest.raises(Aborted):
        table.claim("s", 1, list)
    assert len(table) == 0


def test_released_numbers_are_forgotten_oldest_first(monkeypatch):
    monkeypatch.setattr(SequenceTable, "MAX_RELEASED", 2)
    table = SequenceTable()
    for sid in ("a", "b", "c"):
        table.pop(sid, 1)
    table.claim("a", 1, list)  # forgotten: a step of context 1 is taken as new again
    with pytest.raises(Aborted):
        table.claim("c", 1, list)
