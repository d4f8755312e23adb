"""Where ``EngineHost`` runs a step (on the event loop's thread while one sequence is live and
steps are short, on the engine thread otherwise or when ``SPLITSPEC_INLINE_STEPS=0``), what a
call whose caller went away leaves behind, and the ``SequenceTable``'s guarantees: numbered draft
contexts, and sequences whose release arrives before or while they are created."""

import asyncio
import threading
import time

import pytest

from services.worker.hosting import EngineHost, SequenceTable
from splitspec.errors import Aborted, FailedPrecondition


class ThreadRecordingEngine:
    """Stands in for a target or draft engine: its step reports the thread it ran on."""

    def __init__(self, live: int) -> None:
        self.sequences = SequenceTable()
        for i in range(live):
            self.sequences.add(f"s{i}", object())

    def verify(self, sequence_id: str, seconds: float = 0.0) -> str:
        time.sleep(seconds)
        return threading.current_thread().name

    def prefill(self, seconds: float) -> None:
        time.sleep(seconds)

    def create(self, sequence_id: str, seconds: float) -> str:
        """A prefill's use of the table: open, work, finish."""
        self.sequences.open(sequence_id)
        time.sleep(seconds)
        self.sequences.finish(sequence_id, object())
        return sequence_id


async def step_threads(live: int, steps: int = 2, seconds: float = 0.0) -> list[str]:
    host = EngineHost("target")
    host.attach(ThreadRecordingEngine(live), None)
    try:
        return [await host.step(lambda engine: engine.verify("s0", seconds)) for _ in range(steps)]
    finally:
        host.executor.shutdown()


@pytest.mark.parametrize("live,inline", [(0, True), (1, True), (2, False)])
def test_a_short_step_runs_on_the_loop_while_one_sequence_is_live(live, inline):
    """The first step, of unknown length, runs on the engine thread; once steps are known to be
    short they run on the loop's thread, with one sequence live."""
    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    first, second = asyncio.run(step_threads(live))
    assert first.startswith("target-engine")
    assert (second == loop_thread) is inline
    assert inline or second.startswith("target-engine")


def test_long_steps_stay_off_the_loop():
    """Steps longer than ``INLINE_STEP_MAX_S`` (a large model on a CPU) never hold the event loop,
    so health checks and Info are answered while they run."""
    ran_on = asyncio.run(step_threads(1, steps=3, seconds=2 * EngineHost.INLINE_STEP_MAX_S))
    assert all(name.startswith("target-engine") for name in ran_on)


def test_the_loop_answers_while_a_long_step_runs():
    async def scenario():
        host = EngineHost("target")
        host.attach(ThreadRecordingEngine(1), None)
        await host.step(lambda engine: engine.verify("s0", 0.3))  # measured: long
        step = asyncio.ensure_future(host.step(lambda engine: engine.verify("s0", 0.5)))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await asyncio.sleep(0)  # what a health check's answer needs: a turn of the loop
        waited = time.perf_counter() - t0
        running = not step.done()
        await step
        host.executor.shutdown()
        return waited, running

    waited, running = asyncio.run(scenario())
    assert running and waited < 0.05


def test_the_environment_sends_every_step_to_the_engine_thread(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_INLINE_STEPS", "0")
    assert all(name.startswith("target-engine") for name in asyncio.run(step_threads(1, steps=3)))


def test_a_step_never_overtakes_work_on_the_engine_thread():
    """A step issued while a prefill runs on the engine thread queues behind it there (the engine
    is used from one thread at a time), though one sequence is live."""

    async def scenario():
        host = EngineHost("target")
        host.attach(ThreadRecordingEngine(1), None)
        await host.step(lambda engine: engine.verify("s0"))  # measured: short, so it could run inline
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


def test_a_release_before_or_during_creation_leaves_nothing():
    """The target's Prefill waits on the engine thread while the gateway's Release, answered at once
    on the loop, overtakes it: in either order no sequence is left behind."""
    table = SequenceTable()
    assert not table.pop("early")  # released before its creation started
    with pytest.raises(Aborted, match="released before it was created"):
        table.open("early")
    table.open("early")  # refused once: the id can be opened again (nothing else uses the memory)
    table.abandon("early")

    table.open("during")
    with pytest.raises(FailedPrecondition, match="already live"):
        table.open("during")  # a second creation of an id while one runs
    assert not table.pop("during")  # released while its creation runs
    with pytest.raises(Aborted, match="released while it was being created"):
        table.finish("during", object())
    assert len(table) == 0

    table.open("live")
    table.finish("live", object())
    assert table.pop("live")  # released once live: gone, and nothing remembered
    table.open("live")  # the gateway re-prefills a sequence the worker lost
    table.finish("live", object())
    assert len(table) == 1


def test_a_creation_whose_caller_went_away_releases_what_it_made():
    """``EngineHost.open``: a Prefill cancelled (its client gone, its deadline passed) while its work
    runs releases the sequence once the work ends; one cancelled while still queued never runs."""

    async def scenario():
        host = EngineHost("target")
        engine = ThreadRecordingEngine(0)
        host.attach(engine, None)
        running = asyncio.ensure_future(host.open("running", lambda e: e.create("running", 0.3)))
        queued = asyncio.ensure_future(host.open("queued", lambda e: e.create("queued", 0.0)))
        await asyncio.sleep(0.1)
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        await asyncio.sleep(0.4)  # the running one finishes on the engine thread
        done = await host.open("kept", lambda e: e.create("kept", 0.0))
        host.executor.shutdown()
        return done, engine.sequences

    done, sequences = asyncio.run(scenario())
    assert done == "kept" and len(sequences) == 1 and "kept" in sequences
