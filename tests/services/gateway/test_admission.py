"""Admission limits: running slots, a bounded queue, a bounded wait, and draining."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import Admission
from splitspec.errors import ResourceExhausted, Unavailable


def test_queue_bounds_wait_and_drain():
    async def scenario():
        admission = Admission(max_running=2, max_waiting=1, max_wait_s=0.2)
        release = asyncio.Event()

        async def hold():
            async with admission.slot():
                await release.wait()

        holders = [asyncio.create_task(hold()) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert admission.running == 2
        waiter = asyncio.create_task(hold())
        await asyncio.sleep(0.01)
        assert admission.waiting == 1
        with pytest.raises(ResourceExhausted, match="2 requests running and 1 waiting"):
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(*holders, waiter)
        assert (admission.running, admission.waiting) == (0, 0)

        blocker = asyncio.Event()

        async def block():
            async with admission.slot():
                await blocker.wait()

        blocked = [asyncio.create_task(block()) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match="within 0.2 s"):
            async with admission.slot():
                pass
        assert admission.waiting == 0
        admission.draining = True
        with pytest.raises(Unavailable, match="shutting down"):
            async with admission.slot():
                pass
        blocker.set()
        await asyncio.gather(*blocked)

    asyncio.run(scenario())


def test_rejects_nonsense_limits():
    with pytest.raises(ValueError):
        Admission(0, 1, 1.0)
