"""``BulkReader`` over a real Unix socket: what a ``StreamReader`` would read, large reads received
into their own buffer, the end of the stream, and flow control."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from splitspec.transport import bulkreader
from splitspec.transport.bulkreader import BULK_BYTES, BulkReader


async def connected(limit: int = 1 << 20) -> tuple[BulkReader, socket.socket]:
    """A reader on one end of a socket pair, and the other end (blocking, for the test to write)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _, reader = await asyncio.get_running_loop().create_unix_connection(lambda: BulkReader(limit), sock=ours)
    return reader, theirs


async def send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().run_in_executor(None, sock.sendall, data)


def test_small_and_large_reads_return_the_bytes_sent_in_order():
    async def scenario():
        reader, peer = await connected()
        big = os.urandom(3 * BULK_BYTES + 12345)
        sender = asyncio.ensure_future(send(peer, b"head" + big + b"tail"))
        head = await reader.readexactly(4)
        body = await reader.readexactly(len(big))  # the first bytes arrived with "head": copied in, the rest received in place
        tail = await reader.readexactly(4)
        await sender
        peer.close()
        rest = await reader.read(10)
        return head, body, tail, rest, reader.at_eof(), reader.hung_up.is_set()

    head, body, tail, rest, eof, hung_up = asyncio.run(scenario())
    assert (head, tail, rest, eof, hung_up) == (b"head", b"tail", b"", True, True)
    assert isinstance(body, bytearray) and len(body) == 3 * BULK_BYTES + 12345


def test_large_read_equals_what_was_sent():
    async def scenario():
        reader, peer = await connected()
        data = os.urandom(2 * BULK_BYTES + 7)
        sender = asyncio.ensure_future(send(peer, data))
        got = await reader.readexactly(len(data))
        await sender
        peer.close()
        return data, got

    data, got = asyncio.run(scenario())
    assert got == data


@pytest.mark.parametrize("size", [10, 2 * BULK_BYTES])
def test_a_stream_that_ends_early_is_an_incomplete_read(size):
    async def scenario():
        reader, peer = await connected()
        await send(peer, b"x" * (size // 2))
        peer.close()
        with pytest.raises(asyncio.IncompleteReadError) as ended:
            await reader.readexactly(size)
        return ended.value

    ended = asyncio.run(scenario())
    assert ended.expected == size and ended.partial == b"x" * (size // 2)


def test_unread_bytes_past_twice_the_limit_pause_the_socket(monkeypatch):
    """A peer that sends while nobody reads fills about twice ``limit`` here at most (then the
    socket's own buffers), and reading resumes the socket."""
    monkeypatch.setattr(bulkreader, "SCRATCH_BYTES", 4096)

    async def scenario():
        reader, peer = await connected(limit=16384)
        peer.setblocking(False)
        sent = 0
        while not reader._paused and sent < 64 << 20:
            try:
                sent += peer.send(b"y" * 4096)
            except BlockingIOError:
                await asyncio.sleep(0.01)  # the loop reads what the socket holds
        buffered, paused = len(reader._buffer), reader._paused
        got = 0
        while got < sent:
            got += len(await reader.read(1 << 16))
        peer.close()
        return paused, buffered, reader._paused

    paused, buffered, still_paused = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert paused and buffered <= 2 * 16384 + 4096 and not still_paused
