"""Small synchronous clients for tests: one Generate call collected, and the workers' live state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from splitspec.transport.rpc import CHANNEL_OPTIONS
from splitspec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2_grpc


@dataclass
class Completion:
    text: str
    tokens: list[int]
    final: gateway_pb2.Final


def generate(address: str, timeout: float = 60.0, wait: bool = False, metadata=(), channel=None, **fields) -> Completion:
    """``wait`` blocks until the gateway accepts connections (for a server still starting)."""
    own = channel is None
    ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if own else channel
    try:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        text, tokens, final = [], [], None
        request = gateway_pb2.GenerateRequest(**fields)
        for r in stub.Generate(request, timeout=timeout, wait_for_ready=wait, metadata=metadata):
            text.append(r.text)
            tokens.extend(r.token_ids)
            if r.HasField("final"):
                final = r.final
    finally:
        if own:
            ch.close()
    return Completion("".join(text), tokens, final)


def generate_all(address: str, cases: list[dict], concurrency: int = 8, timeout: float = 300.0, **fields) -> list[Completion]:
    """``generate(address, **case, **fields)`` of every case, ``concurrency`` at a time, in the
    cases' order: the workers batch them (each output must equal its single-stream one,
    tests/test_batching.py), so a test of many requests takes a fraction of its serial time on the
    2-core CPU."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda case: generate(address, timeout=timeout, **case, **fields), cases))


@dataclass
class WorkerState:
    target_sequences: int
    kv_reserved_tokens: int
    draft_sequences: int
    draft_context_bytes: int

    @property
    def empty(self) -> bool:
        return not (self.target_sequences or self.kv_reserved_tokens or self.draft_sequences or self.draft_context_bytes)


def worker_state(target: str, draft: str | None = None) -> WorkerState:
    with grpc.insecure_channel(target) as ch:
        t = target_pb2_grpc.TargetWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=10)
    d = None
    if draft is not None:
        with grpc.insecure_channel(draft) as ch:
            d = draft_pb2_grpc.DraftWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=10)
    return WorkerState(t.live_sequences, t.kv_reserved_tokens, d.live_sequences if d else 0, d.context_bytes if d else 0)


def live_sequences(target: str, draft: str | None = None) -> tuple[int, int]:
    state = worker_state(target, draft)
    return state.target_sequences, state.draft_sequences
