"""A socket reader that receives a large read straight into its own buffer: the step socket's.

asyncio's ``StreamReader`` takes every receive (at most 256 KiB) as a new ``bytes``, appends it to
its buffer and copies a ``readexactly(n)`` out of that: each byte is copied three times, in a
hundred Python-level reads for a prompt's tap features (26 MB for 512 rows of the 27B's five
5120-wide taps). :class:`BulkReader` is an :class:`asyncio.BufferedProtocol`: small reads land in a
scratch buffer as before, but a ``readexactly(n)`` of ``BULK_BYTES`` or more hands the transport a
``bytearray`` of ``n`` bytes to receive into, so the kernel's copy is the only one (a 26 MB frame:
BENCHMARKS.md, "The step socket's large frames").

It offers what the step socket reads with (``readexactly``, ``read``, ``at_eof``, and
``hung_up``, set when the peer closes its end), and its :class:`BulkWriter` what it writes with.
Like a ``StreamReader`` it pauses the socket while more than twice ``limit`` unread bytes wait.
One coroutine reads at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BULK_BYTES = 1 << 20  # a readexactly of at least this many bytes is received into its own buffer
SCRATCH_BYTES = 1 << 16  # one receive of small reads; a connection (one a sequence and worker) keeps one


class BulkReader(asyncio.BufferedProtocol):
    """The reading end of one connection (and its protocol). ``on_connect(reader, writer)`` is
    called once the connection is made (a server's handler: start its task there)."""

    def __init__(self, limit: int, on_connect: Callable[[BulkReader, BulkWriter], None] | None = None) -> None:
        self._limit, self._on_connect = limit, on_connect
        self._scratch = bytearray(SCRATCH_BYTES)
        self._buffer = bytearray()  # received, not yet read
        self._bulk: bytearray | None = None  # the readexactly being received into, and how much of it arrived
        self._bulk_filled = 0
        self._eof = False
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self.transport: asyncio.Transport | None = None
        self.writer: BulkWriter | None = None
        self.hung_up = asyncio.Event()

    # ------------------------------------------------------------------ protocol callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.writer = BulkWriter(transport)
        if self._on_connect is not None:
            self._on_connect(self, self.writer)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._bulk is not None:
            return memoryview(self._bulk)[self._bulk_filled :]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._bulk is not None:
            self._bulk_filled += nbytes
            if self._bulk_filled == len(self._bulk):  # whole: what comes next goes to the scratch buffer
                self._bulk = None
        else:
            self._buffer += memoryview(self._scratch)[:nbytes]
            if len(self._buffer) > 2 * self._limit and not self._paused:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self.hung_up.set()
        self._wake()
        return True  # keep the writing end open: a worker still answers (an ERROR frame) after it

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None:
            self._exception = exc
        self.hung_up.set()
        self._wake()
        if self.writer is not None:
            self.writer.lost(exc)

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

    # ------------------------------------------------------------------ reading

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, as soon as any are there; b"" at the end of the stream."""
        while not self._buffer and not self._eof:
            await self._wait()
        return self._take(min(n, len(self._buffer)))

    async def readexactly(self, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes (a ``bytearray`` from ``BULK_BYTES`` on); ``IncompleteReadError`` when
        the stream ends first."""
        if n >= BULK_BYTES and len(self._buffer) < n:
            return await self._read_bulk(n)
        while len(self._buffer) < n:
            if self._eof:
                self._raise_incomplete(self._take(len(self._buffer)), n)
            await self._wait()
        return self._take(n)

    async def _read_bulk(self, n: int) -> bytearray:
        target = bytearray(n)
        have = len(self._buffer)
        target[:have] = self._buffer
        self._take(have)
        self._bulk, self._bulk_filled = target, have
        try:
            while self._bulk is not None:  # buffer_updated lets go of it once it is whole
                if self._eof:
                    self._raise_incomplete(bytes(target[: self._bulk_filled]), n)
                await self._wait()
        finally:
            self._bulk = None  # cancelled half way, the stream is out of step: its user closes it
        return target

    def _take(self, n: int) -> bytes:
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        if self._paused and len(self._buffer) <= self._limit:
            self._paused = False
            self.transport.resume_reading()
        return data

    def _raise_incomplete(self, partial: bytes, n: int) -> None:
        if self._exception is not None:
            raise self._exception
        raise asyncio.IncompleteReadError(partial, n)

    async def _wait(self) -> None:
        if self._exception is not None and not self._buffer:
            raise self._exception
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class BulkWriter:
    """The writing end of a :class:`BulkReader`'s connection: ``write``, ``write_eof``, ``drain``
    (waits while the transport's buffer is above its high-water mark), ``close``, ``is_closing``."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._paused = False
        self._lost: Exception | None = None
        self._closed = False
        self._drained: asyncio.Future | None = None

    def write(self, data) -> None:
        self.transport.write(data)

    def write_eof(self) -> None:
        self.transport.write_eof()

    async def drain(self) -> None:
        if self._closed:
            raise self._lost or ConnectionResetError("connection lost")
        if self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def close(self) -> None:
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def lost(self, exc: Exception | None) -> None:
        self._closed, self._lost = True, exc
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(exc or ConnectionResetError("connection lost"))
