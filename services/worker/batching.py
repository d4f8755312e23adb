"""Continuous batching of the workers' steps: :class:`StepBatcher` gathers the steps of different
sequences into passes of their engine, and with a staged engine (:class:`StagedEngine`) prepares
one pass on the host while the pass before runs on the device."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.worker.hosting import EngineHost

logger = logging.getLogger(__name__)

GATHER_FRACTION = 0.5  # of the last pass, the longest a pass waits for the rest of its sequences' cohorts
GATHER_GAP_S = 0.0005  # a cohort that is back waits while steps keep arriving at most this far apart


class StagedEngine(Protocol):
    """An engine whose pass runs in stages (the target's ``TargetEngine``): ``prepare_pass`` does
    its host work and touches nothing on the device, so it may run while the pass of the ``busy``
    sequences is on the device (launched, not settled), answering None when it cannot without
    touching that pass (then it is prepared again after); ``launch_pass`` starts it on the device
    (``ahead``: it was prepared ahead, so its time runs from now); ``pass_running`` says whether the
    device is still on it and ``wait_pass`` blocks until it is not; ``settle_pass`` takes what the
    next pass would overwrite, after which that pass may launch; ``finish_pass`` gives each step's
    result (host work: it overlaps the next pass)."""

    def prepare_pass(self, items: list, busy: frozenset[str]) -> Any | None: ...

    def launch_pass(self, prepared: Any, ahead: bool = False) -> None: ...

    def pass_running(self, prepared: Any) -> bool: ...

    def wait_pass(self, prepared: Any) -> None: ...

    def settle_pass(self, prepared: Any) -> None: ...

    def finish_pass(self, prepared: Any) -> list: ...


@dataclass(eq=False)
class _Flight:
    """A staged pass taken by the engine thread: its steps and where it is."""

    batch: list  # (item, its future, when it arrived, host.opened_s then)
    keys: frozenset[str]
    prepared: Any = None  # the engine's pass once prepared
    failed: BaseException | None = None  # what a stage raised: every step of the pass fails with it
    on_device: bool = True  # launched and not yet seen finished by the watcher
    waits: list[float] = field(default_factory=list)
    prompt_waits: list[float] = field(default_factory=list)
    t0: float = 0.0  # perf_counter when its time began: its preparation, or its launch when prepared ahead
    ahead: bool = False  # prepared while the pass before was on the device


class StepBatcher:
    """Continuous batching of one kind of step (the target's Verify, the draft's Propose): steps of
    different sequences that arrive while the engine thread runs a pass wait, and run together as
    the next pass (``run(engine, items) -> results``, one result or exception per item). A sequence
    joins the pass after the one in flight and leaves when it has no step waiting; no sequence
    waits for another's later step.

    Sequences that ran in one pass are likely to send their next steps together (an AR step comes
    straight back; a speculating sequence's next verify follows the draft's pass for the same
    sequences). Starting the next pass with only the first of them would split one batch into a
    pass of one and a pass of the rest, and every sequence would then wait for two passes a step.
    So a pass starts when

    - a step of every live sequence is waiting (a lone sequence never waits: with one live
      sequence its steps run at once, on the event loop's thread when short, see
      ``EngineHost.inline_now``), or
    - every sequence that shared a waiting step's last pass (its *cohort*; for a sequence that has
      run no pass yet, the last pass run) is back and no step arrived for ``gather_gap_s`` (steps
      still coming one after another, as a gateway turns a pass's results into next steps at
      ~0.2-0.4 ms of its CPU each, join: fragments merge), or
    - the *gather window* (``GATHER_FRACTION`` of the last pass, at most ``max_gather_s``) since
      the engine was free for the first waiting step has passed.

    The cohort is each waiting sequence's own last pass, not the last pass run: speculating
    sequences settle into two cohorts that take turns (one verifies while the other is at the
    draft), and waiting for the cohort that ran the last pass, which is away, would idle the
    engine for the whole window before every pass. A step that says its sequence's next one comes
    late (``late(item)``: the target's ``VerifyRequest.next_step_late``, a sequence that goes to
    the draft while the others of its pass decode on) leaves that sequence out of its pass's
    cohort, and out of "every live sequence" until its next step arrives: no pass waits for it.

    When a pass ends with a step of every live sequence already waiting (pipelined decode steps,
    read ahead by ``rpc.sequence_stream``) and no other work queued for the engine thread (a
    prefill goes first), the engine thread starts the next pass itself and hands
    the results to the event loop, which answers them while that pass runs. Through the loop, asleep
    in ``epoll_wait`` during the pass, the next pass started 0.9 ms after the last one ended (32
    users on an H200, 7.7 ms passes: BENCHMARKS.md). Every other start is decided on the loop. The
    waiting steps and the running state are shared with the engine thread under ``_lock``.

    **Staged passes** (``staged``: the engine is a :class:`StagedEngine`). A pass's host work
    (checking the steps, laying out their rows, writing the inputs; then the results) left the
    GPU idle for 3.0 ms of a 12.85 ms pass of 16 trees on an H100 (BENCHMARKS.md [B10]). While a
    pass is on the device, the steps of sequences outside it that become ready by the rules above
    (every other live sequence back, or a cohort back and quiet; not the gather window, which
    counts from a free engine, and not while other work is queued for the engine thread) are
    taken *ahead*: the engine thread prepares their pass, settles the one on the device, launches
    the prepared one, and only then finishes and answers the settled pass's steps. Speculating
    cohorts, which take turns, meet the device with their pass ready. A watcher thread waits for
    the device (GIL released) so that the engine thread wakes for whichever comes first. Nothing is
    taken ahead of a pass with a step whose sequence comes straight back (``straight_back(item)``:
    the target's decode steps, whose next steps are read ahead): its sequences join the next pass,
    and a pass taken ahead without them split 32 AR users on an H100 into two cohorts of 16 that
    kept taking turns (17.3 ms a step against 12.1 in one pass of 32).
    """

    def __init__(
        self, host: EngineHost, run: Callable[[Any, list[Any]], list[Any]], key: Callable[[Any], str],
        max_batch: int = 64, max_gather_s: float = 0.004, gather_gap_s: float = GATHER_GAP_S,
        late: Callable[[Any], bool] = lambda item: False, staged: bool = False, straight_back: Callable[[Any], bool] = lambda item: False,
    ) -> None:
        self.host, self.run, self.key, self.late, self.staged = host, run, key, late, staged
        self.straight_back = straight_back
        self.max_batch, self.max_gather_s, self.gather_gap_s = max_batch, max_gather_s, gather_gap_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the engine thread waits for the device or a pass ahead
        self._waiting: list[tuple[Any, asyncio.Future, float, float]] = []  # (item, its future, when it arrived, host.opened_s then)
        self._running = False
        self._in_flight: list[list] = []  # the batches taken by the engine thread and not yet answered
        self._ahead_of: _Flight | None = None  # a staged pass on the device whose successor may be taken ahead
        self._next: list | None = None  # the batch taken ahead of it
        self._watched: queue.SimpleQueue | None = None  # (engine, flight) for the watcher thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cohorts: dict[str, frozenset[str]] = {}  # sequence -> the sequences of its last pass
        self._last: frozenset[str] = frozenset()  # the sequences of the last pass run
        self._away: set[str] = set()  # sequences whose last step said their next comes late, not back yet
        self._last_arrival = 0.0  # loop time of the newest waiting step
        self._quiet: asyncio.TimerHandle | None = None  # looks again once arrivals pause
        self._last_pass_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # Metrics: called after every pass with its results (or exceptions), one per step, how long
        # each step waited for the pass to start, and whether the pass was prepared ahead.
        self.on_pass: Callable[[list[Any], list[float], bool], None] = lambda results, waits, ahead: None

    async def submit(self, item: Any) -> Any:
        """``item``'s result, from the pass it ran in (its exception raised here)."""
        engine = self.host.require()
        if not self._running and not self._waiting and self.host.inline_now(engine):
            results = self.host._timed(lambda e: self.run(e, [item]), self.host._step_took)(engine)
            self.on_pass(results, [0.0], False)
            return self._one(results)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._last_arrival = loop.time()
        with self._lock:
            self._waiting.append((item, future, self._last_arrival, self.host.opened_s))
            self._away.discard(self.key(item))
        self._maybe_start()
        return await future

    @staticmethod
    def _one(results: list[Any]) -> Any:
        if isinstance(results[0], BaseException):
            raise results[0]
        return results[0]

    def _maybe_start(self) -> None:
        with self._lock:
            ahead_of = self._ahead_of if self._next is None else None
            if self._running and ahead_of is None:
                return
            self._waiting = [w for w in self._waiting if not w[1].done()]  # cancelled callers leave
            busy = ahead_of.keys if ahead_of is not None else frozenset()
            back = {self.key(item) for item, *_ in self._waiting} - busy
            if not back:
                return
            all_back = self._all_back(back, busy)
        sequences = self.host.engine.sequences
        if all_back or ahead_of is None and self._gather_s() <= 0:
            self._start()
            return
        loop = asyncio.get_running_loop()
        # Distinct cohorts only: the waiting steps of one cohort share its set, so this stays linear in
        # the waiting steps (it runs at every arrival while the engine is free).
        cohorts = {self._cohorts.get(b, self._last) for b in back}
        if all(k in back or k not in sequences for k in frozenset().union(*cohorts)):  # every live member back
            quiet = self._last_arrival + self.gather_gap_s - loop.time()
            if quiet <= 0:
                self._start()
                return
            if self._quiet is None:
                self._quiet = loop.call_later(quiet, self._look_again)
        if self._timer is None and ahead_of is None:
            self._timer = loop.call_later(self._gather_s(), self._start)

    def _all_back(self, back: set[str], busy: frozenset[str] = frozenset()) -> bool:
        """Under ``_lock``: a step of every live sequence not away and not in the ``busy`` pass (or
        of a full batch) is waiting: ``back`` are their keys."""
        sequences = self.host.engine.sequences
        elsewhere = {k for k in self._away if k not in back} | busy
        return len(back) >= min(len(sequences) - sum(1 for k in elsewhere if k in sequences), self.max_batch)

    def _look_again(self) -> None:
        self._quiet = None
        self._maybe_start()

    def _gather_s(self) -> float:
        return min(self.max_gather_s, GATHER_FRACTION * self._last_pass_s)

    def _start(self) -> None:
        for timer in (self._timer, self._quiet):
            if timer is not None:
                timer.cancel()
        self._timer = self._quiet = None
        self._loop = asyncio.get_running_loop()
        with self._lock:
            if self._running:
                ahead_of = self._ahead_of
                if ahead_of is not None and self._next is None and self.host._pending <= 1:  # nothing queued behind the pass
                    self._next = self._take(ahead_of.keys)
                    self._wake.notify_all()
                return
            batch = self._take()
            if batch is None:
                return
            self._running = True
        job = asyncio.wrap_future(self.host._submit(lambda engine: self._drive(engine, batch)))
        job.add_done_callback(self._job_done)

    def _take(self, busy: frozenset[str] = frozenset()) -> list | None:
        """Under ``_lock``: the next pass's steps, one a sequence and none of ``busy``, first come
        first served (None when there are none)."""
        self._waiting = [w for w in self._waiting if not w[1].done()]
        batch, seen, rest = [], set(), []
        for entry in self._waiting:
            k = self.key(entry[0])
            if k in seen or k in busy or len(batch) >= self.max_batch:
                rest.append(entry)
            else:
                seen.add(k)
                batch.append(entry)
        if not batch:
            return None
        self._waiting = rest
        self._in_flight.append(batch)
        late = {self.key(item) for item, *_ in batch if self.late(item)}
        self._away |= late
        self._remember(seen, late)
        return batch

    def _take_chained(self) -> list | None:
        """Under ``_lock``, as a pass ends: the next pass when a step of every live sequence is
        waiting and no other work is queued for the engine thread (a prefill goes first, as it would
        between two passes started from the loop: a chain must not hold new sequences back); else
        None, and the batcher stops running."""
        self._waiting = [w for w in self._waiting if not w[1].done()]
        back = {self.key(item) for item, *_ in self._waiting}
        queued = self.host._pending > 1  # the pass that just ended is one
        batch = self._take() if back and not queued and self._all_back(back) else None
        self._running = batch is not None
        return batch

    def _drive(self, engine: Any, batch: list) -> None:
        """On the engine thread: ``batch``'s pass, then the next ones while each can start at once
        (see the class), every pass's results handed to the loop as it ends."""
        if self.staged:
            self._drive_staged(engine, batch)
            return
        while batch is not None:
            waits, prompt_waits = self._waits(batch)
            t0 = time.perf_counter()
            try:
                results = self.run(engine, [item for item, *_ in batch])
            except Exception as exc:  # noqa: BLE001 - the pass's steps fail with it; the batcher goes on
                results = [exc] * len(batch)
            seconds = time.perf_counter() - t0
            with self._lock:
                following = self._take_chained()
            if not self._hand_over(batch, results, waits, prompt_waits, seconds, following is None):
                return
            batch = following

    def _drive_staged(self, engine: StagedEngine, batch: list) -> None:
        """:meth:`_drive` of a staged engine: each pass prepared ahead where its steps are ready
        while the one before is on the device (see the class)."""
        flight = self._launch(engine, _Flight(batch, self._keys(batch)), None)
        while flight is not None:
            following, prepared = self._ahead(engine, flight), None
            if following is not None:
                prepared = self._stage(following, lambda: engine.prepare_pass(self._items(following.batch), flight.keys))
            if flight.failed is None:
                self._stage(flight, lambda: engine.settle_pass(flight.prepared))
            seconds = time.perf_counter() - flight.t0
            chained = None
            if following is not None:  # launched first: the settled pass's results are built while it runs
                following = self._launch(engine, following, prepared)
            results = self._results(engine, flight)
            if following is None:  # nothing on the device either way: answer first, as unstaged passes do
                with self._lock:
                    chained = self._take_chained()
            last = following is None and chained is None
            if not self._hand_over(flight.batch, results, flight.waits, flight.prompt_waits, seconds, last, flight.ahead):
                return
            if chained is not None:
                following = self._launch(engine, _Flight(chained, self._keys(chained)), None)
            flight = following

    def _results(self, engine: StagedEngine, flight: _Flight) -> list:
        """The settled ``flight``'s results, or its error for each step."""
        if flight.failed is None:
            results = self._stage(flight, lambda: engine.finish_pass(flight.prepared))
            if flight.failed is None:
                return results
        return [flight.failed] * len(flight.batch)

    def _launch(self, engine: StagedEngine, flight: _Flight, prepared: Any) -> _Flight:
        """Start ``flight``'s pass, prepared ahead (``prepared``) or now."""
        flight.waits, flight.prompt_waits = self._waits(flight.batch)
        flight.t0 = time.perf_counter()
        ahead = flight.ahead = prepared is not None
        if not ahead and flight.failed is None:
            prepared = self._stage(flight, lambda: engine.prepare_pass(self._items(flight.batch), frozenset()))
        flight.prepared = prepared
        if flight.failed is None:
            self._stage(flight, lambda: engine.launch_pass(prepared, ahead))
        return flight

    def _ahead(self, engine: StagedEngine, flight: _Flight) -> _Flight | None:
        """Wait until the device is done with ``flight``'s pass or a pass is taken ahead of it (by
        :meth:`_start` on the loop), whichever comes first: the pass taken ahead, or None."""
        if flight.failed is not None or not self._others_live(flight) or not engine.pass_running(flight.prepared):
            return None
        if any(self.straight_back(item) for item, *_ in flight.batch):  # its sequences join the next pass
            return None
        if self._watched is None:
            self._watched = queue.SimpleQueue()
            threading.Thread(target=self._watch, args=(self._watched,), name="pass-watcher", daemon=True).start()
        self._watched.put((engine, flight))
        with self._lock:
            self._ahead_of = flight
        try:
            self._loop.call_soon_threadsafe(self._maybe_start)  # steps that came while the pass was launched
        except RuntimeError:  # the loop closed (shutting down)
            pass
        with self._lock:
            while flight.on_device and self._next is None:
                self._wake.wait()
            batch, self._next, self._ahead_of = self._next, None, None
        return _Flight(batch, self._keys(batch)) if batch is not None else None

    def _others_live(self, flight: _Flight) -> bool:
        """Whether a live sequence outside ``flight`` and not away may send a step to take ahead
        (none while every user decodes in one pass: the engine thread then just waits on the device)."""
        sequences = self.host.engine.sequences
        with self._lock:
            elsewhere = sum(1 for k in flight.keys | self._away if k in sequences)
        return len(sequences) > elsewhere

    def _watch(self, watched: queue.SimpleQueue) -> None:
        """The watcher thread: wakes the engine thread when the device is done with a pass."""
        while True:
            engine, flight = watched.get()
            try:
                engine.wait_pass(flight.prepared)
            except Exception:  # noqa: BLE001 - its settle meets the error
                logger.debug("waiting for a pass failed", exc_info=True)
            with self._lock:
                flight.on_device = False
                self._wake.notify_all()

    @staticmethod
    def _stage(flight: _Flight, stage: Callable[[], Any]) -> Any:
        """``stage()``'s value; if it raises, ``flight`` fails with it (and None)."""
        try:
            return stage()
        except Exception as exc:  # noqa: BLE001 - the pass's steps fail with it; the batcher goes on
            flight.failed = flight.failed or exc
            return None

    def _keys(self, batch: list | None) -> frozenset[str]:
        return frozenset(self.key(item) for item, *_ in batch or ())

    @staticmethod
    def _items(batch: list) -> list:
        return [item for item, *_ in batch]

    def _waits(self, batch: list) -> tuple[list[float], list[float]]:
        """How long each step of ``batch`` has waited for its pass, and of that the engine's time in prompts."""
        now = self._loop.time()  # the loop's clock (monotonic), readable from any thread
        waits = [now - arrived for _, _, arrived, _ in batch]
        return waits, [min(wait, self.host.opened_s - opened) for (*_, opened), wait in zip(batch, waits)]

    def _hand_over(
        self, batch: list, results: list, waits: list[float], prompt_waits: list[float], seconds: float, last: bool, ahead: bool = False,
    ) -> bool:
        """Give a pass's results to the loop; False when the loop has closed (shutting down)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch, results, waits, prompt_waits, seconds, last, ahead)
        except RuntimeError:  # the loop closed: nobody is left to answer
            return False
        return True

    def _deliver(
        self, batch: list, results: list, waits: list[float], prompt_waits: list[float], seconds: float, last: bool, ahead: bool = False,
    ) -> None:
        self._last_pass_s = self.host.last_step_s = seconds
        with self._lock:
            self._in_flight = [b for b in self._in_flight if b is not batch]
        self.on_pass(results, waits, ahead)
        for (_, future, *_), result, wait, prompt_wait in zip(batch, results, waits, prompt_waits):
            if future.done():
                continue  # its caller went away; the pass ran anyway, keeping the engine consistent
            if hasattr(result, "queue_ns"):
                result.queue_ns, result.queue_prompt_ns = int(wait * 1e9), int(prompt_wait * 1e9)
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if last:
            self._maybe_start()

    def _job_done(self, job: asyncio.Future) -> None:
        """A pass that never ran (its job cancelled while queued) or a failure outside the passes:
        their steps fail, and the batcher is free again."""
        error = asyncio.CancelledError() if job.cancelled() else job.exception()
        if error is None:
            return
        with self._lock:
            batches, self._in_flight, self._running = self._in_flight, [], False
            self._ahead_of = self._next = None
        for batch in batches:
            self._deliver(batch, [error] * len(batch), [0.0] * len(batch), [0.0] * len(batch), 0.0, batch is batches[-1])
        if not batches:
            self._maybe_start()

    def _remember(self, cohort: set[str], late: set[str]) -> None:
        """``cohort`` ran together, and of it ``late`` come back later than the rest: their cohort is
        the rest. Sequences gone from the engine are forgotten when the memory outgrows twice the
        live sequences (or the batch size), so it stays bounded."""
        members = self._last = frozenset(cohort - late)
        for k in cohort:
            self._cohorts[k] = members
        sequences = self.host.engine.sequences
        if len(self._cohorts) > 2 * max(len(sequences), self.max_batch):
            self._cohorts = {k: c for k, c in self._cohorts.items() if k in sequences}
            self._away = {k for k in self._away if k in sequences}
