"""The step socket against real target and draft processes: where workers offer it, one sequence
per connection, bad frames answered with the gRPC status and message, the token checked, and how
the gateway's wire choice takes it. Its steps and errors against the gRPC wires' are tested in
tests/services/gateway/test_workers.py; the gateway-level tests (lossless, faults) run on it too,
since ``--wire auto`` picks it for workers on Unix sockets."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.gateway.workers import DraftClient, TargetClient
from services.metrics import GatewayMetrics, RpcObserver
from splitspec.errors import FailedPrecondition
from splitspec.transport import busypoll
from splitspec.transport.security import ClientSecurity
from splitspec.transport.stepwire import (
    ERROR,
    HEADER,
    HELLO,
    JOIN_BYTES,
    OPEN,
    REQUEST,
    RESPONSE,
    StepSocket,
    StepSocketServer,
    frame,
    read_frame,
    resolve_step_socket,
    write_frame,
)
from splitspec.transport.tensors import TensorSpliced
from splitspec.v1 import target_pb2
from tests.worker_steps import PROMPT, TREES, chain, client_on, prefill, run, steps

pytestmark = pytest.mark.slow

TOKEN = "s3cret"
DELAY_S = 0.4


@pytest.fixture(scope="module")
def workers(module_services, tiny_pair, tmp_path_factory):
    s = module_services
    model = str(tiny_pair.target)
    table = tmp_path_factory.mktemp("oracle") / "table.jsonl"
    table.write_text("")
    return {
        "target": s.start("sw-target", "target", "--model", model, "--dtype", "float64", "--threads", "1"),
        "slow": s.start("sw-slow", "oracle-draft", "--table", str(table), "--delay", str(DELAY_S), "--target-model", model),
        "locked": s.start("sw-locked", "target", "--model", model, "--threads", "1", "--auth-token", TOKEN),
        "spinning": s.start("sw-spinning", "target", "--model", model, "--dtype", "float64", "--threads", "1", "--busy-poll", "20000"),
    }


def test_workers_offer_a_socket_next_to_their_unix_address(workers):
    async def scenario():
        for name, cls in (("target", TargetClient), ("slow", DraftClient)):
            client = cls(workers[name])
            offered = (await client.info(timeout=10)).step_socket
            assert offered == workers[name].removeprefix("unix:") + ".steps" and os.path.exists(offered)
            await client.close()

    run(scenario())
    assert resolve_step_socket("auto", "127.0.0.1:50052", tls=False) == ""  # a TCP listener may be remote
    assert resolve_step_socket("auto", "unix:/run/t.sock", tls=True) == ""  # TLS asked for: no plain side door
    assert resolve_step_socket("off", "unix:/run/t.sock", tls=False) == ""
    assert resolve_step_socket("/run/steps", "127.0.0.1:1", tls=False) == "/run/steps"


async def exchange(path: str, *frames: bytes, pause_s: float = 0.0) -> list[tuple[int, bytes]]:
    """Send raw frames on a new connection (``pause_s`` apart); return every frame the worker
    sends back until it closes."""
    reader, writer = await asyncio.open_unix_connection(path)
    for i, raw in enumerate(frames):
        if i and pause_s:
            await asyncio.sleep(pause_s)
        writer.write(raw)
    answers = []
    while (received := await asyncio.wait_for(read_frame(reader), 30)) is not None:
        answers.append(received)
    writer.close()
    return answers


def test_a_connection_serves_one_sequence_and_rejects_bad_frames(workers):
    path = workers["target"].removeprefix("unix:") + ".steps"
    hello = frame(HELLO, b"")

    async def scenario():
        client = TargetClient(workers["target"])
        for sid in ("one", "two"):
            await prefill(client, sid)
        await client.close()
        verify = [frame(REQUEST, target_pb2.VerifyRequest(sequence_id=sid).SerializeToString()) for sid in ("one", "one", "two")]
        mixed = await exchange(path, hello, *verify)
        undecodable = await exchange(path, hello, frame(REQUEST, b"\x0a\x01\xff"))  # sequence_id holding byte 0xff
        no_hello = await exchange(path, verify[0])
        # The worker refuses the hello before the request arrives; the client's write must not
        # find the connection closed, or the ERROR frame in its buffer would be lost with it.
        wrong_then_late = await exchange(path, frame(HELLO, b"guess"), verify[0], pause_s=0.3)
        return mixed, undecodable, no_hello, wrong_then_late

    mixed, undecodable, no_hello, wrong_then_late = run(scenario())
    assert [kind for kind, _ in mixed] == [RESPONSE, RESPONSE, ERROR]
    assert [target_pb2.VerifyResponse.FromString(p).committed_length for _, p in mixed[:2]] == [len(PROMPT) + 1, len(PROMPT) + 2]
    assert mixed[2][1].decode() == "INVALID_ARGUMENT\nsequence_id: 'two' on the stream of sequence 'one' (one stream per sequence)"
    assert undecodable[0][0] == ERROR
    assert undecodable[0][1].decode().startswith("INVALID_ARGUMENT\nrequest is not a valid /splitspec.v1.TargetWorker/Verify message")
    assert no_hello == wrong_then_late == [(ERROR, b"UNAUTHENTICATED\nmissing or wrong bearer token in the step socket's hello")]


def test_verify_answers_with_features_are_the_same_on_the_socket_as_on_grpc(workers):
    """The socket's Verify sends each step's tap features spliced in by reference
    (``TensorSpliced``), gRPC's encodes them into the message: the same answers, bit for bit."""

    async def scenario(wire: str):
        client = await client_on(wire, TargetClient, workers["target"])
        sid = f"features-{wire}"
        request = target_pb2.PrefillRequest(sequence_id=sid, tokens=PROMPT, reserve_tokens=64, tap_layer_ids=[0, 1])
        try:
            await client.prefill(request, timeout=30)
            return [await client.verify(sid, tokens, parents, True, timeout=30) for tokens, parents in TREES]
        finally:
            await client.release(sid)
            await client.close()

    on_socket, on_grpc = run(scenario("socket")), run(scenario("unary"))
    assert all(v.features is not None and v.features.shape == [len(v.committed_tokens), 2 * 64] for v in on_socket)
    assert [(v.committed_tokens, v.next_token, v.features) for v in on_socket] == [(v.committed_tokens, v.next_token, v.features) for v in on_grpc]


