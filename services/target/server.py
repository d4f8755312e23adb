"""gRPC servicer for the target worker: thin conversion between protobuf and ``TargetEngine``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import numpy as np

from services.metrics import WorkerMetrics
from services.target.engine import KVBlocksBusy, PrefillResult, TargetEngine, VerifyResult, VerifyStep
from services.worker.batching import StepBatcher
from services.worker.hosting import EngineHost
from splitspec.errors import InvalidArgument
from splitspec.models.devices import DTYPES
from splitspec.spec.budget_choice import BudgetBoard, BudgetVote
from splitspec.spec.sampling import SamplingParams
from splitspec.transport.rpc import sequence_stream
from splitspec.transport.tensors import TensorSpliced, tensor_to_pb
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name
FEATURE_DTYPES = ("", "float32", "float16", "bfloat16")


def sampling_from_pb(msg: common_pb2.Sampling) -> SamplingParams:
    if not msg.temperature >= 0.0:  # also rejects NaN
        raise InvalidArgument(f"sampling.temperature: {msg.temperature} must be >= 0")
    top_p = msg.top_p if msg.top_p else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p: {msg.top_p} must be in (0, 1]")
    if msg.top_k < 0:
        raise InvalidArgument(f"sampling.top_k: {msg.top_k} must be >= 0")
    return SamplingParams(temperature=msg.temperature, top_p=top_p, top_k=msg.top_k, seed=msg.seed)


def token_logprob_pb(logprob) -> common_pb2.TokenLogprob:
    """The engine's ``(id, logprob, [(id, logprob), ...])`` as a ``TokenLogprob``."""
    token, value, top = logprob
    return common_pb2.TokenLogprob(id=token, logprob=value, top=[common_pb2.TopLogprob(id=i, logprob=v) for i, v in top])


def budget_vote_from_pb(msg: target_pb2.BudgetVote) -> BudgetVote:
    guessed = np.array(msg.guessed, dtype=bool) if len(msg.guessed) else None
    return BudgetVote(msg.voter, np.array(msg.budgets, dtype=np.int64), np.array(msg.tokens_per_s, dtype=np.float64), msg.sequences, guessed)


@dataclass
class TargetDescription:
    """Static facts the Info RPC reports."""

    geometry: common_pb2.ModelGeometry
    eos_token_ids: list[int]
    tokenizer_path: str


