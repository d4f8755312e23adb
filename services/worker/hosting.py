"""What both workers' servicers share: an engine driven from one thread, attached once loaded."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from splitspec.errors import Aborted, Unavailable
from splitspec.transport import busypoll, rpc
from splitspec.v1 import common_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineHost:
    """Runs an engine's methods on a single thread, so device work is serialised while the event
    loop stays free for health checks and Info. Until ``attach`` every call answers UNAVAILABLE.

    Steps (``step``) of a worker that serves one sequence run on the event loop thread instead:
    that sequence's steps are sequential anyway, and the two thread hand-offs cost about 0.2 ms a
    step on an H200 host. With more sequences live, steps queue on the engine thread, so one
    sequence's device work follows another's without waiting for the loop.
    ``SPLITSPEC_INLINE_STEPS=0`` sends every step to the engine thread.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.engine: Any = None
        self.description: Any = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{what}-engine")
        self.inline_steps = os.environ.get("SPLITSPEC_INLINE_STEPS", "1") != "0"
        self._pending = 0  # calls handed to the engine thread whose results the loop has not taken yet
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

    async def call(self, work: Callable[[Any], T]) -> T:
        """``work(engine)`` on the engine thread."""
        engine = self.require()
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, work, engine)
        finally:
            self._pending -= 1

    async def step(self, work: Callable[[Any], T]) -> T:
        """``work(engine)`` for one sequence step: on the event loop's thread when the engine thread
        is idle and at most one sequence is live, else like ``call``."""
        engine = self.require()
        if self.inline_steps and self._pending == 0 and len(engine.sequences) <= 1:
            return work(engine)
        return await self.call(work)

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

    The draft's contexts are also *numbered* (``ProposeRequest.context``): the gateway gives each
    context it starts a higher number than the last, and a step of a context already released (or
    replaced by a newer one) is refused with ABORTED. So a step still running when the gateway gave up on it
    cannot bring back the context the gateway released meanwhile. Number 0 means unnumbered.
    """

    MAX_RELEASED = 16384  # ids whose last released context number is remembered (oldest forgotten)

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._last_used: dict[str, float] = {}
        self._numbers: dict[str, int] = {}  # context number of each numbered live item
        self._released: OrderedDict[str, int] = OrderedDict()  # highest context number released per id
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
        """Release a sequence; steps of context ``context`` (and of the live one's) are refused after."""
        with self._lock:
            self._last_used.pop(sequence_id, None)
            released = max(context, self._numbers.pop(sequence_id, 0))
            if released > self._released.get(sequence_id, 0):
                self._released[sequence_id] = released
                self._released.move_to_end(sequence_id)
                while len(self._released) > self.MAX_RELEASED:
                    self._released.popitem(last=False)
            return self._items.pop(sequence_id, None) is not None

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._items.values())

    def expire(self, max_idle_s: float) -> list[str]:
        """Drop sequences unused for ``max_idle_s`` seconds; returns their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, t in self._last_used.items() if now - t > max_idle_s]
            for sid in stale:
                del self._items[sid], self._last_used[sid]
                self._numbers.pop(sid, None)
        return stale


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
    if step_server is not None:
        await step_server.start()
    try:
        await rpc.serve(
            name, server, health, [service], lambda: loop.run_in_executor(host.executor, load), grace_s,
            [lambda: host.expire_periodically(ttl_s)],
        )
    finally:
        if step_server is not None:
            await step_server.close()