def test_a_busy_polling_worker_and_client_take_the_same_steps(workers, module_services):
    """The worker's loop and the client's both spin (``--busy-poll``): the same answers, on the socket."""
    async def scenario(name: str):
        busypoll.configure("20000", gpu=False, service="test client")
        client = await client_on("socket", TargetClient, workers[name])
        try:
            await prefill(client, "spin")
            return await steps(client, "spin", TREES)
        finally:
            await client.release("spin")
            await client.close()

    assert busypoll.run(scenario("spinning")) == run(scenario("target"))
    assert "target: busy polling for up to 20000 µs" in module_services.log("sw-spinning")
    assert "busy polling" not in module_services.log("sw-target")  # auto: a CPU worker does not spin


def test_a_connection_opens_with_the_targets_prefill(workers):
    """OPEN frames carry the target's Prefill (with a prompt's tap features) on the step socket;
    the gateway's client takes it there when its steps do, and errors keep gRPC's status."""
    path = workers["target"].removeprefix("unix:") + ".steps"
    request = target_pb2.PrefillRequest(sequence_id="opened", tokens=PROMPT, reserve_tokens=64, tap_layer_ids=[0, 1])
    bad = target_pb2.PrefillRequest(sequence_id="bad", tokens=PROMPT, feature_dtype="int8")

    async def scenario():
        grpc_client = TargetClient(workers["target"], wire="unary")
        by_grpc = await grpc_client.stub.Prefill(target_pb2.PrefillRequest(**{**_fields(request), "sequence_id": "by-grpc"}), timeout=30)
        await grpc_client.close()
        raw = await exchange(
            path, frame(HELLO, b""), frame(OPEN, request.SerializeToString()),
            frame(REQUEST, target_pb2.VerifyRequest(sequence_id="opened").SerializeToString()),
            frame(REQUEST, target_pb2.VerifyRequest(sequence_id="other").SerializeToString()),  # ends the connection
        )
        draft_refuses = await exchange(workers["slow"].removeprefix("unix:") + ".steps", frame(HELLO, b""), frame(OPEN, request.SerializeToString()))
        client = await client_on("socket", TargetClient, workers["target"])
        try:
            prefilled = await client.prefill(target_pb2.PrefillRequest(**{**_fields(request), "sequence_id": "client"}), timeout=30)
            assert isinstance(client._streams["client"], StepSocket)  # the sequence's connection, opened by Prefill
            after = await steps(client, "client", TREES[:1])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.prefill(bad, timeout=30)
        finally:
            await client.close()
        return by_grpc, raw, draft_refuses, prefilled, after, refused.value

    by_grpc, raw, draft_refuses, prefilled, after, refused = run(scenario())
    assert [kind for kind, _ in raw] == [RESPONSE, RESPONSE, ERROR]
    opened = target_pb2.PrefillResponse.FromString(raw[0][1])
    assert opened.next_token == by_grpc.next_token and opened.features == by_grpc.features and opened.features.shape == [len(PROMPT), 2 * 64]
    assert target_pb2.VerifyResponse.FromString(raw[1][1]).committed_length == len(PROMPT) + 1
    assert (prefilled.next_token, prefilled.features) == (by_grpc.next_token, by_grpc.features)
    assert after[0][0] == [by_grpc.next_token]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_dtype: 'int8'" in refused.details()
    assert draft_refuses == [(ERROR, b"INVALID_ARGUMENT\nstep socket: frame kind 4 where a request was expected")]


