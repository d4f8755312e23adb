"""Where ``EngineHost`` runs a step (on the event loop's thread while one sequence is live and
steps are short, on the engine thread otherwise or when ``SPLITSPEC_INLINE_STEPS=0``), what a
call whose caller went away leaves behind, and the ``SequenceTable``'s guarantees: numbered draft
contexts, and sequences whose release arrives before or while they are created."""

import asyncio
import threading
import time

import pytest

from services.worker.batching import StepBatcher
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


def verifier(host: EngineHost) -> StepBatcher:
    """Steps ``(sequence_id, seconds)`` run by ``ThreadRecordingEngine.verify``, a pass at a time."""
    return StepBatcher(host, lambda engine, items: [engine.verify(sid, seconds) for sid, seconds in items], key=lambda item: item[0])


async def step_threads(live: int, steps: int = 2, seconds: float = 0.0) -> list[str]:
    host = EngineHost("target")
    host.attach(ThreadRecordingEngine(live), None)
    batcher = verifier(host)
    threads = []
    try:
        for _ in range(steps):
            threads.append(await batcher.submit(("s0", seconds)))
            while host.thread_busy():  # the thread hands the result over before it is done with the pass
                await asyncio.sleep(0.001)
        return threads
    finally:
        host.executor.shutdown()


@pytest.mark.parametrize("live,inline", [(0, True), (1, True), (2, False)])
def test_a_short_step_runs_on_the_loop_while_one_sequence_is_live(live, inline, monkeypatch):
    """The first step, of unknown length, runs on the engine thread; once steps are known to be
    short they run on the loop's thread, with one sequence live."""
    # The rule, not the threshold: on a loaded machine an empty step's thread can wait 20 ms for the GIL.
    monkeypatch.setenv("SPLITSPEC_INLINE_STEP_MAX_MS", "1000")
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
        batcher = verifier(host)
        await batcher.submit(("s0", 0.3))  # measured: long
        step = asyncio.ensure_future(batcher.submit(("s0", 0.5)))
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
        batcher = verifier(host)
        await batcher.submit(("s0", 0.0))  # measured: short, so it could run inline
        prefill = asyncio.ensure_future(host.call(lambda engine: engine.prefill(0.2)))
        await asyncio.sleep(0.01)
        ran_on = await batcher.submit(("s0", 0.0))
        done_first = prefill.done()
        host.executor.shutdown()
        return ran_on, done_first

    ran_on, prefill_done_first = asyncio.run(scenario())
    assert ran_on.startswith("target-engine") and prefill_done_first


class PassRecordingEngine:
    """Records the steps of every pass; a step ``(sid, "fail")`` fails alone."""

    def __init__(self, live: int, seconds: float = 0.05) -> None:
        self.sequences = SequenceTable()
        for i in range(live):
            self.sequences.add(f"s{i}", object())
        self.passes: list[list[str]] = []
        self.started: list[float] = []  # time.monotonic() at each pass's start
        self.seconds = seconds

    def run(self, items: list) -> list:
        self.passes.append([sid for sid, _ in items])
        self.started.append(time.monotonic())
        time.sleep(self.seconds)
        return [ValueError(f"bad step of {sid}") if what == "fail" else f"{sid}:{what}" for sid, what in items]


def batched(live: int, scenario, seconds: float = 0.05, max_gather_s: float = 0.002, gap_s: float = 0.0, cohorts=()):
    """``scenario(batcher)`` against ``live`` sequences whose passes take ``seconds``, with the
    batcher's gather window and gap; ``cohorts`` (sets of sequence ids) ran together before, in
    that order, and the last pass took ``seconds``. A step ``(sid, "late")`` says its sequence's
    next step comes late."""

    async def run():
        host = EngineHost("target")
        engine = PassRecordingEngine(live, seconds)
        host.attach(engine, None)
        batcher = StepBatcher(
            host, lambda e, items: e.run(items), key=lambda item: item[0], max_gather_s=max_gather_s, gather_gap_s=gap_s,
            late=lambda item: item[1] == "late",
        )
        for cohort in cohorts:
            batcher._remember(set(cohort), set())
        if cohorts:
            batcher._last_pass_s = seconds
        try:
            return await scenario(batcher), engine.passes
        finally:
            host.executor.shutdown()

    return asyncio.run(run())


