"""gRPC servicer for the draft worker: thin conversion between protobuf and ``DraftEngine``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from splitspec.errors import InvalidArgument
from splitspec.metrics import WorkerMetrics
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from splitspec.wire import WireError, tensor_from_pb, tensor_to_pb
from splitspec.services.draft.engine import DraftEngine
from splitspec.services.draft.replay import ReplayDrafter

SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    def __init__(
        self, engine: DraftEngine | ReplayDrafter, target_geometry: common_pb2.ModelGeometry, path: str, metrics: WorkerMetrics
    ) -> None:
        self.engine = engine
        self.target_geometry = target_geometry
        self.path = path
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")

    async def _run(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))

    async def Info(self, request, context):
        e = self.engine
        return draft_pb2.DraftInfo(
            target_geometry=self.target_geometry,
            block_size=e.block_size,
            mask_token_id=e.mask_token_id,
            target_layer_ids=list(e.target_layer_ids),
            num_layers=e.num_layers,
            path=self.path,
            live_sequences=len(self.engine.sequences),
            max_top_k=self.engine.max_top_k,
        )

    async def Propose(self, request, context):
        features = None
        if request.HasField("features") and request.features.shape:
            try:
                features = tensor_from_pb(request.features)
            except WireError as exc:
                raise InvalidArgument(f"features: {exc}") from exc
        proposal = await self._run(
            self.engine.propose,
            request.sequence_id,
            request.anchor_token,
            request.anchor_position,
            features,
            request.top_k,
            request.window,
            list(request.tokens),
        )
        self.metrics.forward("propose", proposal.forward_ns)
        return draft_pb2.ProposeResponse(
            top_ids=tensor_to_pb(proposal.top_ids),
            top_logprobs=tensor_to_pb(proposal.top_logprobs),
            forward_ns=proposal.forward_ns,
        )

    async def Release(self, request, context):
        released = await self._run(self.engine.release, request.sequence_id)
        return common_pb2.ReleaseResponse(released=released)
