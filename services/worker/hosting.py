"""What both workers' servicers share: an engine driven from one thread, attached once loaded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from splitspec.errors import Aborted, FailedPrecondition, Unavailable
from splitspec.transport import busypoll, rpc
from splitspec.v1 import common_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineHost:
    """Runs an engine's methods on a single thread, so device work is serialised while the event
    loop stays free for health checks, Info and Release. Until ``attach`` every call answers UNAVAILABLE.

    Steps (``StepBatcher.submit``) of a worker that serves one sequence may run on the event loop thread instead:
    that sequence's steps are sequential anyway, and the two thread hand-offs cost about 0.2 ms a
    step on an H200 host. That is worth it only for short steps, and a step on the loop holds
    every other RPC of the worker (its health checks included) for as long as it runs: a 1.5B
    model on a CPU (0.5 s a step) answered its health checks a second late and was taken for
    dead. So a step runs on the loop only while the last step took less than ``inline_max_s``
    (``INLINE_STEP_MAX_S``, ``SPLITSPEC_INLINE_STEP_MAX_MS``): at that length the hand-offs cost
    about 1% of a step, and the loop is never held longer. The first step, whose length is not
    known yet, and the step after a long one run on the engine thread, where they are measured.
    With more sequences live, steps queue on the engine thread, so one sequence's device work
    follows another's without waiting for the loop. ``SPLITSPEC_INLINE_STEPS=0`` sends every step
    to the engine thread.
    """

    INLINE_STEP_MAX_S = 0.02

    def __init__(self, what: str) -> None:
        self.what = what
        self.engine: Any = None
        self.description: Any = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{what}-engine")
        self.inline_steps = os.environ.get("SPLITSPEC_INLINE_STEPS", "1") != "0"
        self.inline_max_s = float(os.environ.get("SPLITSPEC_INLINE_STEP_MAX_MS", self.INLINE_STEP_MAX_S * 1000)) / 1000
        self.last_step_s = math.inf  # how long the last step took (where it ran); unknown until the first
        # Seconds the engine thread has spent in ``open`` work (prompts) so far, counted as each
        # ends: a step's wait, less the prompts that ended meanwhile (at most its wait), is its wait
        # behind other steps' passes. Written by that thread only.
        self.opened_s = 0.0
        # Calls handed to the engine thread and not finished there (queued or running): counted until
        # the thread is done with them, not until their caller stops waiting (a cancelled call's
        # work still runs), so a step never runs inline while the thread still works.
        self._pending = 0
        self._pending_lock = threading.Lock()
        busypoll.hold_spin_while_busy(self)

    def thread_busy(self) -> bool:
        """The engine thread has work: a busy-polling loop must not keep the GIL from it."""
        return self._pending > 0

    def attach(self, engine: Any, description: Any) -> None:
        self.engine, self.description = engine, description

    def require(self) -> Any:
        if self.engine is None:
            raise Unavailable(f"the {self.what} worker is still loading its model")
        return self.engine

    def _finished(self, _future) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _submit(self, work: Callable[[Any], T]) -> concurrent.futures.Future:
        engine = self.require()
        with self._pending_lock:
            self._pending += 1
        future = self.executor.submit(work, engine)
        future.add_done_callback(self._finished)  # also when cancelled while still queued
        return future

    async def call(self, work: Callable[[Any], T]) -> T:
        """``work(engine)`` on the engine thread. Cancelling the caller cancels work still queued;
        work already running finishes (the engine's state stays consistent)."""
        return await asyncio.wrap_future(self._submit(work))

    @staticmethod
    def _timed(work: Callable[[Any], T], record: Callable[[float], None]) -> Callable[[Any], T]:
        """``work`` that hands its seconds to ``record`` when it ends (also when it raises)."""
        def timed(engine: Any) -> T:
            t0 = time.perf_counter()
            try:
                return work(engine)
            finally:
                record(time.perf_counter() - t0)

        return timed

    def _step_took(self, seconds: float) -> None:
        self.last_step_s = seconds

    def _opened(self, seconds: float) -> None:
        self.opened_s += seconds

    def inline_now(self, engine: Any) -> bool:
        """Whether a step now runs on the event loop's thread (see the class; ``StepBatcher.submit``)."""
        return (
            self.inline_steps and self._pending == 0 and len(engine.sequences) <= 1 and self.last_step_s < self.inline_max_s
        )

    async def open(self, sequence_id: str, work: Callable[[Any], T]) -> T:
        """``work(engine)`` on the engine thread for a call that creates sequence ``sequence_id``
        (the target's Prefill). If the caller goes away first (its gRPC call cancelled or past its
        deadline, its step socket closed), work still queued is dropped, and work already running
        finishes and has whatever sequence it made released: nobody is left to release it."""
        future = self._submit(self._timed(work, self._opened))
        waited = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(waited)
        except asyncio.CancelledError:
            waited.add_done_callback(lambda w: w.cancelled() or w.exception())  # its outcome is taken here
            if not future.cancel():  # running (or done): released when it ends, on whichever thread that is
                future.add_done_callback(lambda done: self._abandoned(sequence_id, done))
            raise

    def _abandoned(self, sequence_id: str, done: concurrent.futures.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # it made nothing
        if self.engine.sequences.pop(sequence_id):
            logger.info("released %s sequence %s: its caller went away before its answer", self.what, sequence_id)

    def release(self, sequence_id: str, context: int = 0) -> bool:
        """Release at once, on the calling thread (see ``SequenceTable``)."""
        return self.require().sequences.pop(sequence_id, context)

    async def expire_periodically(self, ttl_s: float) -> None:
        """Release sequences idle for ``ttl_s`` seconds, checking every ttl/4 (capped at 30 s)."""
        sequences = self.require().sequences
        while True:
            await asyncio.sleep(min(30.0, ttl_s / 4))
            for sid in sequences.expire(ttl_s):
                logger.warning("released %s sequence %s after %.0f s idle", self.what, sid, ttl_s)


class SequenceTable:
    """Live sequences by id, with their last use. Safe to read and release from the event loop
    while the engine thread works: a release must not queue behind other sequences' forward passes,
    or a busy worker would hold finished sequences (and their KV) long after their clients left.

    A release can therefore arrive before the call that creates the sequence has run, or while it
    runs (the gateway gave up on a Prefill still queued on the engine thread): the table keeps
    either order from leaving an orphan. A creating call ``open``s its id first and ``finish``es
    it with the state it built; a release of an id being opened makes ``finish`` refuse (ABORTED,
    the state is dropped), and a release of an id neither live nor being opened is remembered, so
    the next ``open`` of that id is refused once (ABORTED). A release of a live sequence leaves
    nothing behind: the id may be opened again (the gateway re-prefills a sequence the worker lost).

    The draft's contexts are also *numbered* (``ProposeRequest.context``): the gateway gives each
    context it starts a higher number than the last, and a step of a context already released (or
    replaced by a newer one) is refused with ABORTED. So a step still running when the gateway gave up on it
    cannot bring back the context the gateway released meanwhile. Number 0 means unnumbered.
    """

    MAX_RELEASED = 16384  # ids whose last release is remembered, for each kind of memory (oldest forgotten)

    def __init__(self, on_drop: Callable[[Any], None] = lambda item: None) -> None:
        """``on_drop(item)`` is called (on the calling thread, outside the table's lock) for every
        live item released or expired, so its owner can free what the item holds at once."""
        self.on_drop = on_drop
        self._items: dict[str, Any] = {}
        self._last_used: dict[str, float] = {}
        self._numbers: dict[str, int] = {}  # context number of each numbered live item
        self._released: OrderedDict[str, int] = OrderedDict()  # highest context number released per id
        self._opening: dict[str, bool] = {}  # ids being opened -> released meanwhile
        self._released_unopened: OrderedDict[str, None] = OrderedDict()  # released while neither live nor opening
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._items

    def get(self, sequence_id: str) -> Any | None:
        """The sequence's state (marking it used), or None."""
        with self._lock:
            item = self._items.get(sequence_id)
            if item is not None:
                self._last_used[sequence_id] = time.monotonic()
            return item

    def add(self, sequence_id: str, item: Any) -> None:
        with self._lock:
            self._items[sequence_id] = item
            self._last_used[sequence_id] = time.monotonic()

    def open(self, sequence_id: str) -> None:
        """Start creating ``sequence_id`` (then ``finish`` or ``abandon`` it). FAILED_PRECONDITION
        when it is live or being opened; ABORTED when it was released before this call."""
        with self._lock:
            if sequence_id in self._items or sequence_id in self._opening:
                raise FailedPrecondition(f"sequence_id {sequence_id!r} is already live")
            if sequence_id in self._released_unopened:
                del self._released_unopened[sequence_id]  # refused once: the id may be opened again after
                raise Aborted(f"sequence {sequence_id!r} was released before it was created")
            self._opening[sequence_id] = False

    def finish(self, sequence_id: str, item: Any) -> None:
        """Make the opened ``sequence_id`` live with ``item``; ABORTED (and ``item`` dropped) when
        it was released meanwhile."""
        with self._lock:
            if self._opening.pop(sequence_id, True):
                raise Aborted(f"sequence {sequence_id!r} was released while it was being created")
            self._items[sequence_id] = item
            self._last_used[sequence_id] = time.monotonic()

    def abandon(self, sequence_id: str) -> None:
        """The creation of an opened ``sequence_id`` failed: it is not live and no longer opening."""
        with self._lock:
            self._opening.pop(sequence_id, None)

    def claim(self, sequence_id: str, context: int, create: Callable[[], Any]) -> Any:
        """The live item of context number ``context`` of ``sequence_id``: the one there is, or a
        new one from ``create()`` (called under the table's lock: it must not wait on the device)
        when there is none or the live one belongs to an older context."""
        with self._lock:
            released = self._released.get(sequence_id, 0)
            if context and context <= released:
                raise Aborted(f"context {context} of sequence {sequence_id!r} was released; start context {released + 1} or later")
            item, live = self._items.get(sequence_id), self._numbers.get(sequence_id, 0)
            if item is not None and context and context < live:
                raise Aborted(f"context {context} of sequence {sequence_id!r} was replaced by context {live}")
            if item is None or context > live:
                item = create()
                self._items[sequence_id] = item
                self._numbers[sequence_id] = context
            self._last_used[sequence_id] = time.monotonic()
            return item

    def pop(self, sequence_id: str, context: int = 0) -> bool:
        """Release a sequence; steps of context ``context`` (and of the live one's) are refused after,
        and so is a creation of it still running or yet to come (see the class). True when a live
        sequence was released."""
        with self._lock:
            self._last_used.pop(sequence_id, None)
            released = max(context, self._numbers.pop(sequence_id, 0))
            if released > self._released.get(sequence_id, 0):
                self._remember(self._released, sequence_id, released)
            item = self._items.pop(sequence_id, None)
            if sequence_id in self._opening:
                self._opening[sequence_id] = True
            elif item is None and not context:
                self._remember(self._released_unopened, sequence_id, None)
        if item is not None:
            self.on_drop(item)
        return item is not None

    def _remember(self, memory: OrderedDict, sequence_id: str, value: Any) -> None:
        memory[sequence_id] = value
        memory.move_to_end(sequence_id)
        while len(memory) > self.MAX_RELEASED:
            memory.popitem(last=False)

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._items.values())

    def items(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._items.items())

    def expire(self, max_idle_s: float) -> list[str]:
        """Drop sequences unused for ``max_idle_s`` seconds; returns their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, t in self._last_used.items() if now - t > max_idle_s]
            dropped = [self._items.pop(sid) for sid in stale]
            for sid in stale:
                del self._last_used[sid]
                self._numbers.pop(sid, None)
        for item in dropped:
            self.on_drop(item)
        return stale


# torch's CPU threads in a worker whose model is on a GPU, once loaded (its --threads unset): its
# host-side ops are small copies, and a pool of threads spinning in each op starved the gateways
# and the other worker sharing the cores: one batched draft pass took 119 ms at 32 users on an H100
# host, ~100 of them in a 4 MB torch.cat of host features (BENCHMARKS.md [S16]).
GPU_WORKER_THREADS = 1


def settle_threads(threads: int, device_type: str, what: str) -> None:
    """After loading (which may use many threads: dequantizing, random weights): ``--threads`` if
    set, else ``GPU_WORKER_THREADS`` for a GPU worker; a CPU worker keeps torch's default."""
    import torch

    if threads or device_type == "cpu":
        return
    torch.set_num_threads(GPU_WORKER_THREADS)
    logger.info("%s worker: %d torch CPU thread from now on (its model is on the GPU; --threads sets more)", what, GPU_WORKER_THREADS)


def model_geometry(config: Any, dtype: str, device: str, path: str) -> common_pb2.ModelGeometry:
    """The Info geometry of a target config (any family)."""
    return common_pb2.ModelGeometry(
        architecture=config.architecture, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_layers=config.num_layers, max_context=config.max_context, dtype=dtype, device=device, path=path,
    )


async def serve_worker(
    name: str, server, health, service: str, host: EngineHost, load, grace_s: float, ttl_s: float, step_server=None
) -> None:
    """Serve a worker: ``load()`` runs on the engine thread, idle sequences expire after ``ttl_s``.
    ``step_server`` (a ``splitspec.transport.stepwire.StepSocketServer``) listens from the start, as gRPC
    does (its steps answer UNAVAILABLE until the model is loaded), and closes after the gRPC
    server's drain, so steps in flight finish on both wires."""
    loop = asyncio.get_running_loop()

    def load_and_freeze() -> None:
        load()
        # The objects loading made (modules, parameters, the model file's metadata) live as long as
        # the process: out of the collector's sight, a full collection stops costing 50-150 ms of
        # held GIL (a 1.5B-scale model on a CPU), during which the loop answered nothing.
        gc.collect()
        gc.freeze()

    if step_server is not None:
        await step_server.start()
    try:
        await rpc.serve(
            name, server, health, [service], lambda: loop.run_in_executor(host.executor, load_and_freeze), grace_s,
            [lambda: host.expire_periodically(ttl_s)],
        )
    finally:
        if step_server is not None:
            await step_server.close()
