"""Where ``EngineHost`` runs a step: on the event loop's thread while one sequence is live, on the
engine thread otherwise or when ``SPLITSPEC_INLINE_STEPS=0``."""

import asyncio
import threading
import time

import pytest

from splitspec.services.hosting import EngineHost, SequenceTable


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
        return await host.step("verify", "s0")
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
        prefill = asyncio.ensure_future(host.call("prefill", 0.2))
        await asyncio.sleep(0.01)
        ran_on = await host.step("verify", "s0")
        done_first = prefill.done()
        host.executor.shutdown()
        return ran_on, done_first

    ran_on, prefill_done_first = asyncio.run(scenario())
    assert ran_on.startswith("target-engine") and prefill_done_first