def _fields(message) -> dict:
    return {field.name: value for field, value in message.ListFields()}


def test_the_workers_token_is_checked(workers):
    async def scenario():
        right = await client_on("socket", TargetClient, workers["locked"], ClientSecurity(token=TOKEN))
        wrong = TargetClient(workers["locked"], ClientSecurity(token="guess"), wire="socket")
        await wrong.offer_step_socket(right.step_socket)
        try:
            await prefill(right, "locked")
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await wrong.verify("locked", *chain(1), False, timeout=30)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(await steps(right, "locked", TREES)) == len(TREES)
            await right.release("locked")
        finally:
            await right.close()
            await wrong.close()

    run(scenario())


def test_the_wire_choice(workers, tmp_path):
    async def scenario():
        insisting, auto = TargetClient(workers["target"], wire="socket"), TargetClient(workers["target"], wire="auto")
        unary = TargetClient(workers["target"], wire="unary")
        missing = str(tmp_path / "no.steps")
        with pytest.raises(FailedPrecondition, match="cannot be opened from here"):
            await insisting.offer_step_socket(missing)
        with pytest.raises(FailedPrecondition, match="offers none"):
            await insisting.offer_step_socket("")
        await auto.offer_step_socket(missing)
        await unary.offer_step_socket(workers["target"].removeprefix("unix:") + ".steps")
        assert (auto.active_wire, unary.active_wire) == ("stream", "unary")
        for client in (insisting, auto, unary):
            await client.close()

    run(scenario())


def test_a_connection_that_never_authenticates_is_closed(tmp_path, monkeypatch):
    """A client that connects and sends no hello holds no connection for long."""
    from splitspec.transport import stepwire

    monkeypatch.setattr(stepwire, "HELLO_TIMEOUT_S", 0.3)

    async def scenario():
        server = StepSocketServer(str(tmp_path / "t.steps"), "target", "Verify", target_pb2.VerifyRequest, None, token="s3cret")
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(server.path)
            answer = await asyncio.wait_for(read_frame(reader), 5)
            closed = await asyncio.wait_for(read_frame(reader), 5)
            writer.close()
            return answer, closed
        finally:
            await server.close()

    answer, closed = run(scenario())
    assert answer == (ERROR, b"UNAUTHENTICATED\nno hello within 0.3 s of connecting to the step socket") and closed is None


