"""``StepBatcher`` over a staged engine (``services.worker.batching.StagedEngine``): a pass whose
steps are ready while another pass is on the device is prepared then, launched as soon as that
pass settles and before its results are finished; sequences of the pass on the device, a refusal
and work queued for the engine thread keep a pass from being taken ahead; a stage that raises
fails its own pass's steps only."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from services.worker.batching import StepBatcher
from services.worker.hosting import EngineHost, SequenceTable


class DeviceEngine:
    """A staged engine whose passes run on a "device" (a timer thread) for ``seconds`` each. It
    logs every stage with the pass's sequences; a step ``(sid, "boom")`` makes its pass's launch
    raise, and with ``refuse_ahead`` a pass prepared ahead of another is refused (None)."""

    def __init__(self, live: int, seconds: float = 0.05, refuse_ahead: bool = False) -> None:
        self.sequences = SequenceTable()
        for i in range(live):
            self.sequences.add(f"s{i}", object())
        self.seconds, self.refuse_ahead = seconds, refuse_ahead
        self.log: list[tuple[str, list[str]]] = []
        self.busy_seen: list[frozenset[str]] = []

    def prepare_pass(self, items: list, busy: frozenset[str]):
        sids = [sid for sid, _ in items]
        assert not busy & set(sids), "a sequence of the pass on the device was taken ahead"
        self.busy_seen.append(busy)
        if busy and self.refuse_ahead:
            self.log.append(("refused", sids))
            return None
        self.log.append(("prepare", sids))
        return SimpleNamespace(items=items, sids=sids, done=threading.Event())

    def launch_pass(self, p, ahead: bool = False) -> None:
        if any(what == "boom" for _, what in p.items):
            raise RuntimeError("the device refused the pass")
        self.log.append(("launch", p.sids))
        threading.Timer(self.seconds, p.done.set).start()

    def pass_running(self, p) -> bool:
        return not p.done.is_set()

    def wait_pass(self, p) -> None:
        p.done.wait()

    def settle_pass(self, p) -> None:
        p.done.wait()
        self.log.append(("settle", p.sids))

    def finish_pass(self, p) -> list:
        self.log.append(("finish", p.sids))
        return [f"{sid}:{what}" for sid, what in p.items]


def staged(live: int, scenario, cohorts=(), **engine_options):
    """``scenario(batcher)`` against a :class:`DeviceEngine` of ``live`` sequences; ``cohorts``
    ran together before, in that order. A step ``(sid, "decode")`` comes straight back (its next
    step is read ahead). Returns its value and the engine's log."""

    async def run():
        host = EngineHost("target")
        engine = DeviceEngine(live, **engine_options)
        host.attach(engine, None)
        batcher = StepBatcher(
            host, lambda e, items: None, key=lambda item: item[0], max_gather_s=1.0, gather_gap_s=0.0, staged=True,
            straight_back=lambda item: item[1] == "decode",
        )
        for cohort in cohorts:
            batcher._remember(set(cohort), set())
        batcher._last_pass_s = engine.seconds  # a gather window: a step does not start its pass alone
        try:
            return await scenario(batcher), engine
        finally:
            host.executor.shutdown()

    return asyncio.run(run())


async def two_cohorts(batcher, second=("s2", "s3")):
    """Cohort s0, s1 starts; while its pass is on the device the ``second`` cohort's steps arrive."""
    first = [asyncio.ensure_future(batcher.submit((sid, "a"))) for sid in ("s0", "s1")]
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(batcher.submit((sid, "b"))) for sid in second]
    return await asyncio.gather(*first, *rest, return_exceptions=True)


