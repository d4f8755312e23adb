"""gRPC plumbing shared by the three services: options, server start-up and shutdown, channels.

Every service runs on ``grpc.aio`` with the interceptors of ``splitspec.transport.interceptors``, the
standard health service (NOT_SERVING until its model is loaded) and server reflection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitspec.errors import InvalidArgument
from splitspec.transport.interceptors import ErrorInterceptor, TokenAuthInterceptor
from splitspec.transport.security import ClientSecurity, ServerSecurity

logger = logging.getLogger(__name__)

# Tap features of a long prompt are the largest worker messages; keep the limit explicit. gRPC's
# own ceiling (a signed 32-bit length): a 16K-token prompt's features at 27B (5 taps x 5120 x bf16)
# are 819 MB, so prompts up to ~40K tokens of such a target fit one message.
MAX_MESSAGE_BYTES = 2**31 - 1
# HTTP/2 flow control starts each stream with a 64 KiB window: a step's tap features (~40 KiB per
# committed row for an 8B target) would wait on window updates. A large initial window lets a
# step's message go out at once (a 245 KB echo on a stream: 0.84 -> 0.58 ms on the CI machine).
WINDOW_OPTIONS = [("grpc.http2.lookahead_bytes", 16 * 1024 * 1024)]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *WINDOW_OPTIONS,
]


def create_server(
    service_name: str,
    add_servicers: Iterable[Callable[[grpc.aio.Server], None]],
    full_service_names: Iterable[str],
    address: str,
    security: ServerSecurity = ServerSecurity(),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with interceptors, health (NOT_SERVING until ``set_serving``) and reflection."""
    interceptors = [ErrorInterceptor(service_name)]
    if security.token:
        interceptors.insert(0, TokenAuthInterceptor(security.token))
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", max_receive_bytes), *WINDOW_OPTIONS,
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    for add in add_servicers:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(full_service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.credentials()
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot bind {service_name} to {address}")
    return server, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


class _MetadataInterceptor:
    """Adds fixed metadata (the bearer token) to every call of a channel. grpc.aio files each
    interceptor under one call kind only, so each kind the workers serve has its own subclass."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details):
        metadata = tuple(details.metadata or ()) + self.metadata
        return details._replace(metadata=metadata)


class _UnaryMetadataInterceptor(_MetadataInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamMetadataInterceptor(_MetadataInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def channel(
    address: str, security: ClientSecurity = ClientSecurity(), interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
) -> grpc.aio.Channel:
    options = list(CHANNEL_OPTIONS)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    if security.token:
        metadata = security.metadata()
        interceptors = [*interceptors, _UnaryMetadataInterceptor(metadata), _StreamMetadataInterceptor(metadata)]
    credentials = security.channel_credentials()
    if credentials:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=list(interceptors) or None)
    return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)


def rpc_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """The error a gRPC call ending with this status raises, for step wires that fail like the unary call."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


def deadline_exceeded() -> grpc.aio.AioRpcError:
    """What a unary call that misses its timeout raises."""
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class StepConnection:
    """The client side of one sequence's steps on one connection (a gRPC ``*Stream`` call, a step
    socket): ``step`` writes a request and reads its answer; ``send`` and ``receive`` pipeline
    them (answers come in the order the requests went, ``sequence_stream``). The connection opens
    on the first write and whenever the last one ended (a worker that restarted ends it). A step
    that fails, times out or is cancelled closes it, and so does a ``step`` after answers were left
    unread: a late answer is never read as a later step's. Failures raise the ``AioRpcError`` the
    unary call would.

    Subclasses give ``_write``, ``_read``, ``_answer``, ``_connected`` and ``_disconnect``, and
    map their transport's own failures in ``_lost``; ``what`` names the connection in errors.
    """

    what = "step connection"

    def __init__(self) -> None:
        self._unanswered = 0  # requests written whose answers were not read
        # The serialized size of the last answer read, where the transport has it at hand (a step
        # socket's frame); None where only the message's ``ByteSize()`` gives it (which serializes it).
        self.answer_bytes: int | None = None

    async def step(self, request, timeout: float | None, opening: type | None = None):
        """One exchange: a step's request, or (``opening``: its response type) the worker's opening
        RPC's, which only a step socket carries (the target's Prefill)."""
        if self._unanswered:
            self.close()
        async with self._failing(timeout):
            await self._write(request, opening is not None)
            received = await self._read()
        return self._answer(received, opening)

    async def send(self, request, timeout: float | None) -> None:
        """Write a step's request without reading its answer: ``receive`` reads the answers in order."""
        async with self._failing(timeout):
            await self._write(request, False)
        self._unanswered += 1

    async def receive(self, timeout: float | None):
        """The answer to the oldest request written and not yet answered."""
        if not self._connected():
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.what}: no request in flight (the connection was closed)")
        async with self._failing(timeout):
            received = await self._read()
        self._unanswered -= 1
        return self._answer(received, None)

    @contextlib.asynccontextmanager
    async def _failing(self, timeout: float | None):
        try:
            async with asyncio.timeout(timeout):
                yield
        except TimeoutError:
            self.close()
            raise deadline_exceeded() from None
        except BaseException as exc:
            self.close()
            lost = self._lost(exc)
            if lost is None:
                raise
            raise lost from exc

    def close(self) -> None:
        self._disconnect()
        self._unanswered = 0

    async def _write(self, request, opening: bool) -> None:
        raise NotImplementedError

    async def _read(self):
        raise NotImplementedError

    def _answer(self, received, opening: type | None):
        """The response message of what ``_read`` returned (raising, and closing, on an error)."""
        raise NotImplementedError

    def _connected(self) -> bool:
        raise NotImplementedError

    def _disconnect(self) -> None:
        raise NotImplementedError

    def _lost(self, exc: BaseException) -> grpc.aio.AioRpcError | None:
        """The error to raise for a failure of the transport itself (None: ``exc`` as it is)."""
        return None


