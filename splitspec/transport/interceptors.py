"""Server interceptors: one maps errors to statuses, one checks the bearer token.

Every handler raises ``splitspec.errors.ServiceError`` subclasses (or anything else); the
``ErrorInterceptor`` turns them into precise status codes (for a bidirectional stream, the error of
one message ends the stream with that status), logs unexpected ones with a traceback
and an incident id, and returns only the incident id to the client. It also answers a request
that is not valid protobuf (for example a string field holding invalid UTF-8) with
INVALID_ARGUMENT instead of grpc's generic INTERNAL.
"""

from __future__ import annotations

import hmac
import logging
import uuid

import grpc

from splitspec.errors import InvalidArgument, ServiceError

logger = logging.getLogger(__name__)

# Probes (Kubernetes, load balancers) cannot send tokens; health reveals nothing else.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - reported to the client as INVALID_ARGUMENT
            return _Undecodable(exc)

    return parse


def request_id(context: grpc.aio.ServicerContext) -> str:
    """The caller's ``x-request-id`` metadata, or a new id."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and value:
            return str(value)[:64]
    return uuid.uuid4().hex


def status_of(exc: Exception, service_name: str, method: str, rid: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a handler's exception ends its call with, logged: a ``ServiceError``
    as itself, anything else as INTERNAL naming only an incident id (the traceback goes to the log)."""
    if isinstance(exc, ServiceError):
        logger.info("%s %s [%s] -> %s: %s", service_name, method, rid, exc.code, exc)
        return getattr(grpc.StatusCode, exc.code), str(exc)
    incident = uuid.uuid4().hex[:12]
    logger.error("%s %s [%s] failed (incident %s)", service_name, method, rid, incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method} (incident {incident})"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service_name: str) -> None:
        self.service_name = service_name

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        await context.abort(*status_of(exc, self.service_name, method, request_id(context)))

    def _undecodable(self, method: str, request) -> InvalidArgument | None:
        if not isinstance(request, _Undecodable):
            return None
        logger.info("%s %s: undecodable request: %s", self.service_name, method, request.error)
        return InvalidArgument(f"request is not a valid {method} message: {request.error}")

    async def _reject_undecodable(self, context, method: str, request) -> None:
        if (error := self._undecodable(method, request)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def _guarded(self, context, method: str, responses):
        """``responses`` passed through; an error raised while producing them ends the call with its status."""
        try:
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status in _fail()
            await self._fail(context, method, exc)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        deserialize = _tolerant(handler.request_deserializer)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                await self._reject_undecodable(context, method, request)
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status in _fail()
                    await self._fail(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                await self._reject_undecodable(context, method, request)
                async for response in self._guarded(context, method, inner_stream(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, handler.response_serializer)
        if handler.stream_stream:
            inner_bidi = handler.stream_stream

            async def decoded(requests):
                # Raised, not aborted: a stream may read requests ahead of its answers
                # (rpc.sequence_stream), and the answers before this one still go out first.
                async for request in requests:
                    if (error := self._undecodable(method, request)) is not None:
                        raise error
                    yield request

            async def stream_stream(requests, context):
                async for response in self._guarded(context, method, inner_bidi(decoded(requests), context)):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, handler.response_serializer)
        return handler


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata on every RPC except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(handler_call_details)
        return _DENY


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization' metadata")


_DENY = grpc.unary_unary_rpc_method_handler(_deny)
