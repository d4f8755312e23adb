"""Typed async clients for the two workers, as the gateway sees them.

Tap features stay protobuf ``Tensor`` messages end to end: the gateway forwards the target's
bytes to the draft without decoding or copying them into another representation.

The *wire* is how a sequence's steps (Verify, Propose) travel:
- ``socket``: one connection per sequence to the worker's step socket (``splitspec.transport.stepwire``),
  a plain Unix socket the worker offers in its Info when it shares the gateway's host;
- ``stream``: one long-lived bidirectional gRPC stream per sequence and worker (``VerifyStream``,
  ``ProposeStream``), opened on the sequence's first step and reused, so a step pays one message
  each way instead of a call's set-up, metadata and deadline handling;
- ``unary``: one ``Verify`` / ``Propose`` call per step;
- ``auto`` (default): ``socket`` where the worker offers one this host can open, else ``stream``.
All fail the same way: a step that errors or misses its timeout raises the ``AioRpcError`` the
unary call would (status and message), and its stream or connection is dropped; the next step
opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from services.metrics import RpcObserver
from splitspec.errors import FailedPrecondition
from splitspec.spec.budget_choice import BudgetVote
from splitspec.transport import rpc
from splitspec.transport.security import ClientSecurity
from splitspec.transport.stepwire import StepSocket
from splitspec.transport.tensors import TensorSpliced, array_from_pb
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)
WIRES = ("auto", "socket", "stream", "unary")


@dataclass
class Proposed:
    top_ids: np.ndarray  # [B-1, K] candidates per depth, best first
    top_logprobs: np.ndarray  # [B-1, K] their log-probabilities
    pair_scores: np.ndarray | None = None  # [B-1, K, K] a DFlash2 draft's selector (draft.proto)


@dataclass
class Prefilled:
    next_token: int
    features: common_pb2.Tensor | None
    logprob: common_pb2.TokenLogprob | None = None  # next_token's, when the prefill asked for logprobs


def budget_vote_pb(vote: BudgetVote | None) -> target_pb2.BudgetVote | None:
    if vote is None:
        return None
    guessed = [] if vote.guessed is None else vote.guessed.tolist()
    return target_pb2.BudgetVote(voter=vote.voter, budgets=vote.budgets.tolist(), tokens_per_s=vote.rates.tolist(), sequences=vote.sequences,
                                 guessed=guessed)


@dataclass
class Verified:
    committed_tokens: list[int]  # root + accepted nodes
    next_token: int  # bonus: the next root
    committed_length: int
    features: common_pb2.Tensor | None
    forward_ns: int  # the target's time for the pass, as it reports it
    logprobs: list[common_pb2.TokenLogprob] | None = None  # of committed_tokens[1:] + [next_token], when asked for
    # The target's batched pass this step ran in: rows and sequences over all its sequences (0: not reported).
    pass_rows: int = 0
    pass_sequences: int = 0
    queue_ns: int = 0  # how long the step waited in the target for its pass
    queue_prompt_ns: int = 0  # of queue_ns, the target's time in other sequences' prompts meanwhile
    agreed_budget: int | None = None  # the target's budget over every gateway's votes (None: it agreed none)


class StepStream(rpc.StepConnection):
    """One sequence's steps on one bidirectional gRPC stream (``StepConnection``)."""

    what = "step stream"

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        super().__init__()
        self._open = open_call
        self._call: grpc.aio.StreamStreamCall | None = None

    async def _write(self, request, opening: bool) -> None:
        if opening:
            raise ValueError("a gRPC step stream carries steps only: the opening RPC is its own call")
        if self._call is None or self._call.done():
            self._call = self._open()
        await self._call.write(request)

    async def _read(self):
        return await self._call.read()

    def _answer(self, response, opening: type | None):
        if response is grpc.aio.EOF:  # the worker answers every request or fails the call
            self.close()
            raise rpc.rpc_error(grpc.StatusCode.INTERNAL, "the worker ended the stream without answering")
        return response

    def _connected(self) -> bool:
        return self._call is not None

    def _disconnect(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class WorkerClient:
    """A worker's channel and its step RPC (``step_rpc``: Verify or Propose) on the chosen wire,
    with one ``StepStream`` or ``StepSocket`` per sequence between its first step and its ``release``."""

    stub_class: type
    step_rpc: str
    response_type: type  # of the step RPC

    def __init__(
        self, address: str, security: ClientSecurity = ClientSecurity(), observer: RpcObserver | None = None, wire: str = "auto"
    ) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire: {wire!r} is not one of {WIRES}")
        self.address, self.observer, self.wire = address, observer, wire
        self.token = security.token
        self.step_socket = ""  # the worker's step socket, once offer_step_socket took it
        self.channel = rpc.channel(address, security, [observer] if observer else [])
        self.stub = self.stub_class(self.channel)
        self._unary = getattr(self.stub, self.step_rpc)
        self._open = getattr(self.stub, f"{self.step_rpc}Stream")
        self._rpc = f"{self.stub_class.__name__.removesuffix('Stub')}/{self.step_rpc}"  # the metrics' rpc label
        self._streams: dict[str, StepStream | StepSocket] = {}

    @property
    def active_wire(self) -> str:
        """The wire steps travel on now: socket, stream or unary."""
        return "socket" if self.step_socket else "unary" if self.wire == "unary" else "stream"

    async def offer_step_socket(self, path: str) -> None:
        """Take the step socket the worker's Info offers ("" = none), as the wire allows: ``auto``
        uses it when this host can open it and falls back to the stream otherwise; ``socket``
        insists (FAILED_PRECONDITION)."""
        if self.wire not in ("auto", "socket"):
            return
        problem = "it offers none (a worker on another host, or --step-socket off)"
        if path:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 5.0)
                writer.close()
                self.step_socket = path
                return
            except (OSError, TimeoutError) as exc:
                problem = f"its step socket {path} cannot be opened from here ({exc!r})"
        self.step_socket = ""
        if self.wire == "socket":
            raise FailedPrecondition(f"--wire socket: the worker at {self.address}: {problem}")
        logger.info("worker at %s: steps on the gRPC stream: %s", self.address, problem)

    def _stream(self, sequence_id: str) -> StepStream | StepSocket:
        stream = self._streams.get(sequence_id)
        if stream is None:
            stream = StepSocket(self.step_socket, self.response_type, self.token) if self.step_socket else StepStream(self._open)
            self._streams[sequence_id] = stream
        return stream

    async def _observed(self, rpc_name: str, request, call, connection: rpc.StepConnection):
        return await (self.observer.observe(rpc_name, request, call, connection) if self.observer else call)

    async def _step(self, request, timeout: float | None):
        if self.active_wire == "unary":
            return await self._unary(request, timeout=timeout)
        stream = self._stream(request.sequence_id)
        return await self._observed(self._rpc, request, stream.step(request, timeout), stream)

    async def info(self, timeout: float | None = None):
        return await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout)

    async def release(self, sequence_id: str, context: int = 0, timeout: float = 5.0) -> None:
        """Release the sequence (for the draft, up to its context number ``context``)."""
        stream = self._streams.pop(sequence_id, None)
        if stream is not None:
            stream.close()
        await self.stub.Release(common_pb2.ReleaseRequest(sequence_id=sequence_id, context=context), timeout=timeout)

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        await self.channel.close()


