"""Admission control: which requests generate, which wait and in what order, and where prompts are prepared.

- At most ``max_running`` requests generate; at most ``max_waiting`` more wait (for their prompt's
  preparation or for a slot), each for at most ``max_wait_s`` in all; beyond that
  RESOURCE_EXHAUSTED. While the gateway drains, new requests get UNAVAILABLE.
- Fairness: every request belongs to a *client* (:func:`client_identity`). Waiting requests are
  served round-robin by client, not first come first served, so however many requests one client
  has queued, another client's request waits for at most one turn of each client ahead of it. A
  client holds at most ``max_running_per_client`` slots and has at most ``max_waiting_per_client``
  requests waiting (0: only the global limits apply); a request beyond that is refused at once,
  before any work is done for it.
- Preparation (tokenizing a prompt, rendering a chat template) runs on ``prepare_threads`` threads,
  off the event loop, so health checks, metrics and running streams never wait for it; requests
  take turns on those threads round-robin by client as well.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from splitspec.errors import ResourceExhausted, Unavailable

T = TypeVar("T")

IDENTITIES = "peer, host or header:NAME"


def check_identity(how: str) -> str:
    """``how`` if it names a client identity :func:`client_identity` knows, else ValueError."""
    if how in ("peer", "host") or (how.startswith("header:") and len(how) > len("header:")):
        return how
    raise ValueError(f"client identity {how!r}: use {IDENTITIES}")


def client_identity(context, how: str = "peer") -> str:
    """Who a request is from, for per-client fairness.

    - ``peer``: the connection's address as gRPC reports it (``ipv4:10.0.0.7:52814``), so each client
      connection (a gRPC channel) is one client. All connections to a Unix socket report ``unix:``
      and so are one client.
    - ``host``: the peer address without its port: every connection from one host is one client (a
      client cannot get more turns by opening more channels; users behind one NAT or proxy share).
    - ``header:NAME``: the value of request metadata NAME (``x-forwarded-for``, a tenant id), for a
      gateway behind a trusted proxy that sets it; requests without it fall back to ``peer``.
      Clients that reach the gateway directly can set the header to anything: use it only behind
      such a proxy.
    """
    peer = context.peer() or "unknown"
    if how == "host":
        scheme, _, address = peer.partition(":")
        host, sep, port = address.rpartition(":")
        return f"{scheme}:{host}" if sep and port.isdigit() else peer
    if how.startswith("header:"):
        name = how[len("header:") :].lower()
        for key, value in context.invocation_metadata() or ():
            if key == name and value:
                return f"{name}={str(value)[:256]}"
    return peer


class FairQueue:
    """``capacity`` permits, handed to waiters round-robin by client (in order within a client);
    a client holds at most ``per_client`` of them (0: no limit but ``capacity``)."""

    def __init__(self, capacity: int, per_client: int = 0) -> None:
        self.capacity, self.per_client = capacity, per_client
        self.held = 0
        self._held_by: Counter[str] = Counter()
        # Clients with waiters, in the order their turns come; each with its waiters in arrival order.
        self._turns: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.held)

    def free_for(self, client: str) -> int:
        """Permits ``client`` could take now."""
        free = self.capacity - self.held
        if self.per_client:
            free = min(free, self.per_client - self._held_by[client])
        return max(0, free)

    def _may_hold(self, client: str) -> bool:
        return self.held < self.capacity and (not self.per_client or self._held_by[client] < self.per_client)

    def _grant(self, client: str) -> None:
        self.held += 1
        self._held_by[client] += 1

    async def acquire(self, client: str) -> None:
        # Whenever a permit is free, no waiter that may take it is left waiting (release() hands it
        # on at once), so a newcomer whose own earlier requests are not waiting may take it.
        if client not in self._turns and self._may_hold(client):
            self._grant(client)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._turns.setdefault(client, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(client)  # granted just as it was cancelled: pass it on
            else:
                self._forget(client, waiter)
            raise

    def _forget(self, client: str, waiter: asyncio.Future) -> None:
        queue = self._turns.get(client)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            pass
        if not queue:
            del self._turns[client]

    def release(self, client: str) -> None:
        self.held -= 1
        self._held_by[client] -= 1
        if self._held_by[client] <= 0:
            del self._held_by[client]
        self._dispatch()

    def _dispatch(self) -> None:
        while self.held < self.capacity:
            client = next((c for c in self._turns if self._may_hold(c)), None)
            if client is None:
                return
            queue = self._turns[client]
            waiter = queue.popleft()
            if queue:
                self._turns.move_to_end(client)  # its next request waits for the other clients' turns
            else:
                del self._turns[client]
            if waiter.done():  # cancelled while waiting
                continue
            self._grant(client)
            waiter.set_result(None)


@dataclass
class Ticket:
    """One request inside the gateway, from admission until it ends."""

    client: str
    deadline: float | None  # loop time by which it must hold a generation slot
    waiting: bool = True


class Admission:
    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        max_wait_s: float,
        *,
        max_running_per_client: int = 0,
        max_waiting_per_client: int = 0,
        prepare_threads: int = 2,
    ) -> None:
        if max_running < 1 or max_waiting < 0 or max_wait_s < 0:
            raise ValueError("admission limits: max_running >= 1, max_waiting >= 0, max_wait_s >= 0")
        if max_running_per_client < 0 or max_waiting_per_client < 0 or prepare_threads < 1:
            raise ValueError("admission limits: per-client limits >= 0 (0 = none), prepare_threads >= 1")
        self.max_running, self.max_waiting, self.max_wait_s = max_running, max_waiting, max_wait_s
        self.max_running_per_client, self.max_waiting_per_client = max_running_per_client, max_waiting_per_client
        self.prepare_threads = prepare_threads
        self._slots = FairQueue(max_running, max_running_per_client)
        self._preparing = FairQueue(prepare_threads)
        self._pool: ThreadPoolExecutor | None = None
        self.waiting = 0  # requests admitted and not generating yet (being prepared, or queued for a slot)
        self._waiting_by: Counter[str] = Counter()
        self.draining = False

    @property
    def running(self) -> int:
        return self._slots.held

    @asynccontextmanager
    async def request(self, client: str = "") -> AsyncIterator[Ticket]:
        """Admit a request of ``client`` for as long as it lasts, or refuse it at once: UNAVAILABLE
        while draining, RESOURCE_EXHAUSTED when it would have to wait and the queue, or this
        client's share of it, is full."""
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry on another instance")
        if self.waiting >= self.max_waiting + self._slots.free:
            raise ResourceExhausted(
                f"{self.running} requests running and {self.waiting} waiting; the limits are "
                f"{self.max_running} running and {self.max_waiting} waiting"
            )
        mine = self._waiting_by[client]
        if self.max_waiting_per_client and mine >= self.max_waiting_per_client + self._slots.free_for(client):
            raise ResourceExhausted(
                f"this client ({client[:80]}) has {mine} requests waiting; the limit is "
                f"{self.max_waiting_per_client} waiting requests per client"
            )
        loop = asyncio.get_running_loop()
        ticket = Ticket(client, loop.time() + self.max_wait_s if self.max_wait_s else None)
        self.waiting += 1
        self._waiting_by[client] += 1
        try:
            yield ticket
        finally:
            self._stop_waiting(ticket)

    def _stop_waiting(self, ticket: Ticket) -> None:
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
            self._waiting_by[ticket.client] -= 1
            if self._waiting_by[ticket.client] <= 0:
                del self._waiting_by[ticket.client]

    async def prepare(self, ticket: Ticket, work: Callable[..., T], *args) -> T:
        """``work(*args)`` on a preparation thread once it is ``ticket``'s client's turn; its result.

        A thread stays taken until its work ends, even if the request is cancelled meanwhile."""
        try:
            async with asyncio.timeout_at(ticket.deadline):
                await self._preparing.acquire(ticket.client)
        except TimeoutError:
            raise ResourceExhausted(f"the prompt's preparation did not start within {self.max_wait_s:.1f} s") from None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.prepare_threads, thread_name_prefix="prepare")
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, work, *args)
        except BaseException:
            self._preparing.release(ticket.client)
            raise

        def done(f: asyncio.Future) -> None:
            self._preparing.release(ticket.client)
            if not f.cancelled():
                f.exception()  # retrieved, so one nobody awaits any more is not logged as lost

        future.add_done_callback(done)
        return await asyncio.shield(future)

    @asynccontextmanager
    async def slot(self, ticket: Ticket | str = "") -> AsyncIterator[float]:
        """Hold a generation slot for ``ticket`` (or for a request of the client named, admitted
        here); yields the seconds spent waiting for it."""
        if isinstance(ticket, str):
            async with self.request(ticket) as own, self.slot(own) as queued_s:
                yield queued_s
            return
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout_at(ticket.deadline):
                await self._slots.acquire(ticket.client)
        except TimeoutError:
            raise ResourceExhausted(f"no generation slot became free within {self.max_wait_s:.1f} s") from None
        self._stop_waiting(ticket)
        try:
            yield loop.time() - t0
        finally:
            self._slots.release(ticket.client)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