def new_request_id() -> str:
    return uuid.uuid4().hex


def install_stop_handlers() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain_and_stop(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float) -> None:
    """Report NOT_SERVING, refuse new RPCs, let in-flight ones finish for up to ``grace_s``, stop."""
    logger.info("shutting down: draining for up to %.1f s", grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


async def serve(
    name: str,
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    service_names: Iterable[str],
    load: Callable[[], object],
    grace_s: float,
    background: Iterable[Callable[[], object]] = (),
    before_drain: Callable[[], None] = lambda: None,
) -> None:
    """Listen at once (health NOT_SERVING), ``await load()``, report SERVING, run until a signal, drain.

    Listening before the model is loaded lets probes and the gateway see a loading worker instead
    of a refused connection. An exception from ``load`` stops the server and propagates.
    """
    stop = install_stop_handlers()
    await server.start()
    await set_serving(health_servicer, service_names, False)
    loading = asyncio.ensure_future(load())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        logger.info("%s: stopped while loading", name)
        await server.stop(0)
        return
    stopping.cancel()
    if loading.exception() is not None:
        await server.stop(0)
        raise loading.exception()
    await set_serving(health_servicer, service_names, True)
    tasks = [asyncio.ensure_future(job()) for job in background]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
    before_drain()
    await drain_and_stop(server, health_servicer, grace_s)


PIPELINE_DEPTH = 2  # requests a stream reads ahead of its answers (sequence_stream)


async def sequence_stream(
    requests: AsyncIterator[Any], context: Any, step: Callable[[Any, Any], Awaitable[Any]], depth: int = PIPELINE_DEPTH,
    alone: Callable[[Any], bool] = lambda request: False,
) -> AsyncIterator[Any]:
    """The body of a ``*Stream`` RPC: each request answered by ``step`` (the unary RPC's method),
    in order. A stream serves one sequence: a request naming another ends it with INVALID_ARGUMENT.
    An error from ``step`` ends the stream; the service's ``ErrorInterceptor`` gives it the status
    and message the unary RPC would.

    A client may *pipeline*: send up to ``depth`` requests before it reads the first answer (the
    gateway's target-only decode steps do; their requests do not depend on the answers before). A
    request's step starts as soon as it is read, so the sequence's steps reach the engine in the
    order sent, one behind the other; one for which ``alone(request)`` holds (the step socket's
    opening Prefill, which does not queue with the steps) finishes before the next one starts.
    When the stream ends (an error, the end of the requests, the client gone), the steps started
    behind the last answer are cancelled before it does: one waiting for its pass leaves the
    queue, one whose pass started finishes with it, and none can run after the stream has ended
    (after, say, the gateway's re-prefill of a lost sequence)."""
    loop = asyncio.get_running_loop()
    started: collections.deque = collections.deque()  # unanswered steps in the order read, then the reading's end
    waiting: list[asyncio.Future | None] = [None, None]  # the answering loop's (nothing started), the reader's (no room)

    def wake(who: int) -> None:
        if waiting[who] is not None and not waiting[who].done():
            waiting[who].set_result(None)

    async def read() -> None:
        sequence_id = None
        try:
            while True:
                while len(started) >= depth:
                    waiting[1] = loop.create_future()
                    await waiting[1]
                request = await anext(requests, None)
                if request is None:
                    break
                if sequence_id is None:
                    sequence_id = request.sequence_id
                elif request.sequence_id != sequence_id:
                    raise InvalidArgument(
                        f"sequence_id: {request.sequence_id!r} on the stream of sequence {sequence_id!r} (one stream per sequence)"
                    )
                answer = loop.create_task(step(request, context))
                started.append(answer)
                wake(0)
                if alone(request):
                    await asyncio.wait({answer})
            started.append(StopAsyncIteration())
        except Exception as exc:  # noqa: BLE001 - raised to the client after the answers before it
            started.append(exc)
        wake(0)

    reader = loop.create_task(read())
    try:
        while True:
            while not started:
                waiting[0] = loop.create_future()
                await waiting[0]
            if isinstance(started[0], BaseException):
                break
            result = await started[0]
            started.popleft()
            wake(1)
            yield result
        if not isinstance(started[0], StopAsyncIteration):
            raise started[0]
    finally:
        reader.cancel()
        steps = [answer for answer in started if isinstance(answer, asyncio.Future)]
        for answer in steps:
            answer.cancel()
        await asyncio.gather(reader, *steps, return_exceptions=True)