class TargetClient(WorkerClient):
    stub_class = target_pb2_grpc.TargetWorkerStub
    step_rpc = "Verify"
    response_type = target_pb2.VerifyResponse

    async def prefill(self, request: target_pb2.PrefillRequest, timeout: float | None) -> Prefilled:
        """On the step socket when steps take it (the sequence's connection opens with it), else gRPC."""
        if self.active_wire == "socket":
            stream = self._stream(request.sequence_id)
            r = await self._observed("TargetWorker/Prefill", request, stream.step(request, timeout, opening=target_pb2.PrefillResponse), stream)
        else:
            r = await self.stub.Prefill(request, timeout=timeout)
        logprob = r.next_token_logprob if r.HasField("next_token_logprob") else None
        return Prefilled(r.next_token, r.features if r.HasField("features") else None, logprob)

    async def verify(
        self, sequence_id: str, tokens: np.ndarray, parents: np.ndarray, return_features: bool, timeout: float | None,
        vote: BudgetVote | None = None,
    ) -> Verified:
        """One step's tree verified; ``vote``: the gateway's budget vote, sent with it."""
        r = await self._step(
            target_pb2.VerifyRequest(
                sequence_id=sequence_id, tokens=tokens.tolist(), parents=parents.tolist(), return_features=return_features,
                budget_vote=budget_vote_pb(vote),
            ),
            timeout,
        )
        return self._verified(r)

    async def decode(
        self, sequence_id: str, steps: int, timeout: Callable[[], float | None], return_features: bool = False, late_last: bool = False,
        vote: BudgetVote | None = None,
    ) -> AsyncIterator[Verified]:
        """``steps`` target-only decode steps (trees of no node; each with its row's tap features if
        ``return_features``), answered in order; ``late_last``: the last says the sequence's next
        step comes late (``VerifyRequest.next_step_late``: it goes to the draft); ``vote`` goes with the first.
        On the socket and stream wires they are pipelined, ``rpc.PIPELINE_DEPTH`` requests in
        flight: a decode step's request does not depend on the answer before it, so the next one
        waits at the target while this one's pass runs and joins the next pass at once (on unary,
        one call at a time: two calls could overtake each other). ``timeout()`` gives each
        exchange's. Stopping early closes the stream, so an unread answer is never read as a later
        step's (close it with ``contextlib.aclosing``: a generator left to the garbage collector
        closes late; until then the sequence's next step opens a new stream)."""
        request = target_pb2.VerifyRequest(sequence_id=sequence_id, return_features=return_features)
        last = target_pb2.VerifyRequest(sequence_id=sequence_id, return_features=return_features, next_step_late=late_last)
        first = target_pb2.VerifyRequest(sequence_id=sequence_id, return_features=return_features, budget_vote=budget_vote_pb(vote))
        if steps == 1:
            first.next_step_late = late_last

        def nth(i: int) -> target_pb2.VerifyRequest:
            return first if i == 0 else last if i == steps - 1 else request

        if self.active_wire == "unary":
            for i in range(steps):
                yield self._verified(await self._step(nth(i), timeout()))
            return
        stream = self._stream(sequence_id)
        sent = received = 0
        try:
            while received < steps:
                while sent < min(steps, received + rpc.PIPELINE_DEPTH):
                    await stream.send(nth(sent), timeout())
                    sent += 1
                response = await self._observed(self._rpc, request, stream.receive(timeout()), stream)
                received += 1
                yield self._verified(response)
        finally:
            if sent > received:
                stream.close()

    @staticmethod
    def _verified(r: target_pb2.VerifyResponse) -> Verified:
        features = r.features if r.HasField("features") else None
        return Verified(
            list(r.committed_tokens), r.next_token, r.committed_length, features, r.forward_ns, list(r.logprobs) or None,
            r.pass_rows, r.pass_sequences, r.queue_ns, r.queue_prompt_ns, r.agreed_budget if r.HasField("agreed_budget") else None,
        )


class DraftClient(WorkerClient):
    stub_class = draft_pb2_grpc.DraftWorkerStub
    step_rpc = "Propose"
    response_type = draft_pb2.ProposeResponse

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
        context: int = 0,
        depths: int = 0,
    ) -> Proposed:
        """The draft's candidates for the block after the anchor, for depths 1..``depths`` (0: all).
        ``context`` numbers the draft context this step belongs to (``ProposeRequest.context``;
        0 = unnumbered)."""
        request = draft_pb2.ProposeRequest(
            sequence_id=sequence_id, anchor_token=anchor_token, anchor_position=anchor_position, tokens=tokens,
            top_k=top_k, window=window, context=context, depths=depths,
        )
        if features is not None:
            if self.active_wire == "socket":  # relayed by reference: a prompt's are tens of MB
                request = TensorSpliced(request, "features", features)
            else:
                request.features.CopyFrom(features)
        r = await self._step(request, timeout)
        pairs = array_from_pb(r.pair_scores) if r.HasField("pair_scores") else None
        return Proposed(array_from_pb(r.top_ids), array_from_pb(r.top_logprobs), pairs)