def test_steps_arriving_during_a_pass_run_together_in_the_next():
    async def scenario(batcher):
        first = asyncio.ensure_future(batcher.submit(("s0", "a")))
        await asyncio.sleep(0.01)  # s0's pass runs; the others arrive meanwhile
        rest = [asyncio.ensure_future(batcher.submit((f"s{i}", "b"))) for i in (1, 2, 3)]
        return await asyncio.gather(first, *rest)

    results, passes = batched(4, scenario)
    assert results == ["s0:a", "s1:b", "s2:b", "s3:b"]
    assert passes == [["s0"], ["s1", "s2", "s3"]]


def test_the_next_pass_of_every_live_sequence_starts_on_the_engine_thread_while_the_loop_is_busy():
    """Steps read ahead (every live sequence's next step waits before the pass ends) run as the
    next pass at once, without the event loop: here the loop is held past the first pass's end, and
    the second pass still starts when the first ends. Results come back in order."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((f"s{i}", "a"))) for i in (0, 1)]
        await asyncio.sleep(0.01)  # the first pass runs (50 ms)
        second = [asyncio.ensure_future(batcher.submit((f"s{i}", "b"))) for i in (0, 1)]
        await asyncio.sleep(0)  # both wait for the next pass
        time.sleep(0.15)  # the loop's thread is busy past the first pass's end
        freed = time.monotonic()
        return freed, await asyncio.gather(*first, *second), batcher.host.engine.started

    (freed, results, started), passes = batched(2, scenario, cohorts=[{"s0", "s1"}])
    assert results == ["s0:a", "s1:a", "s0:b", "s1:b"] and passes == [["s0", "s1"], ["s0", "s1"]]
    assert started[1] < freed - 0.05  # about 0.09 s before the loop was free


def test_work_queued_for_the_engine_thread_runs_before_a_chained_pass():
    """A prefill queued while a pass runs goes before the next pass, even with every live
    sequence's next step waiting: the chain of passes on the engine thread yields to it."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((f"s{i}", "a"))) for i in (0, 1)]
        await asyncio.sleep(0.01)
        second = [asyncio.ensure_future(batcher.submit((f"s{i}", "b"))) for i in (0, 1)]
        await asyncio.sleep(0)
        prefill = asyncio.ensure_future(batcher.host.call(lambda engine: engine.passes.append(["prefill"])))
        return await asyncio.gather(*first, *second, prefill)

    results, passes = batched(2, scenario, cohorts=[{"s0", "s1"}])
    assert results[:4] == ["s0:a", "s1:a", "s0:b", "s1:b"]
    assert passes == [["s0", "s1"], ["prefill"], ["s0", "s1"]]


