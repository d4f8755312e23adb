"""The gateway's HTTP API (OpenAI- and Anthropic-compatible), served by uvicorn in the gateway's own event loop.

One code path: every endpoint translates its JSON into the gateway's own request and runs it
through ``GatewayServicer.generate``, the generator gRPC ``Generate`` runs (validation, admission,
speculation, text stream, metrics, the request's log line), with a :class:`Call` standing for the
gRPC context: request id (``x-request-id``), client identity (``--client-identity``; the
connection's address, or a header set by a trusted proxy), deadline (none: an HTTP client
ends a request by disconnecting).

Each generation runs as its own task (as a gRPC call does); a client that disconnects, in the middle
of a stream or while waiting for a whole answer, cancels that task once, and the sequence is
released on both workers as for a cancelled gRPC call.

Errors answer in each API's own JSON shape with the status :mod:`services.gateway.http.errors`
maps; with ``--auth-token`` every endpoint but ``/health`` needs ``Authorization: Bearer TOKEN``
(or Anthropic's ``x-api-key: TOKEN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.admission import client_identity
from services.gateway.http import anthropic as anth
from services.gateway.http import openai as oai
from services.gateway.http.errors import HttpError, ModelNotFound, PayloadTooLarge, http_error
from services.gateway.http.fields import parse_json
from services.gateway.server import Call, GatewayServicer
from services.metrics import model_name
from splitspec.errors import Unauthenticated
from splitspec.v1 import gateway_pb2

logger = logging.getLogger(__name__)
_END, _GONE = object(), object()


class ClientGone(Exception):
    """The client disconnected and its generation was cancelled; nothing is left to answer."""


class _Peer:
    """What ``admission.client_identity`` reads of a gRPC context, from an HTTP request."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def peer(self) -> str:
        client = self.request.client
        if client is None:
            return "unix:"
        return f"{'ipv6' if ':' in client.host else 'ipv4'}:{client.host}:{client.port}"

    def invocation_metadata(self):
        return [(k.lower(), v) for k, v in self.request.headers.items()]


