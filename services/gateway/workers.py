"""Typed async clients for the two workers, as the gateway sees them.

Tap features stay protobuf ``Tensor`` messages end to end: the gateway forwards the target's
bytes to the draft without decoding or copying them into another representation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from splitspec import rpc
from splitspec.security import ClientSecurity
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from splitspec.wire import array_from_pb


@dataclass
class Prefilled:
    next_token: int
    features: common_pb2.Tensor | None


@dataclass
class Verified:
    committed_tokens: list[int]  # root + accepted nodes
    next_token: int  # bonus: the next root
    committed_length: int
    features: common_pb2.Tensor | None


class TargetClient:
    def __init__(
        self, address: str, security: ClientSecurity = ClientSecurity(), interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
    ) -> None:
        self.address = address
        self.channel = rpc.channel(address, security, interceptors)
        self.stub = target_pb2_grpc.TargetWorkerStub(self.channel)

    async def info(self, timeout: float | None = None) -> target_pb2.TargetInfo:
        return await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout)

    async def prefill(self, request: target_pb2.PrefillRequest, timeout: float | None) -> Prefilled:
        r = await self.stub.Prefill(request, timeout=timeout)
        return Prefilled(r.next_token, r.features if r.HasField("features") else None)

    async def verify(
        self, sequence_id: str, tokens: np.ndarray, parents: np.ndarray, return_features: bool, timeout: float | None
    ) -> Verified:
        r = await self.stub.Verify(
            target_pb2.VerifyRequest(
                sequence_id=sequence_id, tokens=tokens.tolist(), parents=parents.tolist(), return_features=return_features
            ),
            timeout=timeout,
        )
        return Verified(list(r.committed_tokens), r.next_token, r.committed_length, r.features if r.HasField("features") else None)

    async def release(self, sequence_id: str, timeout: float = 5.0) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(sequence_id=sequence_id), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class DraftClient:
    def __init__(
        self, address: str, security: ClientSecurity = ClientSecurity(), interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
    ) -> None:
        self.address = address
        self.channel = rpc.channel(address, security, interceptors)
        self.stub = draft_pb2_grpc.DraftWorkerStub(self.channel)

    async def info(self, timeout: float | None = None) -> draft_pb2.DraftInfo:
        return await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout)

    async def propose(
        self,
        sequence_id: str,
        anchor_token: int,
        anchor_position: int,
        tokens: list[int],
        features: common_pb2.Tensor | None,
        top_k: int,
        window: int,
        timeout: float | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Returns top_ids [B-1, K] and top_logprobs [B-1, K]."""
        r = await self.stub.Propose(
            draft_pb2.ProposeRequest(
                sequence_id=sequence_id,
                anchor_token=anchor_token,
                anchor_position=anchor_position,
                tokens=tokens,
                features=features,
                top_k=top_k,
                window=window,
            ),
            timeout=timeout,
        )
        return array_from_pb(r.top_ids), array_from_pb(r.top_logprobs)

    async def release(self, sequence_id: str, timeout: float = 5.0) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(sequence_id=sequence_id), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()
