"""What the first Propose of a DFlash request costs on the wire: a prompt's tap features (512 rows
of five 4096-wide taps in bf16 for the Qwen3-8B shape, 21 MB) taken off the device, encoded,
sent over a gRPC unary call or a step socket (both on Unix sockets), decoded and put back on a device;
and on the step socket the ways the target answers and the gateway relays them: encoded into the
message, or spliced in by reference (``TensorSpliced``), the gateway's metrics of the answer; and the
draft's receive of them, parsed into the message and copied out, or read in place (``TensorFieldReader``).

Usage: python scripts/prompt_features_wire.py [--device cuda:0] [--rows 512] [--width 20480]
(medians of 5; the allocator tuning of the services applies, as in them)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import grpc
import torch

from services.metrics import GatewayMetrics, RpcObserver
from splitspec.transport.allocator import keep_message_buffers
from splitspec.transport.received import TensorFieldReader
from splitspec.transport.stepwire import Opener, StepSocket, StepSocketServer
from splitspec.transport.tensors import TensorSpliced, tensor_from_pb, tensor_to_pb, wire_parts
from splitspec.v1 import draft_pb2, target_pb2, target_pb2_grpc

READER = TensorFieldReader(draft_pb2.ProposeRequest, "features")


def timed(call, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


async def grpc_round_trip_ms(response: target_pb2.PrefillResponse, reps: int = 5) -> float:
    class Target(target_pb2_grpc.TargetWorkerServicer):
        async def Prefill(self, request, context):
            return response

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    path = tempfile.mktemp(suffix=".sock")
    server = grpc.aio.server(options=options)
    target_pb2_grpc.add_TargetWorkerServicer_to_server(Target(), server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    times = []
    async with grpc.aio.insecure_channel(f"unix:{path}", options=options) as channel:
        stub = target_pb2_grpc.TargetWorkerStub(channel)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await stub.Prefill(target_pb2.PrefillRequest(sequence_id="s"))
            times.append(time.perf_counter() - t0)
    await server.stop(None)
    return 1e3 * statistics.median(times[1:])


async def socket_round_trip_ms(answer, reps: int = 5, sized: str = "") -> float:
    """The same exchange as an OPEN frame on a step socket (how the gateway now sends Prefill),
    the worker's answer made by ``answer()`` at each call; ``sized``: observed by the gateway's
    metrics, the answer's size from ``ByteSize()`` ("message") or from its frame ("frame")."""

    async def prefill(request, context):
        return answer()

    path = tempfile.mktemp(suffix=".steps")
    server = StepSocketServer(path, "probe", "Verify", target_pb2.VerifyRequest, None, opener=Opener("Prefill", target_pb2.PrefillRequest, prefill))
    await server.start()
    sock = StepSocket(path, target_pb2.VerifyResponse)
    times = []
    observer = RpcObserver(GatewayMetrics()) if sized else None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        request = target_pb2.PrefillRequest(sequence_id="s")
        call = sock.step(request, 60, opening=target_pb2.PrefillResponse)
        await (observer.observe("TargetWorker/Prefill", request, call, sock if sized == "frame" else None) if observer else call)
        times.append(time.perf_counter() - t0)
    sock.close()
    await server.close()
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--width", type=int, default=20480)
    args = p.parse_args()
    keep_message_buffers()
    dev = torch.device(args.device)
    features = torch.randn(args.rows, args.width, device=dev).to(torch.bfloat16)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    host = features.cpu()
    message = tensor_to_pb(host)
    response = target_pb2.PrefillResponse(next_token=1, features=message)
    data = response.SerializeToString()
    parsed = target_pb2.PrefillResponse.FromString(data)
    decoded = tensor_from_pb(parsed.features)
    propose = {"sequence_id": "s", "anchor_token": 1, "anchor_position": args.rows, "top_k": 8}
    relayed = TensorSpliced(draft_pb2.ProposeRequest(**propose), "features", parsed.features).SerializeToString()
    spliced = lambda: bytearray(relayed)  # noqa: E731 - a frame as the step socket receives it (the copy timed as well)
    rows = {
        "device to host": timed(lambda: (features.cpu(), sync())),
        "tensor_to_pb": timed(lambda: tensor_to_pb(host)),
        "serialize": timed(response.SerializeToString),
        "parse": timed(lambda: target_pb2.PrefillResponse.FromString(data)),
        # The gateway's relay of the parsed features to the draft: a Propose built and serialized,
        # or the features spliced in by reference (the step socket's way).
        "gateway's Propose, built and serialized": timed(lambda: draft_pb2.ProposeRequest(features=parsed.features, **propose).SerializeToString()),
        "gateway's Propose, features spliced": timed(lambda: wire_parts(TensorSpliced(draft_pb2.ProposeRequest(**propose), "features", parsed.features))),
        "tensor_from_pb": timed(lambda: tensor_from_pb(parsed.features)),
        # The draft's receive of the relayed Propose, from the frame's bytes to the features' tensor:
        # parsed whole then copied out (the gRPC way), or the features read in place (the socket's).
        "draft's Propose, parsed, tensor_from_pb": timed(lambda: tensor_from_pb(draft_pb2.ProposeRequest.FromString(spliced()).features)),
        "draft's Propose, features read in place": timed(lambda: READER.FromString(spliced()).tensor.to_torch()),
        "host to device": timed(lambda: (decoded.to(dev), sync())),
        "gRPC unary round trip (Unix socket)": asyncio.run(grpc_round_trip_ms(response)),
        "step socket round trip (OPEN frame)": asyncio.run(socket_round_trip_ms(lambda: response)),
        # What the target's Prefill costs from its result to the gateway's parsed message: encoded
        # into the message (the gRPC way), or its features spliced in by reference (the socket's).
        "  the same, encoded at each call": asyncio.run(
            socket_round_trip_ms(lambda: target_pb2.PrefillResponse(next_token=1, features=tensor_to_pb(host)))
        ),
        "  the same, features spliced": asyncio.run(
            socket_round_trip_ms(lambda: TensorSpliced(target_pb2.PrefillResponse(next_token=1), "features", host))
        ),
        # The gateway's metrics of that exchange (RpcObserver): the answer's size by ByteSize(),
        # which serializes the parsed message again, or from the frame (the step socket's count).
        "  the same, observed, size by ByteSize()": asyncio.run(
            socket_round_trip_ms(lambda: TensorSpliced(target_pb2.PrefillResponse(next_token=1), "features", host), sized="message")
        ),
        "  the same, observed, size from the frame": asyncio.run(
            socket_round_trip_ms(lambda: TensorSpliced(target_pb2.PrefillResponse(next_token=1), "features", host), sized="frame")
        ),
    }
    print(f"{args.rows} x {args.width} bf16 = {len(data) / 1e6:.1f} MB on {dev}:")
    for name, ms in rows.items():
        print(f"  {name:44s} {ms:7.1f} ms")


if __name__ == "__main__":
    main()