class Generation:
    """One request's ``generate`` run as its own task, its messages queued for the response."""

    def __init__(self, responses: AsyncIterator[gateway_pb2.GenerateResponse]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ahead: list = []  # items taken from the queue and put back
        self.logprobs: list = []  # what collect() gathered of the messages' logprobs, aligned with their token ids
        self.task = asyncio.ensure_future(self._pump(responses))

    async def _pump(self, responses) -> None:
        try:
            async for response in responses:
                self.queue.put_nowait(response)
        except asyncio.CancelledError:
            self.queue.put_nowait(_GONE)
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self.queue.put_nowait(exc)
        else:
            self.queue.put_nowait(_END)

    async def next(self) -> gateway_pb2.GenerateResponse | None:
        item = self.ahead.pop(0) if self.ahead else await self.queue.get()
        if item is _END:
            return None
        if item is _GONE:
            raise ClientGone()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.task.cancel()

    async def collect(self) -> tuple[str, gateway_pb2.Final]:
        text = []
        while (r := await self.next()) is not None:
            text.append(r.text)
            self.logprobs.extend(r.logprobs)
            if r.HasField("final"):
                return "".join(text), r.final
        raise RuntimeError("the generation ended without a final message")


async def _until_disconnect(receive, generation: Generation) -> None:
    """Cancel ``generation`` when the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            generation.cancel()
            return


class EventStream(Response):
    """Server-sent events: the encoded events of ``events`` (see :func:`sse`), written as they come;
    a client that disconnects cancels the generation behind them at once, not at the next write."""

    def __init__(self, events: AsyncIterator[bytes], generation: Generation) -> None:
        self.status_code, self.background = 200, None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
        ]
        self.events, self.generation = events, generation

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_until_disconnect(receive, self.generation))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, ClientGone):  # the client went away
            self.generation.cancel()
        finally:
            watcher.cancel()
            if not self.generation.task.done():
                self.generation.cancel()


def sse(data, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class HttpApi:
    def __init__(self, servicer: GatewayServicer, *, token: str = "", identity: str = "peer", max_request_bytes: int = 4 << 20) -> None:
        self.servicer, self.identity, self.max_request_bytes = servicer, identity, max_request_bytes
        self._expected = f"Bearer {token}".encode() if token else None
        self._token = token.encode()
        path = servicer.state.target_info.geometry.path
        self.model_id = model_name(path)
        self.model_names = {self.model_id, path}
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._endpoint("openai", self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint("openai", self.model), methods=["GET"]),
            Route("/v1/chat/completions", self._endpoint("openai", self.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint("openai", self.completions), methods=["POST"]),
            Route("/v1/messages", self._endpoint("anthropic", self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._endpoint("anthropic", self.count_tokens), methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    # --- plumbing

    def _authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        key = request.headers.get("x-api-key", "").encode()
        if not (hmac.compare_digest(given, self._expected) or (key and hmac.compare_digest(key, self._token))):
            raise Unauthenticated("missing or wrong bearer token in the Authorization header")

    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise PayloadTooLarge(f"body: {declared} bytes is over the limit of {self.max_request_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise PayloadTooLarge(f"body: over the limit of {self.max_request_bytes} bytes")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def _call(self, request: Request, rid: str) -> Call:
        return Call(request_id=rid, client=client_identity(_Peer(request), self.identity))

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ModelNotFound(f"model: {model!r} is not served here; this gateway serves {self.model_id!r}")

    def _endpoint(self, api: str, handler: Callable):
        async def endpoint(request: Request) -> Response:
            rid = (request.headers.get("x-request-id") or uuid.uuid4().hex)[:64]
            try:
                self._authorize(request)
                return await handler(request, rid)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the generation was released
            except Exception as exc:  # noqa: BLE001 - every failure answers in the API's own shape
                return self._error(api, http_error(exc, request.url.path, rid))

        return endpoint

    @staticmethod
    def _error(api: str, error: HttpError) -> JSONResponse:
        return JSONResponse(error.anthropic() if api == "anthropic" else error.openai(), status_code=error.status)

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        return self._error(api, HttpError(404, f"no such endpoint: {request.method} {request.url.path}", None, "NOT_FOUND"))

    async def _not_allowed(self, request: Request, exc) -> JSONResponse:
        return self._error("openai", HttpError(405, f"method {request.method} is not allowed on {request.url.path}", None, "INVALID_ARGUMENT"))

    async def _generate(self, request: Request, rid: str, gen_request, chat=None) -> Generation:
        """Start the generation; wait for its first message (so errors before any output answer
        with their HTTP status), cancelling it if the client disconnects meanwhile."""
        generation = Generation(self.servicer.generate(gen_request, self._call(request, rid), chat))
        watcher = asyncio.ensure_future(_until_disconnect(request.receive, generation))
        try:
            first = await generation.next()
        finally:
            watcher.cancel()
        generation.ahead.append(_END if first is None else first)
        return generation

    async def _whole(self, request: Request, generation: Generation) -> tuple[str, gateway_pb2.Final]:
        watcher = asyncio.ensure_future(_until_disconnect(request.receive, generation))
        try:
            return await generation.collect()
        finally:
            watcher.cancel()

    # --- endpoints

    async def health(self, request: Request) -> Response:
        up = self.servicer.monitor.target_up
        return JSONResponse({"status": "ok" if up else "unavailable", "target": up, "draft": self.servicer.monitor.draft_up},
                            status_code=200 if up else 503)

    def token_text(self, token_id: int) -> str:
        """A token's text as logprobs name it: the token decoded alone, special tokens spelled out."""
        return self.servicer.state.tokenizer.decode([token_id], skip_special_tokens=False)

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "splitspec",
                "context_length": self.servicer.state.target_info.geometry.max_context,
                "max_model_len": self.servicer.state.target_info.geometry.max_context}

    async def models(self, request: Request, rid: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request, rid: str) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def chat(self, request: Request, rid: str) -> Response:
        body = await self._body(request)
        gen_request, chat, call = oai.chat_request(body)
        self._check_model(call.model)
        generation = await self._generate(request, rid, gen_request, chat)
        if not call.stream:
            text, final = await self._whole(request, generation)
            return JSONResponse(oai.chat_response(call, text, final, generation.logprobs, self.token_text))

        async def events():
            chunks = oai.ChatChunks(call, self.token_text)
            for chunk in chunks.start():
                yield sse(chunk)
            async for item in _stream(generation, rid, request.url.path):
                if isinstance(item, HttpError):
                    yield sse(item.openai())
                    return
                out = chunks.end(item.final) if item.HasField("final") else chunks.text(item.text, item.logprobs)
                for chunk in out:
                    yield sse(chunk)
            yield sse("[DONE]")

        return EventStream(events(), generation)

    async def completions(self, request: Request, rid: str) -> Response:
        body = await self._body(request)
        gen_request, call = oai.completion_request(body)
        self._check_model(call.model)
        generation = await self._generate(request, rid, gen_request)
        if not call.stream:
            text, final = await self._whole(request, generation)
            return JSONResponse(oai.completion_response(call, text, final, generation.logprobs, self.token_text))

        async def events():
            offset = 0  # characters of token text sent: the next token's text_offset
            async for item in _stream(generation, rid, request.url.path):
                if isinstance(item, HttpError):
                    yield sse(item.openai())
                    return
                if item.HasField("final"):
                    yield sse(oai.completion_chunk(call, item.text, oai.FINISH.get(item.final.finish_reason, "stop")))
                    if call.include_usage:
                        chunk = oai.completion_chunk(call, "")
                        chunk["choices"], chunk["usage"] = [], oai.usage(item.final)
                        yield sse(chunk)
                elif call.logprobs and item.logprobs:
                    logprobs = oai.completion_logprobs(item.logprobs, self.token_text, offset)
                    offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    yield sse(oai.completion_chunk(call, item.text, logprobs=logprobs))
                elif item.text:
                    yield sse(oai.completion_chunk(call, item.text))
            yield sse("[DONE]")

        return EventStream(events(), generation)

    async def messages(self, request: Request, rid: str) -> Response:
        body = await self._body(request)
        gen_request, chat, call = anth.messages_request(body)
        self._check_model(call.model)
        generation = await self._generate(request, rid, gen_request, chat)
        if not call.stream:
            text, final = await self._whole(request, generation)
            return JSONResponse(anth.message_response(call, text, final))

        async def events():
            stream = anth.MessageEvents(call)
            for name, data in stream.start():
                yield sse(data, name)
            async for item in _stream(generation, rid, request.url.path):
                if isinstance(item, HttpError):
                    yield sse(item.anthropic(), "error")
                    return
                out = stream.end(item.final) if item.HasField("final") else stream.text(item.text)
                for name, data in out:
                    yield sse(data, name)

        return EventStream(events(), generation)

    async def count_tokens(self, request: Request, rid: str) -> Response:
        body = await self._body(request)
        gen_request, chat, call = anth.messages_request(body, count_only=True)
        self._check_model(call.model)
        count = await self.servicer.count_prompt_tokens(gen_request, self._call(request, rid), chat)
        return JSONResponse({"input_tokens": count})


