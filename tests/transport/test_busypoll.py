"""Busy polling: the selector spins (burning its thread's CPU) only while it may, answers the same
events as the plain selector, keeps its timeouts; ``--busy-poll`` values. A worker that spins is
tested end to end in tests/test_stepwire.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from splitspec.transport import busypoll
from splitspec.transport.busypoll import DEFAULT_SPIN_US, MIN_CPUS, BusyPollSelector, spin_us_for


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def cpu_and_wall(fn) -> tuple[float, float, object]:
    cpu, wall = time.thread_time(), time.perf_counter()
    result = fn()
    return time.thread_time() - cpu, time.perf_counter() - wall, result


@pytest.mark.parametrize("allowed", [True, False])
def test_it_spins_only_while_allowed_and_keeps_the_timeout(pair, allowed):
    reader, _ = pair
    selector = BusyPollSelector(100_000, may_spin=lambda: allowed)
    selector.register(reader, 1)  # selectors.EVENT_READ
    cpu, wall, ready = cpu_and_wall(lambda: selector.select(0.2))
    assert ready == [] and 0.19 <= wall < 1.0
    if allowed:  # spun the first 0.1 s (less when the machine preempted the thread), then slept
        assert cpu > 0.03
    else:
        assert cpu < 0.02
    selector.close()


def test_it_returns_the_plain_selectors_events_while_spinning(pair):
    reader, writer = pair
    selector = BusyPollSelector(2_000_000)
    key = selector.register(reader, 1, data="mine")
    threading.Timer(0.05, lambda: writer.send(b"x")).start()
    cpu, wall, ready = cpu_and_wall(lambda: selector.select(None))
    assert [(k.data, events) for k, events in ready] == [("mine", 1)] and ready[0][0] == key
    assert wall < 1.0 and cpu > 0.01  # woke by polling, well before its 2 s spin would have ended
    assert selector.select(0) == ready  # level-triggered, as the default selector
    selector.close()


def test_a_spin_of_zero_is_the_default_selector(pair):
    reader, _ = pair
    selector = BusyPollSelector(0)
    selector.register(reader, 1)
    cpu, wall, _ = cpu_and_wall(lambda: selector.select(0.1))
    assert wall >= 0.09 and cpu < 0.02
    selector.close()


def test_busy_poll_values():
    assert spin_us_for("auto", gpu=True, cpus=MIN_CPUS) == DEFAULT_SPIN_US
    assert spin_us_for("auto", gpu=True, cpus=MIN_CPUS - 1) == 0  # the services would take the model's cores
    assert spin_us_for("auto", gpu=False, cpus=64) == 0
    assert spin_us_for("off", gpu=True, cpus=64) == 0
    assert spin_us_for("5000", gpu=False, cpus=1) == 5000
    for bad in ("-1", "fast", "1.5"):
        with pytest.raises(ValueError, match="--busy-poll"):
            spin_us_for(bad, gpu=True, cpus=64)


def test_configure_sets_the_loop_that_run_started():
    async def main():
        spun = busypoll.configure("3000", gpu=False, service="test")
        reader, writer = await asyncio.open_connection(*(await echo_server()))
        writer.write(b"ping\n")
        line = await reader.readline()
        writer.close()
        return spun, busypoll._selector.spin_us, line

    async def echo_server():
        async def echo(r, w):
            w.write(await r.readline())
            await w.drain()
            w.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        return server.sockets[0].getsockname()[:2]

    assert busypoll.run(main()) == (3000, 3000, b"ping\n")
    assert busypoll._selector is None
    assert busypoll.configure("3000", gpu=False, service="test") == 0  # no loop of ours: nothing to set


def test_a_busy_thread_holds_the_spin():
    class Host:
        busy = False

        def thread_busy(self):
            return self.busy

    host = Host()
    busypoll.hold_spin_while_busy(host)
    assert busypoll._no_thread_busy()
    host.busy = True
    assert not busypoll._no_thread_busy()
    del host  # held weakly: a host that is gone holds nothing
    assert busypoll._no_thread_busy()
