"""gRPC servicer for the draft worker: thin conversion between protobuf and ``DraftEngine``."""

from __future__ import annotations

import asyncio
import contextlib

from services.draft.engine import ProposeStep, pinned
from services.metrics import WorkerMetrics
from services.worker.batching import StepBatcher
from services.worker.hosting import EngineHost
from splitspec.errors import InvalidArgument
from splitspec.transport.received import Received
from splitspec.transport.rpc import sequence_stream
from splitspec.transport.tensors import TensorFormatError, tensor_from_pb, tensor_to_pb
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    """Serves before the model is loaded: every RPC answers UNAVAILABLE until the engine is attached.

    The attached description is the geometry of the target the draft was built for, and a path.
    """

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.host = EngineHost("draft")
        self.step_server = None  # the worker's StepSocketServer (splitspec/stepwire.py), set by main
        self.metrics = metrics
        # Propose steps of every sequence that is ready run as one block pass (DraftEngine.propose_batch).
        self.proposer = StepBatcher(self.host, lambda engine, steps: engine.propose_batch(steps), key=lambda step: step.sequence_id)
        self.proposer.on_pass = lambda results, waits, ahead: metrics.batched("propose", results, waits, ahead)

    async def Info(self, request, context):
        e = self.host.require()
        target_geometry, path = self.host.description
        return draft_pb2.DraftInfo(
            target_geometry=target_geometry,
            block_size=e.block_size,
            mask_token_id=e.mask_token_id,
            target_layer_ids=list(e.target_layer_ids),
            num_layers=e.num_layers,
            path=path,
            live_sequences=len(e.sequences),
            max_top_k=e.max_top_k,
            context_bytes=e.context_bytes,
            step_socket=self.step_server.offered if self.step_server else "",
            selector_top_k=e.selector_top_k,
        )

    async def Propose(self, request, context):
        features = None
        if request.HasField("features") and request.features.shape:
            try:
                features = tensor_from_pb(request.features)
            except TensorFormatError as exc:
                raise InvalidArgument(f"features: {exc}") from exc
        return await self._propose(request, features)

    async def propose_on_socket(self, received: Received, context):
        """Propose on the step socket: the features are read where the frame was received
        (``TensorFieldReader``), not parsed into the message and copied out."""
        view = received.tensor
        return await self._propose(received.message, view.to_torch() if view is not None and view.shape else None)

    async def _propose(self, request, features):
        if features is not None and self.host.require().pins(features):  # a prompt's rows: copied here, off the engine thread
            features = await asyncio.to_thread(pinned, features)
        step = ProposeStep(
            request.sequence_id, request.anchor_token, request.anchor_position, features, request.top_k, request.window,
            list(request.tokens), request.context, request.depths,
        )
        proposal = await self.proposer.submit(step)
        self.metrics.forward("propose", proposal.forward_ns)
        return draft_pb2.ProposeResponse(
            top_ids=tensor_to_pb(proposal.top_ids),
            top_logprobs=tensor_to_pb(proposal.top_logprobs),
            forward_ns=proposal.forward_ns,
            pass_sequences=proposal.pass_sequences,
            pair_scores=None if proposal.pair_scores is None else tensor_to_pb(proposal.pair_scores),
        )

    async def ProposeStream(self, requests, context):
        async with contextlib.aclosing(sequence_stream(requests, context, self.Propose)) as answers:
            async for response in answers:
                yield response

    async def Release(self, request, context):
        released = self.host.release(request.sequence_id, request.context)
        return common_pb2.ReleaseResponse(released=released)