class TargetServicer(target_pb2_grpc.TargetWorkerServicer):
    """Serves before the model is loaded: every RPC answers UNAVAILABLE until the engine is attached."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.host = EngineHost("target")
        self.step_server = None  # the worker's StepSocketServer (splitspec/stepwire.py), set by main
        self.metrics = metrics
        # Verify steps of every sequence that is ready run as one pass (TargetEngine.verify_batch), in
        # stages: the next pass is prepared while one is on the device.
        self.verifier = StepBatcher(
            self.host, lambda engine, steps: engine.verify_batch(steps), key=lambda step: step.sequence_id,
            late=lambda step: step.next_step_late, staged=True, straight_back=lambda step: not step.tokens,
        )
        self.verifier.on_pass = lambda results, waits, ahead: metrics.batched("verify", results, waits, ahead)
        self.budget_board = BudgetBoard()  # one adaptive budget over every gateway's votes

    async def Info(self, request, context):
        engine: TargetEngine = self.host.require()
        d: TargetDescription = self.host.description
        return target_pb2.TargetInfo(
            geometry=d.geometry,
            eos_token_ids=d.eos_token_ids,
            max_tree_nodes=engine.limits.max_tree_nodes,
            live_sequences=len(engine.sequences),
            tokenizer_path=d.tokenizer_path,
            kv_reserved_tokens=engine.reserved_tokens,
            kv_capacity_tokens=engine.capacity_tokens,
            step_socket=self.step_server.offered if self.step_server else "",
            kv_block_size=engine.kv.block_size,
            kv_blocks_used=engine.kv.usable_blocks - engine.kv.free_blocks,
            kv_blocks_total=engine.kv.usable_blocks,
        )

    async def Prefill(self, request, context):
        return self._prefill_response(await self._prefill(request), spliced=False)

    async def prefill_on_socket(self, request, context):
        """Prefill on the step socket: the features go out by reference (``TensorSpliced``), not copied."""
        return self._prefill_response(await self._prefill(request), spliced=True)

    @staticmethod
    def _prefill_response(result: PrefillResult, spliced: bool):
        logprob = token_logprob_pb(result.logprob) if result.logprob is not None else None
        response = target_pb2.PrefillResponse(next_token=result.next_token, forward_ns=result.forward_ns, next_token_logprob=logprob)
        return _with_features(response, result.features, spliced)

    async def _prefill(self, request: target_pb2.PrefillRequest) -> PrefillResult:
        if request.feature_dtype not in FEATURE_DTYPES:
            raise InvalidArgument(f"feature_dtype: {request.feature_dtype!r} is not one of {FEATURE_DTYPES[1:]}")
        sampling = sampling_from_pb(request.sampling)
        feature_dtype = DTYPES[request.feature_dtype] if request.feature_dtype else None
        # host.open: a prefill whose caller goes away (cancelled, past its deadline, its step socket
        # closed) releases the sequence it made, and a Release that overtook it refuses it.
        def prefill(engine: TargetEngine):
            return engine.prefill(
                request.sequence_id, list(request.tokens), sampling, taps=list(request.tap_layer_ids),
                reserve_tokens=request.reserve_tokens, feature_rows=request.feature_rows, feature_dtype=feature_dtype,
                top_logprobs=request.top_logprobs if request.logprobs else None,
            )

        wait_s = 0.005
        while True:
            try:
                result = await self.host.open(request.sequence_id, prefill)
                break
            except KVBlocksBusy as exc:
                # Queued, not refused: blocks come back as other sequences end (or are preempted).
                # The caller's deadline or cancellation ends the wait.
                if wait_s == 0.005:
                    logger.info("prefill of %s waits for KV blocks: %s", request.sequence_id, exc)
                await asyncio.sleep(wait_s)
                wait_s = min(0.05, 2 * wait_s)
        self.metrics.forward("prefill", result.forward_ns)
        return result

    async def Verify(self, request, context):
        return self._verify_response(await self._verify(request), spliced=False)

    async def verify_on_socket(self, request, context):
        """Verify on the step socket: the features go out by reference (``TensorSpliced``), not copied."""
        return self._verify_response(await self._verify(request), spliced=True)

    async def _verify(self, request: target_pb2.VerifyRequest) -> VerifyResult:
        step = VerifyStep(request.sequence_id, list(request.tokens), list(request.parents), request.return_features, request.next_step_late)
        if request.HasField("budget_vote"):
            try:
                self.budget_board.vote(budget_vote_from_pb(request.budget_vote))
            except ValueError as exc:
                raise InvalidArgument(f"budget_vote: {exc}") from exc
        result = await self.verifier.submit(step)
        if result.forward_ns:  # 0: the pass captured a CUDA graph, its time no pass's
            self.metrics.forward("verify", result.forward_ns)
        self.budget_board.tick(result.pass_sequences)
        return result

    def _verify_response(self, result: VerifyResult, spliced: bool):
        response = target_pb2.VerifyResponse(
            agreed_budget=self.budget_board.agreed,
            committed_tokens=result.committed_tokens,
            accepted_nodes=result.accepted_nodes,
            next_token=result.next_token,
            forward_ns=result.forward_ns,
            committed_length=result.committed_length,
            logprobs=[token_logprob_pb(lp) for lp in result.logprobs] if result.logprobs is not None else None,
            pass_rows=result.pass_rows,
            pass_sequences=result.pass_sequences,
            queue_ns=result.queue_ns,
            queue_prompt_ns=result.queue_prompt_ns,
        )
        return _with_features(response, result.features, spliced)

    async def VerifyStream(self, requests, context):
        async with contextlib.aclosing(sequence_stream(requests, context, self.Verify)) as answers:
            async for response in answers:
                yield response

    async def Release(self, request, context):
        released = self.host.release(request.sequence_id)
        return common_pb2.ReleaseResponse(released=released)


def _with_features(response, features, spliced: bool):
    """``response`` with tap ``features`` (None: none asked for) in its ``features`` field: encoded
    into it (gRPC), or spliced in by reference (the step socket, ``TensorSpliced``)."""
    if features is None:
        return response
    if spliced:
        return TensorSpliced(response, "features", features)
    response.features.CopyFrom(tensor_to_pb(features))
    return response
