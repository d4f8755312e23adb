"""Helpers of the tests that drive the workers' step RPCs through the gateway's clients."""

from __future__ import annotations

import asyncio

import numpy as np

from services.gateway.workers import TargetClient
from splitspec.transport.security import ClientSecurity
from splitspec.v1 import target_pb2

PROMPT = [11, 22, 33, 44, 55]


def chain(*tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A chain tree: node i's parent is node i-1 (the root for the first)."""
    return np.array(tokens, dtype=np.int32), np.arange(len(tokens), dtype=np.int32)


TREES = [chain(3, 4, 5), chain(7), chain(), chain(1, 2)]
BAD_TREE = (np.array([3, 4], dtype=np.int32), np.array([0, 5], dtype=np.int32))  # node 2's parent does not exist


def run(coroutine):
    return asyncio.run(coroutine)


async def client_on(wire: str, cls, address: str, security: ClientSecurity | None = None):
    """A worker client on ``wire``, with the worker's step socket taken as the gateway takes it."""
    client = cls(address, security or ClientSecurity(), wire=wire)
    await client.offer_step_socket((await client.info(timeout=10)).step_socket)
    assert client.active_wire == wire
    return client


async def prefill(client: TargetClient, sequence_id: str):
    request = target_pb2.PrefillRequest(sequence_id=sequence_id, tokens=PROMPT, reserve_tokens=128)
    return await client.prefill(request, timeout=30)


async def steps(client: TargetClient, sequence_id: str, trees) -> list[tuple[list[int], int]]:
    """Verify each (tokens, parents) tree in turn; the committed tokens and next token of each."""
    out = []
    for tokens, parents in trees:
        v = await client.verify(sequence_id, tokens, parents, False, timeout=30)
        out.append((v.committed_tokens, v.next_token))
    return out
