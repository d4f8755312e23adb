"""A small synchronous client for tests: one Generate call, collected."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from splitspec.rpc import CHANNEL_OPTIONS
from splitspec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2_grpc


@dataclass
class Completion:
    text: str
    tokens: list[int]
    final: gateway_pb2.Final


def generate(address: str, timeout: float = 60.0, wait: bool = False, **fields) -> Completion:
    """``wait`` blocks until the gateway accepts connections (for a server still starting)."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        text, tokens, final = [], [], None
        for r in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout, wait_for_ready=wait):
            text.append(r.text)
            tokens.extend(r.token_ids)
            if r.HasField("final"):
                final = r.final
    return Completion("".join(text), tokens, final)


def live_sequences(target: str, draft: str | None = None) -> tuple[int, int]:
    with grpc.insecure_channel(target) as ch:
        t = target_pb2_grpc.TargetWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=10).live_sequences
    if draft is None:
        return t, 0
    with grpc.insecure_channel(draft) as ch:
        d = draft_pb2_grpc.DraftWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=10).live_sequences
    return t, d
