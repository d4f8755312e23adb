"""Admission limits: running slots, a bounded queue, a bounded wait, draining, per-client fairness and preparation threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.gateway.admission import Admission, check_identity, client_identity
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


def test_waiting_requests_are_served_round_robin_by_client():
    async def scenario():
        admission = Admission(max_running=1, max_waiting=10, max_wait_s=0)
        order: list[str] = []
        release = {name: asyncio.Event() for name in ("a0", "a1", "a2", "a3", "b1")}

        async def request(name: str):
            async with admission.slot(name[0]):
                order.append(name)
                await release[name].wait()

        tasks = [asyncio.create_task(request("a0"))]
        await asyncio.sleep(0.01)
        for name in ("a1", "a2", "a3", "b1"):  # b's request comes after all of a's
            tasks.append(asyncio.create_task(request(name)))
            await asyncio.sleep(0.01)
        assert (admission.running, admission.waiting) == (1, 4)
        for name in ("a0", "a1", "b1", "a2", "a3"):
            release[name].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == ["a0", "a1", "b1", "a2", "a3"]  # b is served at the first turn after its arrival
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_per_client_limits():
    async def scenario():
        admission = Admission(max_running=4, max_waiting=10, max_wait_s=0, max_running_per_client=1, max_waiting_per_client=2)
        release = asyncio.Event()
        started: list[str] = []

        async def request(client: str):
            async with admission.slot(client):
                started.append(client)
                await release.wait()

        a = [asyncio.create_task(request("a")) for _ in range(3)]  # one runs, two wait although slots are free
        await asyncio.sleep(0.01)
        assert started == ["a"] and (admission.running, admission.waiting) == (1, 2)
        with pytest.raises(ResourceExhausted, match=r"this client \(a\) has 2 requests waiting; the limit is 2"):
            async with admission.slot("a"):
                pass
        b = asyncio.create_task(request("b"))  # another client gets a free slot at once
        await asyncio.sleep(0.01)
        assert started == ["a", "b"]
        release.set()
        await asyncio.gather(*a, b)
        assert started == ["a", "b", "a", "a"] and (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_cancelled_and_timed_out_waiters_leave_no_trace():
    async def scenario():
        admission = Admission(max_running=1, max_waiting=10, max_wait_s=0.05)
        release = asyncio.Event()

        async def hold(client: str):
            async with admission.slot(client):
                await release.wait()

        holder = asyncio.create_task(hold("a"))
        await asyncio.sleep(0.01)
        cancelled = asyncio.create_task(hold("b"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(ResourceExhausted, match="within 0.1 s"):
            await hold("c")
        await asyncio.gather(cancelled, return_exceptions=True)
        assert (admission.running, admission.waiting) == (1, 0)
        release.set()
        await holder
        async with admission.slot("d"):  # the slot went back
            assert admission.running == 1
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_preparation_runs_off_the_event_loop_round_robin():
    async def scenario():
        admission = Admission(max_running=1, max_waiting=10, max_wait_s=0, prepare_threads=1)
        loop_thread = threading.get_ident()
        gate = threading.Event()
        order: list[str] = []

        def work(name: str) -> int:
            if name == "a0":
                gate.wait(5)
            order.append(name)
            return threading.get_ident()

        async def request(name: str):
            async with admission.request(name[0]) as ticket:
                return await admission.prepare(ticket, work, name)

        tasks = []
        for name in ("a0", "a1", "a2", "b1"):
            tasks.append(asyncio.create_task(request(name)))
            await asyncio.sleep(0.01)
        ticks = 0
        while ticks < 5:  # the loop keeps running while a0 blocks its thread
            await asyncio.sleep(0.01)
            ticks += 1
        assert admission.waiting == 4
        gate.set()
        threads = await asyncio.gather(*tasks)
        assert loop_thread not in threads
        assert order == ["a0", "a1", "b1", "a2"]
        assert admission.waiting == 0
        admission.close()

    asyncio.run(scenario())


class _Context:
    def __init__(self, peer: str, metadata=()):
        self._peer, self._metadata = peer, metadata

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._metadata


def test_client_identity():
    ctx = _Context("ipv4:10.0.0.7:52814", (("x-forwarded-for", "203.0.113.9"),))
    assert client_identity(ctx, "peer") == "ipv4:10.0.0.7:52814"
    assert client_identity(ctx, "host") == "ipv4:10.0.0.7"
    assert client_identity(_Context("ipv6:[::1]:5000"), "host") == "ipv6:[::1]"
    assert client_identity(_Context("unix:"), "host") == "unix:"
    assert client_identity(ctx, "header:X-Forwarded-For") == "x-forwarded-for=203.0.113.9"
    assert client_identity(_Context("ipv4:10.0.0.8:1"), "header:x-forwarded-for") == "ipv4:10.0.0.8:1"
    assert check_identity("header:x-tenant") == "header:x-tenant"
    for bad in ("ip", "header:", ""):
        with pytest.raises(ValueError):
            check_identity(bad)