def test_the_gateways_metrics_count_an_answers_bytes_from_its_frame(tmp_path):
    """On the step socket the gateway's ``RpcObserver`` takes an answer's size from its frame, not
    from ``ByteSize()`` (which serializes the message again): the same count, for answers with
    tap features spliced in by reference and without."""
    features = torch.arange(3 * 64, dtype=torch.float32).view(3, 64).to(torch.bfloat16)

    async def verify(request, context):
        answer = target_pb2.VerifyResponse(committed_tokens=[7] * len(request.tokens), next_token=5, forward_ns=123_456_789)
        return TensorSpliced(answer, "features", features) if request.return_features else answer

    async def scenario():
        server = StepSocketServer(str(tmp_path / "m.steps"), "target", "Verify", target_pb2.VerifyRequest, verify)
        await server.start()
        metrics, sizes = GatewayMetrics(CollectorRegistry()), []
        connection = StepSocket(server.path, target_pb2.VerifyResponse)
        try:
            for tokens, return_features in (([1, 2], True), ([3], False), ([4, 5, 6], True)):
                request = target_pb2.VerifyRequest(sequence_id="m", tokens=tokens, return_features=return_features)
                answer = await RpcObserver(metrics).observe("TargetWorker/Verify", request, connection.step(request, 5), connection)
                sizes.append(answer.ByteSize())
        finally:
            connection.close()
            await server.close()
        return metrics.registry.get_sample_value("splitspec_rpc_response_bytes_sum", {"model": "", "rpc": "TargetWorker/Verify"}), sizes

    counted, sizes = run(scenario())
    assert sizes[1] < 30 < sizes[0] and counted == sum(sizes)


def test_a_socket_that_cannot_be_bound(tmp_path):
    """``auto`` chose the path: the worker goes on with gRPC only. A path given explicitly: an error naming it."""
    async def start(required: bool) -> str:
        server = StepSocketServer(str(tmp_path / "missing" / "t.steps"), "target", "Verify", target_pb2.VerifyRequest, None, required=required)
        await server.start()
        return server.offered

    assert run(start(required=False)) == ""
    with pytest.raises(OSError, match="--step-socket .*missing/t.steps"):
        run(start(required=True))


def test_a_worker_refuses_to_start_without_its_explicit_socket(tiny_pair, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "splitspec", "target", "--model", str(tiny_pair.target), "--listen", f"unix:{tmp_path / 't.sock'}",
         "--metrics-port", "0", "--step-socket", str(tmp_path / "missing" / "t.steps")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "--step-socket" in done.stderr and "missing/t.steps" in done.stderr


def test_a_frames_short_parts_go_in_one_write_and_a_long_part_as_it_is(tmp_path):
    """write_frame joins the header and runs of short parts into one write (one send, one wake-up
    of the reader), and writes a part of JOIN_BYTES or more as it is, not copied (a prompt's
    features); the reader gets the same frames either way."""

    long = memoryview(bytes(range(256)) * (JOIN_BYTES // 256 + 1))

    async def main():
        received = []

        async def handle(reader, writer):
            received.extend([await read_frame(reader), await read_frame(reader)])
            writer.close()

        path = str(tmp_path / "frames.sock")
        server = await asyncio.start_unix_server(handle, path=path)
        _, writer = await asyncio.open_unix_connection(path)
        writes, write = [], writer.write
        writer.write = lambda data: (writes.append(data), write(data))[-1]  # a spy: the real write runs
        write_frame(writer, REQUEST, b"ab", b"cd")
        write_frame(writer, RESPONSE, b"head", long, b"tail")
        await writer.drain()
        while len(received) < 2:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        return writes, received

    writes, received = asyncio.run(main())
    assert len(writes) == 4 and writes[0] == frame(REQUEST, b"abcd")
    assert writes[1] == HEADER.pack(4 + long.nbytes + 4, RESPONSE) + b"head"
    assert writes[2] is long and writes[3] == b"tail"
    assert [(kind, bytes(payload)) for kind, payload in received] == [(REQUEST, b"abcd"), (RESPONSE, b"head" + bytes(long) + b"tail")]