def test_a_pass_waits_briefly_for_the_sequences_of_its_cohorts():
    """Sequences that ran together come back one by one: the next pass starts once all are back, not
    with the first to return, and a sequence with no pass yet waits for the last pass's."""

    async def scenario(batcher):
        late = []
        for sid in ("s0", "s1", "s2", "new"):  # 1 ms apart, inside the gather window (50 ms here)
            late.append(asyncio.ensure_future(batcher.submit((sid, "b"))))
            await asyncio.sleep(0.001)
        return await asyncio.gather(*late)

    results, passes = batched(5, scenario, seconds=0.2, max_gather_s=0.05, gap_s=0.02, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    # s0, s1: a cohort; s2 brings s3's cohort, and s3 stays away: the window ends the wait
    assert results == ["s0:b", "s1:b", "s2:b", "new:b"]
    assert passes == [["s0", "s1", "s2", "new"]]


def test_a_back_cohort_waits_while_steps_keep_arriving():
    """A cohort that is back starts once arrivals pause for the gap, taking those that kept coming."""

    async def scenario(batcher):
        steps = [asyncio.ensure_future(batcher.submit(("s0", "b")))]
        await asyncio.sleep(0.005)  # s0's cohort is back; s1 comes within the gap (30 ms here)
        steps.append(asyncio.ensure_future(batcher.submit(("s1", "b"))))
        await asyncio.sleep(0)
        waiting = not batcher._running
        return waiting, await asyncio.gather(*steps)

    (waiting, results), passes = batched(3, scenario, max_gather_s=1.0, gap_s=0.03, cohorts=[{"s0"}, {"s1"}])
    assert waiting and results == ["s0:b", "s1:b"] and passes == [["s0", "s1"]]


def test_a_pass_does_not_wait_for_a_sequence_of_its_cohort_that_was_released():
    async def scenario(batcher):
        batcher.host.engine.sequences.pop("s2")  # its client left
        steps = [asyncio.ensure_future(batcher.submit((f"s{i}", "b"))) for i in range(2)]
        await asyncio.sleep(0)  # both steps have arrived
        started = batcher._running  # at once: no gather window for s2
        return started, await asyncio.gather(*steps)

    (started, results), passes = batched(4, scenario, seconds=0.05, max_gather_s=1.0, cohorts=[{"s0", "s1", "s2"}])
    assert started and results == ["s0:b", "s1:b"] and passes == [["s0", "s1"]]


def test_two_cohorts_take_turns_without_waiting_for_each_other():
    """Speculating sequences settle into cohorts that alternate: while one verifies, the other is
    at the draft. A cohort's steps start their pass once the cohort is back, without waiting out
    the gather window for the other cohort, which ran the last pass."""

    async def scenario(batcher):
        steps = [asyncio.ensure_future(batcher.submit((f"s{i}", "b"))) for i in (0, 1)]
        await asyncio.sleep(0)  # A is back; B, which ran the last pass, is away (at the draft)
        started = batcher._running  # at once: the window (1 s here) is not waited out for B
        partial = asyncio.ensure_future(batcher.submit(("s2", "b")))
        await asyncio.sleep(0.06)  # past A's pass; s2 is back without s3
        waits_for_s3 = not partial.done() and not batcher._running
        s3 = asyncio.ensure_future(batcher.submit(("s3", "b")))
        return started, waits_for_s3, await asyncio.gather(*steps, partial, s3)

    (started, waits_for_s3, results), passes = batched(4, scenario, max_gather_s=1.0, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    assert started and waits_for_s3
    assert results == ["s0:b", "s1:b", "s2:b", "s3:b"]
    assert passes == [["s0", "s1"], ["s2", "s3"]]


@pytest.mark.parametrize("late", [True, False])
def test_no_pass_waits_for_a_sequence_whose_last_step_said_its_next_comes_late(late):
    """A sequence that goes to the draft while the others of its pass decode on (its last step's
    ``next_step_late``: the adaptive budget's explorer) is left out of its pass's cohort and out
    of every live sequence until it is back: the others' next pass starts as soon as their steps
    are, on the engine thread, where without the flag it waits out the gather window (half the
    last pass here) for it. Its own step, when it comes, runs in a later pass."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((sid, what))) for sid, what in (("s0", "a"), ("s1", "a"), ("s2", "late" if late else "a"))]
        await asyncio.sleep(0.01)  # the first pass runs (50 ms); s0 and s1 send their next steps meanwhile
        second = [asyncio.ensure_future(batcher.submit((sid, "b"))) for sid in ("s0", "s1")]
        await asyncio.gather(*first, *second)
        await batcher.submit(("s2", "b"))
        return batcher.host.engine.started

    started, passes = batched(3, scenario, max_gather_s=1.0, cohorts=[{"s0", "s1", "s2"}])
    assert passes == [["s0", "s1", "s2"], ["s0", "s1"], ["s2"]]
    waited = started[1] - started[0] - 0.05  # between the first pass's end and the second's start
    assert waited < 0.015 if late else waited > 0.02, waited


def test_the_cohort_memory_forgets_released_sequences():
    async def scenario(batcher):
        batcher.max_batch = 2  # the memory keeps at most 2 * max(live, max_batch) sequences
        for round_ in range(6):  # a pass of two sequences, then both are released and two new ones come
            pair = [f"r{round_}-{i}" for i in (0, 1)]
            for sid in pair:
                batcher.host.engine.sequences.add(sid, object())
            await asyncio.gather(*(batcher.submit((sid, "a")) for sid in pair))
            for sid in pair:
                batcher.host.engine.sequences.pop(sid)
        return set(batcher._cohorts)

    remembered, passes = batched(0, scenario, seconds=0.01, gap_s=0.001)
    assert [len(p) for p in passes] == [1, 1] + [2] * 5  # the first pass starts with the first step
    assert len(remembered) <= 2 * 2 + 2 and {"r5-0", "r5-1"} <= remembered


def test_a_failing_step_fails_alone_and_one_sequence_has_one_step_a_pass():
    async def scenario(batcher):
        first = asyncio.ensure_future(batcher.submit(("s0", "a")))
        await asyncio.sleep(0.01)
        steps = [asyncio.ensure_future(batcher.submit(item)) for item in (("s1", "fail"), ("s2", "b"), ("s2", "c"))]
        outcomes = await asyncio.gather(first, *steps, return_exceptions=True)
        return [str(o) for o in outcomes]

    results, passes = batched(3, scenario)
    assert results == ["s0:a", "bad step of s1", "s2:b", "s2:c"]
    assert passes == [["s0"], ["s1", "s2"], ["s2"]]


def test_each_result_learns_how_long_its_step_waited_for_its_pass():
    """A result with a ``queue_ns`` field (a target's VerifyResult) gets its step's wait: the gateway's
    adaptive budget tells waiting behind other passes from its own costs."""

    class Result:
        queue_ns = -1

    async def scenario(batcher):
        first = asyncio.ensure_future(batcher.submit(("s0", "a")))
        await asyncio.sleep(0.01)  # s1 arrives while s0's 50 ms pass runs, and waits for it
        second = asyncio.ensure_future(batcher.submit(("s1", "b")))
        return await asyncio.gather(first, second)

    async def run():
        host = EngineHost("target")
        engine = PassRecordingEngine(2)
        host.attach(engine, None)
        batcher = StepBatcher(host, lambda e, items: [Result() for _ in e.run(items)], key=lambda item: item[0])
        try:
            return await scenario(batcher)
        finally:
            host.executor.shutdown()

    first, second = asyncio.run(run())
    assert 0 <= first.queue_ns < 0.02e9 and 0.02e9 < second.queue_ns < 0.2e9
    assert first.queue_prompt_ns == second.queue_prompt_ns == 0  # no prompt ran meanwhile


def test_a_step_waiting_behind_a_prompt_learns_that_part_of_its_wait():
    """A step that arrives while another sequence's prompt (``host.open``, 80 ms) runs waits for it,
    then for a 50 ms pass of a step that came before: its ``queue_prompt_ns`` is the prompt's share
    of its wait, which the gateway's budget prices as a constant, not as passes."""

    class Result:
        queue_ns = queue_prompt_ns = -1

    async def run():
        host = EngineHost("target")
        engine = PassRecordingEngine(3)
        host.attach(engine, None)
        batcher = StepBatcher(host, lambda e, items: [Result() for _ in e.run(items)], key=lambda item: item[0], max_gather_s=0.0)
        try:
            first = asyncio.ensure_future(batcher.submit(("s0", "a")))  # its pass runs 50 ms
            await asyncio.sleep(0.01)
            prompt = asyncio.ensure_future(host.open("s9", lambda e: time.sleep(0.08)))  # queued behind that pass
            await asyncio.sleep(0.01)
            second = asyncio.ensure_future(batcher.submit(("s1", "b")))  # behind the pass, then the prompt
            await prompt
            return await asyncio.gather(first, second)
        finally:
            host.executor.shutdown()

    first, second = asyncio.run(run())
    assert first.queue_prompt_ns == 0
    assert 0.07e9 < second.queue_prompt_ns < 0.12e9 and 0.1e9 < second.queue_ns < 0.3e9
    assert second.queue_ns - second.queue_prompt_ns > 0.02e9  # and the rest of the pass before


def test_a_caller_gone_before_its_pass_leaves_it():
    async def scenario(batcher):
        first = asyncio.ensure_future(batcher.submit(("s0", "a")))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.submit(("s1", "b")))
        stays = asyncio.ensure_future(batcher.submit(("s2", "b")))
        await asyncio.sleep(0)
        gone.cancel()
        return await asyncio.gather(first, stays)

    results, passes = batched(3, scenario)
    assert results == ["s0:a", "s2:b"] and passes == [["s0"], ["s2"]]


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


@pytest.mark.parametrize(("threads", "device_type", "expected"), [(0, "cuda", 1), (3, "cuda", 2), (0, "cpu", 2)])
def test_a_gpu_worker_keeps_one_torch_thread_once_loaded_unless_told_otherwise(threads, device_type, expected):
    """A GPU worker's host-side ops are small copies: torch's thread pool spinning in them starved
    the services sharing its cores. A CPU worker computes there and keeps its threads; so does one
    given --threads (which its main set before loading)."""
    import torch

    from services.worker.hosting import settle_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        settle_threads(threads, device_type, "draft")
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
