"""gRPC plumbing shared by the three services: options, the error interceptor, server start-up.

Every service runs on ``grpc.aio`` with one ``ErrorInterceptor``: handlers raise
``splitspec.errors.ServiceError`` subclasses (or anything else) and the interceptor turns them
into precise status codes, logging unexpected ones with a traceback that never reaches clients.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitspec.errors import ServiceError

logger = logging.getLogger(__name__)

# Tap features of a long prompt are the largest messages; keep the limit explicit, not unlimited.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _status(error: ServiceError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to gRPC statuses, one place per service."""

    def __init__(self, service_name: str) -> None:
        self.service_name = service_name

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
            if isinstance(exc, ServiceError):
                logger.info("%s %s -> %s: %s", self.service_name, method, exc.code, exc)
                await context.abort(_status(exc), str(exc))
            incident = uuid.uuid4().hex[:12]
            logger.exception("%s %s failed (incident %s)", self.service_name, method, incident)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} (incident {incident})")

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status in fail()
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await fail(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for response in inner_stream(request, context):
                        yield response
                except Exception as exc:  # noqa: BLE001
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await fail(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


def create_server(
    service_name: str,
    add_servicers: Iterable[Callable[[grpc.aio.Server], None]],
    full_service_names: Iterable[str],
    address: str,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """An aio server with the error interceptor, health (NOT_SERVING until ``set_serving``) and reflection."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor(service_name)], options=CHANNEL_OPTIONS)
    for add in add_servicers:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(full_service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot bind {service_name} to {address}")
    return server, health_servicer, port


async def set_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def channel(address: str, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors))


def new_request_id() -> str:
    return uuid.uuid4().hex


async def serve_until_terminated(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    names: Iterable[str],
    grace_s: float = 5.0,
) -> None:
    """Run until SIGINT/SIGTERM, then report NOT_SERVING, let in-flight RPCs finish, and stop."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: draining for up to %.1f s", grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


async def expire_periodically(executor, expire: Callable[[float], list[str]], ttl_s: float, what: str) -> None:
    """Release sequences idle for ``ttl_s`` seconds, checking every ttl/4 (capped at 30 s)."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(30.0, ttl_s / 4))
        stale = await loop.run_in_executor(executor, expire, ttl_s)
        for sid in stale:
            logger.warning("released %s sequence %s after %.0f s idle", what, sid, ttl_s)
