"""Admission control: at most ``max_running`` requests generate, at most ``max_waiting`` wait.

A request that finds the queue full, or waits longer than ``max_wait_s`` for a slot, is refused
with RESOURCE_EXHAUSTED; while the gateway drains, new requests get UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from splitspec.errors import ResourceExhausted, Unavailable


class Admission:
    def __init__(self, max_running: int, max_waiting: int, max_wait_s: float) -> None:
        if max_running < 1 or max_waiting < 0 or max_wait_s < 0:
            raise ValueError("admission limits: max_running >= 1, max_waiting >= 0, max_wait_s >= 0")
        self.max_running, self.max_waiting, self.max_wait_s = max_running, max_waiting, max_wait_s
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self.draining = False

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a running slot; yields the seconds spent waiting for it."""
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry on another instance")
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"{self.running} requests running and {self.waiting} waiting; the limits are "
                f"{self.max_running} running and {self.max_waiting} waiting"
            )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=self.max_wait_s or None)
        except TimeoutError:
            raise ResourceExhausted(f"no generation slot became free within {self.max_wait_s:.1f} s") from None
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield loop.time() - t0
        finally:
            self.running -= 1
            self._slots.release()
