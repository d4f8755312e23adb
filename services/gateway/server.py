"""Gateway servicer: validates the public request, runs the speculation loop, streams text.

The gateway needs no torch and no GPU: tokenizer, tree building on small numpy arrays and
orchestration. It refuses to start when the draft does not fit the target.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from splitspec.errors import FailedPrecondition, InvalidArgument
from splitspec.metrics import GatewayMetrics, RequestObserver
from splitspec.rpc import new_request_id
from splitspec.textstream import TextStream
from splitspec.tokenizer import Tokenizer
from splitspec.v1 import common_pb2, draft_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2
from splitspec.services.gateway.speculation import DraftShape, Mode, SpeculationOptions, SpeculativeSequence
from splitspec.services.gateway.workers import DraftClient, TargetClient

logger = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name

_MODES = {
    gateway_pb2.Speculation.DDTREE: Mode.DDTREE,
    gateway_pb2.Speculation.CHAIN: Mode.CHAIN,
    gateway_pb2.Speculation.OFF: Mode.OFF,
}
MAX_BUDGET = 256


def check_compatible(target: target_pb2.TargetInfo, draft: draft_pb2.DraftInfo) -> None:
    """Refuse a draft built for another target, naming the mismatch."""
    t, d = target.geometry, draft.target_geometry
    problems = []
    if t.vocab_size != d.vocab_size:
        problems.append(f"vocab_size {d.vocab_size} (draft's target) vs {t.vocab_size} (target)")
    if t.hidden_size != d.hidden_size:
        problems.append(f"hidden_size {d.hidden_size} vs {t.hidden_size}")
    bad_taps = [i for i in draft.target_layer_ids if not 0 <= i < t.num_layers]
    if bad_taps:
        problems.append(f"target_layer_ids {bad_taps} outside the target's {t.num_layers} layers")
    if problems:
        raise FailedPrecondition(f"draft {draft.path} does not fit target {t.path}: " + "; ".join(problems))


@dataclass
class GatewayState:
    """What the gateway learned from its workers at start-up."""

    target_info: target_pb2.TargetInfo
    draft_shape: DraftShape | None
    tokenizer: Tokenizer


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        target: TargetClient,
        draft: DraftClient | None,
        state: GatewayState,
        defaults: SpeculationOptions,
        metrics: GatewayMetrics,
    ) -> None:
        self.target, self.draft, self.state, self.defaults = target, draft, state, defaults
        self.metrics = metrics

    def _options(self, spec: gateway_pb2.Speculation) -> SpeculationOptions:
        if spec.mode not in (gateway_pb2.Speculation.MODE_UNSPECIFIED, *_MODES):
            raise InvalidArgument(f"speculation.mode: unknown value {spec.mode}")
        mode = _MODES.get(spec.mode, self.defaults.mode)
        budget = spec.budget or self.defaults.budget
        limit = min(MAX_BUDGET, self.state.target_info.max_tree_nodes)
        if not 0 < budget <= limit:
            raise InvalidArgument(f"speculation.budget: {spec.budget} is outside [1, {limit}]")
        chain_seed = spec.chain_seed if spec.HasField("chain_seed") else self.defaults.chain_seed
        top_k = min(self.defaults.top_k, budget)
        return SpeculationOptions(
            mode=mode, budget=budget, chain_seed=chain_seed, top_k=top_k,
            draft_window=self.defaults.draft_window, feature_dtype=self.defaults.feature_dtype,
            draft_timeout_s=self.defaults.draft_timeout_s,
        )

    def _prompt(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        geometry = self.state.target_info.geometry
        which = request.WhichOneof("prompt")
        if which == "text":
            ids = self.state.tokenizer.encode(request.text)
        elif which == "tokens":
            ids = list(request.tokens.ids)
            bad = [t for t in ids if not 0 <= t < geometry.vocab_size]
            if bad:
                raise InvalidArgument(f"tokens.ids: {bad[0]} is outside [0, {geometry.vocab_size})")
        else:
            raise InvalidArgument("prompt: set text or tokens")
        if not ids:
            raise InvalidArgument("prompt: empty after tokenization")
        if len(ids) >= geometry.max_context:
            raise InvalidArgument(f"prompt: {len(ids)} tokens leave no room in the context of {geometry.max_context}")
        return ids

    @staticmethod
    def _sampling(request: gateway_pb2.GenerateRequest) -> common_pb2.Sampling:
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise InvalidArgument(f"temperature: {request.temperature} must be a finite number >= 0")
        top_p = request.top_p if request.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:
            raise InvalidArgument(f"top_p: {top_p} must be in (0, 1]")
        if request.top_k < 0:
            raise InvalidArgument(f"top_k: {request.top_k} must be >= 0")
        return common_pb2.Sampling(temperature=request.temperature, top_p=top_p, top_k=request.top_k, seed=request.seed)

    async def Generate(self, request, context):
        with self.metrics.request() as timing:
            async for response in self._generate(request, context, timing):
                yield response

    async def _generate(self, request, context, timing: RequestObserver):
        prompt = self._prompt(request)
        if request.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: {request.max_tokens} must be >= 1")
        options = self._options(request.speculation)
        sampling = self._sampling(request)
        eos = set() if request.ignore_eos else set(self.state.target_info.eos_token_ids)
        stream = TextStream(
            self.state.tokenizer,
            stop_strings=[s for s in request.stop if s],
            stop_token_ids=eos | set(request.stop_token_ids),
            prompt_ids=prompt,
        )
        remaining = context.time_remaining()
        loop = asyncio.get_running_loop()
        seq = SpeculativeSequence(
            sequence_id=new_request_id(),
            target=self.target,
            draft=self.draft,
            draft_shape=self.state.draft_shape,
            options=options,
            prompt=prompt,
            sampling=sampling,
            max_new_tokens=request.max_tokens,
            max_context=self.state.target_info.geometry.max_context,
            deadline=None if remaining is None else loop.time() + remaining,
            on_step=self.metrics.step_observer(options.mode.value),
        )
        timing.admitted(len(prompt))
        finish = gateway_pb2.CONTEXT
        try:
            async for new_tokens in seq.run():
                new_tokens = new_tokens[: request.max_tokens - stream.num_tokens]
                delta = stream.push(new_tokens)
                timing.tokens(len(delta.token_ids))
                if delta.text or delta.token_ids:
                    yield gateway_pb2.GenerateResponse(text=delta.text, token_ids=delta.token_ids)
                if delta.finished:
                    last = delta.token_ids[-1] if delta.token_ids else None
                    is_eos = delta.stop_reason == "stop_token" and last in eos and last not in request.stop_token_ids
                    finish = gateway_pb2.EOS if is_eos else gateway_pb2.STOP
                    break
                if stream.num_tokens >= request.max_tokens:
                    finish = gateway_pb2.LENGTH
                    break
        finally:
            await seq.release()
        if finish in (gateway_pb2.LENGTH, gateway_pb2.CONTEXT):
            tail = stream.flush()
            if tail.text or tail.token_ids:
                yield gateway_pb2.GenerateResponse(text=tail.text, token_ids=tail.token_ids)
        stats = seq.stats
        usage = gateway_pb2.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=stream.num_tokens,
            steps=stats.steps,
            mean_acceptance_length=stats.mean_acceptance_length,
            draft_fallbacks=stats.fallbacks,
        )
        reason = gateway_pb2.FinishReason.Name(finish).lower()
        elapsed = timing.finished(reason)
        summary = {
            "request_id": seq.sequence_id, "finish_reason": reason, "prompt_tokens": len(prompt),
            "completion_tokens": stream.num_tokens, "steps": stats.steps,
            "mean_acceptance_length": round(stats.mean_acceptance_length, 3), "draft_fallbacks": stats.fallbacks,
            "ttft_s": round(timing.first_token_s or 0.0, 6), "duration_s": round(elapsed, 6),
        }
        logger.info(
            "request %(request_id)s done: %(finish_reason)s, %(prompt_tokens)d prompt + %(completion_tokens)d generated "
            "tokens, %(steps)d steps, AL %(mean_acceptance_length).2f, %(draft_fallbacks)d fallbacks, "
            "first token %(ttft_s).3f s, %(duration_s).3f s", summary, extra={"request": summary},
        )
        yield gateway_pb2.GenerateResponse(final=gateway_pb2.Final(finish_reason=finish, usage=usage))
