"""The step socket: a worker's per-step RPC (Verify, Propose) on a plain Unix socket.

A DFlash round crosses the wire four times (gateway -> draft -> gateway -> target -> gateway),
and every step of every sequence pays for each crossing. Through grpc.aio one crossing cost
0.25-0.55 ms on an H200 host (its poller thread, HTTP/2 framing, the hand-off to the event
loop); the same bytes over an asyncio Unix socket take a fraction of that (a 100-byte echo: 0.29
ms round trip on gRPC, 0.06 ms here, on the CI machine). So workers that share a host with the
gateway also serve their step RPC here, and the gateway's ``--wire auto`` (the default) uses it.
Everything else (Prefill, Release, Info, health, the public API) stays on gRPC.

Protocol: one connection per sequence, like a ``*Stream`` RPC. Every frame is a header
``<u32 payload bytes><u8 kind>`` then the payload:
- ``HELLO`` (client, first frame): the worker's bearer token, empty when it has none; at most
  ``MAX_HELLO_BYTES``, and due within ``HELLO_TIMEOUT_S`` of connecting. The worker checks it
  before it reads anything else: a connection that has not authenticated gets no further than
  a header (a first frame of another kind, or a larger one, is refused on its header alone), so
  it cannot make the worker buffer a large frame;
- ``REQUEST`` / ``RESPONSE``: the serialized protobuf messages of the unary RPC;
- ``OPEN`` (client): the request of the worker's *opening* RPC, which starts a sequence (the
  target's Prefill), answered by a ``RESPONSE``: a prompt's tap features (21 MB for a 512-token
  prompt of an 8B target) then skip gRPC too, whose unary round trip alone took 34 ms for them;
- ``ERROR`` (worker): ``CODE\\nmessage``, a gRPC status code name and the message the gRPC
  RPC would have given; the worker closes the connection after it, as a stream ends on an error.
A request whose sequence id differs from the first one on the connection is an INVALID_ARGUMENT,
as on the gRPC streams. A client may pipeline ``REQUEST`` frames (send the next before reading
the answer to the last, two at most: ``rpc.sequence_stream``); answers come in the order sent. An
``OPEN`` finishes before the request after it starts. A client that hangs up while its ``OPEN``
runs gives that call up, as a cancelled gRPC call does: the worker cancels the servicer's
coroutine (the target's Prefill then releases the sequence it makes, see ``EngineHost.open``).
The socket carries no TLS: it is offered only on the worker's own host (see
``resolve_step_socket``), where the file's permissions guard it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from splitspec.errors import InvalidArgument, ResourceExhausted, Unauthenticated
from splitspec.transport.bulkreader import BulkReader, BulkWriter
from splitspec.transport.interceptors import status_of
from splitspec.transport.rpc import MAX_MESSAGE_BYTES, StepConnection, rpc_error, sequence_stream
from splitspec.transport.tensors import wire_parts

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
HELLO, REQUEST, RESPONSE, ERROR, OPEN = range(5)
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES  # a long prompt's tap features, as on gRPC
# Frames go out without waiting for the reader; a write waits only past this much unsent data.
WRITE_HIGH_WATER = 64 * 1024 * 1024
# A reader pauses its socket past twice this much unread data (a frame's payload of BULK_BYTES or
# more is received into its own buffer, outside this count).
READ_LIMIT = 32 * 1024 * 1024
ERROR_LINGER_S = 5.0  # how long a worker waits for the client to hang up after an ERROR frame
# A client refused at its hello is waited for that long too, but only while it sends at most this
# much (a hello and an ordinary first request sent with it); then the worker hangs up.
UNAUTHENTICATED_LINGER_BYTES = 1024 * 1024
MAX_HELLO_BYTES = 4096  # a bearer token (or the worker's own, if longer)
HELLO_TIMEOUT_S = 10.0  # a connection must authenticate this soon after it opens


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


# Parts of a frame shorter than this are joined with their neighbours into one write; longer ones
# (a prompt's features: tens of MB) go as they are, not copied.
JOIN_BYTES = 64 * 1024


def write_frame(writer: BulkWriter | asyncio.StreamWriter, kind: int, *payload: bytes | memoryview) -> None:
    """``frame`` with the payload in parts (written in order): runs of short parts, the header
    included, are joined into one write, and each long part is written as it is. Each write of an
    idle transport is a send(), and the first wakes the reader: a step's frame written as header
    and payload apart took two of each (py-spy, 8 users on the 2-core CPU: 7.1-7.5% of a gateway's
    samples in this function, 5.9-6.4% joined; no end-to-end change measurable there, BENCHMARKS.md [S20])."""
    run: list[bytes | memoryview] = [HEADER.pack(sum(len(part) for part in payload), kind)]
    for part in payload:
        if len(part) < JOIN_BYTES:
            run.append(part)
            continue
        if run:  # none between two long parts
            writer.write(b"".join(run))
            run = []
        writer.write(part)
    if run:
        writer.write(b"".join(run))


async def read_header(reader: BulkReader | asyncio.StreamReader) -> tuple[int, int] | None:
    """The next frame's (payload bytes, kind), or None when the peer closed the connection between frames."""
    try:
        return HEADER.unpack(await reader.readexactly(HEADER.size))
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None