def test_a_cohort_ready_while_the_others_pass_is_on_the_device_is_prepared_before_that_pass_settles():
    results, engine = staged(4, two_cohorts, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    assert results == ["s0:a", "s1:a", "s2:b", "s3:b"]
    a, b = ["s0", "s1"], ["s2", "s3"]
    assert engine.log == [
        ("prepare", a), ("launch", a), ("prepare", b), ("settle", a), ("launch", b), ("finish", a), ("settle", b), ("finish", b),
    ]
    assert engine.busy_seen == [frozenset(), frozenset(a)]


def test_a_sequence_of_the_pass_on_the_device_waits_for_that_pass_to_settle():
    """Decode steps read ahead (the same sequences' next steps) cannot be prepared before their
    last pass is committed: they are chained after it, and since nothing is on the device either
    way, after its results too (answered first, as unstaged passes are)."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((sid, "a"))) for sid in ("s0", "s1")]
        await asyncio.sleep(0.01)
        second = [asyncio.ensure_future(batcher.submit((sid, "b"))) for sid in ("s0", "s1")]
        return await asyncio.gather(*first, *second)

    results, engine = staged(2, scenario, cohorts=[{"s0", "s1"}])
    assert results == ["s0:a", "s1:a", "s0:b", "s1:b"]
    s = ["s0", "s1"]
    assert engine.log == [("prepare", s), ("launch", s), ("settle", s), ("finish", s), ("prepare", s), ("launch", s), ("settle", s), ("finish", s)]


def test_nothing_is_taken_ahead_of_a_pass_whose_sequences_come_straight_back():
    """Decode steps are read ahead: their sequences' next steps arrive while the pass runs, so the
    pass after it takes them with the others that came meanwhile (one pass, not two cohorts that
    would take turns from then on)."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((sid, "decode"))) for sid in ("s0", "s1")]
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(batcher.submit((sid, "b"))) for sid in ("s2", "s3")]
        await asyncio.sleep(0.01)
        rest += [asyncio.ensure_future(batcher.submit((sid, "next"))) for sid in ("s0", "s1")]
        return await asyncio.gather(*first, *rest)

    results, engine = staged(4, scenario, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    assert results == ["s0:decode", "s1:decode", "s2:b", "s3:b", "s0:next", "s1:next"]
    a, merged = ["s0", "s1"], ["s2", "s3", "s0", "s1"]
    assert engine.log == [("prepare", a), ("launch", a), ("settle", a), ("finish", a), ("prepare", merged), ("launch", merged), ("settle", merged), ("finish", merged)]


def test_a_pass_refused_ahead_is_prepared_after_the_settle():
    results, engine = staged(4, two_cohorts, cohorts=[{"s0", "s1"}, {"s2", "s3"}], refuse_ahead=True)
    assert results == ["s0:a", "s1:a", "s2:b", "s3:b"]
    a, b = ["s0", "s1"], ["s2", "s3"]
    assert engine.log == [
        ("prepare", a), ("launch", a), ("refused", b), ("settle", a), ("prepare", b), ("launch", b), ("finish", a), ("settle", b), ("finish", b),
    ]


def test_nothing_is_taken_ahead_while_other_work_is_queued_for_the_engine_thread():
    """A prefill queued during a pass runs before the next pass, as between passes started from the loop."""

    async def scenario(batcher):
        first = [asyncio.ensure_future(batcher.submit((sid, "a"))) for sid in ("s0", "s1")]
        await asyncio.sleep(0.01)
        prefill = asyncio.ensure_future(batcher.host.call(lambda engine: engine.log.append(("prefill", []))))
        rest = [asyncio.ensure_future(batcher.submit((sid, "b"))) for sid in ("s2", "s3")]
        return await asyncio.gather(*first, *rest, prefill)

    results, engine = staged(4, scenario, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    assert results[:4] == ["s0:a", "s1:a", "s2:b", "s3:b"]
    a, b = ["s0", "s1"], ["s2", "s3"]
    assert engine.log == [("prepare", a), ("launch", a), ("settle", a), ("finish", a), ("prefill", []), ("prepare", b), ("launch", b), ("settle", b), ("finish", b)]


def test_a_stage_that_raises_fails_its_own_pass_only():
    """A pass taken ahead whose launch raises: its steps fail with the error; the pass on the
    device before it and the passes after are answered as usual."""

    async def boom_cohort(batcher):
        first = [asyncio.ensure_future(batcher.submit((sid, "a"))) for sid in ("s0", "s1")]
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(batcher.submit(("s2", "boom"))), asyncio.ensure_future(batcher.submit(("s3", "b")))]
        answers = await asyncio.gather(*first, *rest, return_exceptions=True)
        return answers, await asyncio.gather(*(batcher.submit((sid, "c")) for sid in ("s2", "s3")))

    (answers, after), engine = staged(4, boom_cohort, cohorts=[{"s0", "s1"}, {"s2", "s3"}])
    assert answers[:2] == ["s0:a", "s1:a"]
    assert all(isinstance(e, RuntimeError) and "refused the pass" in str(e) for e in answers[2:])
    assert after == ["s2:c", "s3:c"]
    assert ("launch", ["s2", "s3"]) in engine.log and engine.log.count(("prepare", ["s2", "s3"])) == 2
