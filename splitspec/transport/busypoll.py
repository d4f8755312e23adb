"""Busy polling: a service's event loop spins on its sockets for a while before it sleeps.

A speculation round crosses between processes four times (gateway -> draft -> gateway -> target
-> gateway), and each crossing wakes a process that slept in ``epoll_wait`` while the other side
worked. On a GPU server that wake-up costs more than the bytes: ``scripts/step_socket_latency.py``
on an H200 host measured 200-300 µs over a step socket after a 2-6 ms wait against 60 µs back to
back. A loop that polls without blocking for up to ``spin_us`` before it sleeps answers at once,
for the price of one busy core per service while steps flow; a service idle for longer than
``spin_us`` sleeps as before.

The spin gives way while another thread of the process has work that needs the GIL (a worker's
engine thread when several sequences are live): polling then would keep the GIL from it for up
to the interpreter's switch interval. ``hold_spin_while_busy`` registers such a thread's owner.

``--busy-poll`` (``auto``, ``off`` or microseconds) sets it per service; ``auto`` spins
``DEFAULT_SPIN_US`` when the service drives a GPU (the gateway: when the target worker does)
and the process may use at least ``MIN_CPUS`` cores, and not at all otherwise: on a small
CPU-only machine the spinning services would take the cores the model computes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import selectors
import time
import weakref
from collections.abc import Callable, Coroutine

logger = logging.getLogger(__name__)

DEFAULT_SPIN_US = 20_000  # covers the wait for a verify or a block pass of an 8B target
MIN_CPUS = 8


class BusyPollSelector(selectors.DefaultSelector):
    """``select`` polls without blocking for up to ``spin_us`` before it blocks for the rest of
    its timeout, while ``may_spin()`` holds; with ``spin_us`` 0 it is the default selector."""

    def __init__(self, spin_us: int = 0, may_spin: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.spin_us = spin_us
        self.may_spin = may_spin

    def select(self, timeout: float | None = None):
        if self.spin_us <= 0 or timeout is not None and timeout <= 0 or not self.may_spin():
            return super().select(timeout)
        start = time.perf_counter()
        spin_s = self.spin_us / 1e6 if timeout is None else min(self.spin_us / 1e6, timeout)
        while True:
            ready = super().select(0)
            spent = time.perf_counter() - start
            if ready or spent >= spin_s or not self.may_spin():
                break
        if ready:
            return ready
        return super().select(None if timeout is None else max(0.0, timeout - spent))


_holders: weakref.WeakSet = weakref.WeakSet()
_selector: BusyPollSelector | None = None  # the selector of the loop ``run`` started


def hold_spin_while_busy(holder) -> None:
    """Keep the process's loop from spinning while ``holder.thread_busy()``: a thread of its own
    that needs the GIL has work. Held weakly: a holder that is garbage holds nothing."""
    _holders.add(holder)


def _no_thread_busy() -> bool:
    return not any(holder.thread_busy() for holder in list(_holders))


def run(main: Coroutine):
    """``asyncio.run(main)`` on a loop whose selector ``configure`` can make busy-poll."""
    global _selector
    _selector = BusyPollSelector(0, _no_thread_busy)
    try:
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(_selector)) as runner:
            return runner.run(main)
    finally:
        _selector = None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def spin_us_for(value: str, gpu: bool, cpus: int) -> int:
    """Microseconds to spin for a ``--busy-poll`` value: ``auto``, ``off`` or a whole number."""
    if value == "auto":
        return DEFAULT_SPIN_US if gpu and cpus >= MIN_CPUS else 0
    if value == "off":
        return 0
    try:
        spin_us = int(value)
    except ValueError:
        spin_us = -1
    if spin_us < 0:
        raise ValueError(f"--busy-poll {value!r}: expected auto, off or microseconds (a whole number >= 0)")
    return spin_us


def add_busy_poll_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--busy-poll", default="auto",
        help="microseconds the event loop polls its sockets before it sleeps, so that a step's message is read at "
        "once instead of after a wake-up (costs a busy core while steps flow): a number, off, or auto "
        f"({DEFAULT_SPIN_US} when this service drives a GPU, for the gateway when the target does, and the process "
        f"may use {MIN_CPUS}+ cores; else off)",
    )


def configure(value: str, gpu: bool, service: str) -> int:
    """Apply ``--busy-poll`` to the loop ``run`` started; returns the microseconds spun (0 = off)."""
    spin_us = spin_us_for(value, gpu, usable_cpus())
    if _selector is None:
        if spin_us:
            logger.warning("%s: --busy-poll %s ignored: the event loop was not started by splitspec's CLI", service, value)
        return 0
    _selector.spin_us = spin_us
    if spin_us:
        logger.info("%s: busy polling for up to %d µs before the event loop sleeps", service, spin_us)
    return spin_us