async def _stream(generation: Generation, rid: str, path: str):
    """The generation's messages; an error after the stream started is yielded as an HttpError
    (its status line is sent already), to be written as the API's error event."""
    while True:
        try:
            item = await generation.next()
        except (asyncio.CancelledError, ClientGone):
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the stream's error event
            yield http_error(exc, path, rid)
            return
        if item is None:
            return
        yield item


class HttpService:
    """uvicorn serving ``api`` on ``listen`` (HOST:PORT or unix:PATH) inside the gateway's event loop.

    The socket is bound at construction, so a taken port fails the gateway's start-up with one
    line (uvicorn itself would exit the process). TLS with ``cert``/``key`` (the gateway's
    ``--tls-cert/--tls-key``), client certificates required with ``client_ca``. uvicorn's own
    signal handling is off: the gateway's handlers drain gRPC and HTTP together."""

    def __init__(self, api: HttpApi, listen: str, *, cert: str = "", key: str = "", client_ca: str = "", grace_s: float = 30.0) -> None:
        import ssl

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.listen = listen
        self.socket = bind(listen)
        kwargs = {}
        if cert or key:
            if not (cert and key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            kwargs.update(ssl_certfile=cert, ssl_keyfile=key)
            if client_ca:
                kwargs.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        elif client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        config = uvicorn.Config(
            api.app(), lifespan="off", log_config=None, access_log=False, server_header=False, timeout_graceful_shutdown=grace_s,
            timeout_keep_alive=30, **kwargs,
        )
        self.server = Server(config)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start-up lines would name a process, not the API
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))

    def stop(self) -> None:
        """Stop accepting; requests in flight finish (within the grace)."""
        self.server.should_exit = True

    async def wait(self, timeout: float) -> None:
        if self.task is None:
            return
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except TimeoutError:
            self.task.cancel()


def bind(listen: str) -> socket.socket:
    """A listening socket for HOST:PORT or unix:PATH; OSError naming the address when it cannot be had."""
    try:
        if listen.startswith("unix:"):
            path = listen[len("unix:") :]
            if os.path.exists(path):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
        else:
            host, _, port = listen.rpartition(":")
            host = host.strip("[]")
            if not host or not port.isdigit():
                raise ValueError(f"--http-listen {listen!r}: use HOST:PORT or unix:PATH")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
        sock.listen(2048)
        sock.setblocking(False)
        return sock
    except OSError as exc:
        raise OSError(f"--http-listen {listen}: cannot listen: {exc.strerror or exc}") from exc