async def read_frame(reader: BulkReader | asyncio.StreamReader) -> tuple[int, bytes] | None:
    """The next frame, or None when the peer closed the connection between frames (a large
    payload from a ``BulkReader`` is a ``bytearray``)."""
    header = await read_header(reader)
    if header is None:
        return None
    size, kind = header
    if size > MAX_FRAME_BYTES:
        raise ResourceExhausted(f"step socket frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return kind, await reader.readexactly(size)


def resolve_step_socket(value: str, listen: str, tls: bool) -> str:
    """The worker's ``--step-socket``: ``off``, a path, or ``auto`` (``<path>.steps`` next to a
    ``unix:<path>`` listen address without TLS; off otherwise, as a TCP listener may be remote)."""
    if value == "off":
        return ""
    if value != "auto":
        return str(Path(value).absolute())
    if tls or not listen.startswith("unix:"):
        return ""
    return str(Path(listen.removeprefix("unix://").removeprefix("unix:")).absolute()) + ".steps"


def add_step_socket_argument(p) -> None:
    p.add_argument(
        "--step-socket", default="auto",
        help="Unix socket that also serves this worker's per-step RPC, with less overhead than gRPC, for a gateway on "
        "this host: a path, off, or auto (PATH.steps when --listen is unix:PATH without TLS, else off); it checks the "
        "--auth-token",
    )


def step_server_from_args(
    args, service_name: str, method: str, request_type: RequestType, step, opener: Opener | None = None
) -> StepSocketServer | None:
    """The worker's step socket server per ``--step-socket`` (None when off). A path given
    explicitly must bind; one chosen by ``auto`` may fail to (the worker then serves gRPC only)."""
    tls = bool(args.tls_cert or args.tls_key or args.tls_client_ca)
    path = resolve_step_socket(args.step_socket, args.listen, tls)
    if not path:
        return None
    return StepSocketServer(
        path, service_name, method, request_type, step, args.auth_token, required=args.step_socket != "auto", opener=opener
    )


class RequestType(Protocol):
    """What reads a request's bytes: a protobuf message type, or a ``TensorFieldReader``."""

    def FromString(self, payload: bytes | bytearray) -> Any: ...


@dataclass(frozen=True)
class Opener:
    """A worker's opening RPC on the step socket (``OPEN`` frames): its name, request type and
    the servicer's unary method (given ``context=None``)."""

    method: str
    request_type: RequestType
    call: Callable[[object, None], Awaitable[object]]


@dataclass(frozen=True)
class _Call:
    sequence_id: str  # read by ``sequence_stream``: one sequence per connection
    method: Callable[[object, None], Awaitable[object]]
    request: object
    opens: bool = False  # the opening RPC: given up when the client hangs up while it runs


class StepSocketServer:
    """Serves ``step(request, context)`` (a servicer's unary step method, given ``context=None``)
    for requests of ``request_type`` on the Unix socket ``path``; errors get the status code and
    message of the service's ``ErrorInterceptor``. ``request_type.FromString`` reads a request: a
    message type's, or a ``TensorFieldReader``'s (its large tensor field read in place)."""

    def __init__(
        self,
        path: str,
        service_name: str,
        method: str,
        request_type: RequestType,
        step: Callable[[object, None], Awaitable[object]],
        token: str = "",
        required: bool = True,
        opener: Opener | None = None,
    ) -> None:
        self.path, self.service_name, self.method = path, service_name, method
        self.request_type, self.step, self.opener = request_type, step, opener
        self._token = token.encode()
        self.required = required  # False: a socket that cannot be bound is logged, not fatal
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def offered(self) -> str:
        """The path the worker's Info names: the socket once it listens, else ""."""
        return self.path if self._server is not None else ""

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket file left by a worker that died
        try:
            loop = asyncio.get_running_loop()

            def connected(reader: BulkReader, writer: BulkWriter) -> None:
                self._connections.add(loop.create_task(self._serve(reader, writer)))

            self._server = await loop.create_unix_server(lambda: BulkReader(READ_LIMIT, connected), self.path)
        except OSError as exc:
            if self.required:
                raise OSError(f"--step-socket {self.path}: {exc}") from exc
            logger.warning("%s: no step socket at %s (%s); steps are served on gRPC only", self.service_name, self.path, exc)
            return
        logger.info("%s: %s steps on the step socket %s", self.service_name, self.method, self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve(self, reader: BulkReader, writer: BulkWriter) -> None:
        task = asyncio.current_task()
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the gateway went away mid-frame: nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()

    async def _authenticate(self, reader: BulkReader) -> bool:
        """Read and check the hello; False when the client closed the connection before sending one.
        Refuses on the header alone a first frame that is not a hello or is too large to be one."""
        refused = Unauthenticated("missing or wrong bearer token in the step socket's hello")
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                header = await read_header(reader)
                if header is None:
                    return False
                size, kind = header
                if kind != HELLO or size > max(MAX_HELLO_BYTES, len(self._token)):
                    raise refused
                token = await reader.readexactly(size)
        except TimeoutError:
            raise Unauthenticated(f"no hello within {HELLO_TIMEOUT_S:g} s of connecting to the step socket") from None
        if not hmac.compare_digest(token, self._token):
            raise refused
        return True

    async def _answer(self, reader: BulkReader, writer: BulkWriter) -> None:
        method = [self.method]  # the RPC of the frame being answered: an error's status names it
        authenticated = False
        try:
            if not await self._authenticate(reader):
                return
            authenticated = True
            answers = sequence_stream(
                self._requests(reader, method), None, lambda call, _: self._call(call, reader.hung_up), alone=lambda call: call.opens
            )
            async with contextlib.aclosing(answers):
                async for response in answers:
                    write_frame(writer, RESPONSE, *wire_parts(response))
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the ERROR frame, as the interceptor's status
            code, message = status_of(exc, self.service_name, method[0], "step-socket")
            writer.write(frame(ERROR, f"{code.name}\n{message}".encode()))
            writer.write_eof()
            await writer.drain()
            # Hang up only after the client does (it closes on an ERROR): closing first would break
            # a client still writing (its hello and first request go out together), and a broken
            # connection loses the ERROR frame waiting in its buffer. What it sends meanwhile is
            # dropped as it comes; a client that has not authenticated may send only a little.
            limit = math.inf if authenticated else UNAUTHENTICATED_LINGER_BYTES
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(ERROR_LINGER_S):
                    while limit > 0 and (dropped := await reader.read(1 << 16)):
                        limit -= len(dropped)

    async def _call(self, call: _Call, hung_up: asyncio.Event):
        """The servicer's answer to ``call``. An opening call is given up (its coroutine cancelled,
        as gRPC cancels a handler whose client went away) when the client hangs up before its
        answer; a step is not: it makes nothing that outlives the connection, and racing it would
        cost every step two tasks."""
        if not call.opens:
            return await call.method(call.request, None)
        answer = asyncio.ensure_future(call.method(call.request, None))
        hang_up = asyncio.ensure_future(hung_up.wait())
        try:
            await asyncio.wait({answer, hang_up}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        finally:
            hang_up.cancel()
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answer
            raise ConnectionResetError("the client hung up before the answer")
        return answer.result()

    async def _requests(self, reader: BulkReader, current: list[str]) -> AsyncIterator[_Call]:
        while (received := await read_frame(reader)) is not None:
            kind, payload = received
            if kind == REQUEST:
                method, request_type, call = self.method, self.request_type, self.step
            elif kind == OPEN and self.opener is not None:
                method, request_type, call = self.opener.method, self.opener.request_type, self.opener.call
            else:
                raise InvalidArgument(f"step socket: frame kind {kind} where a request was expected")
            current[0] = method
            try:
                request = request_type.FromString(payload)
            except Exception as exc:  # noqa: BLE001 - undecodable bytes are the client's error
                raise InvalidArgument(f"request is not a valid {method} message: {exc}") from exc
            yield _Call(request.sequence_id, call, request, opens=kind == OPEN)


class StepSocket(StepConnection):
    """One sequence's steps over a worker's step socket (``StepConnection``). A worker that
    cannot be reached, or that closed the connection, is UNAVAILABLE."""

    def __init__(self, path: str, response_type: type, token: str = "") -> None:
        super().__init__()
        self.path, self.response_type = path, response_type
        self.what = f"step socket {path}"
        self._hello = frame(HELLO, token.encode())
        self._reader: BulkReader | None = None
        self._writer: BulkWriter | None = None

    async def _write(self, request, opening: bool) -> None:
        if self._writer is None or self._reader.at_eof():  # a worker that restarted closed it
            self.close()
            _, self._reader = await asyncio.get_running_loop().create_unix_connection(lambda: BulkReader(READ_LIMIT), self.path)
            self._writer = self._reader.writer
            self._writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
            self._writer.write(self._hello)
        write_frame(self._writer, OPEN if opening else REQUEST, *wire_parts(request))

    async def _read(self) -> tuple[int, bytes] | None:
        return await read_frame(self._reader)

    def _answer(self, received: tuple[int, bytes] | None, opening: type | None):
        if received is None:
            self.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.what}: the worker closed the connection")
        kind, payload = received
        if kind == ERROR:
            self.close()
            code, _, message = payload.decode(errors="replace").partition("\n")
            raise rpc_error(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message)
        self.answer_bytes = len(payload)
        return (opening or self.response_type).FromString(payload)

    def _connected(self) -> bool:
        return self._reader is not None

    def _disconnect(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    def _lost(self, exc: BaseException) -> grpc.aio.AioRpcError | None:
        if isinstance(exc, (OSError, asyncio.IncompleteReadError)):
            return rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.what}: {exc!r}")
        return None
