"""Gateway servicer: validates the public request, admits it, runs the speculation loop, streams text.

The gateway needs no torch and no GPU: tokenizer, tree building on small numpy arrays and
orchestration. It refuses to start when the draft does not fit the target.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from services.gateway.admission import Admission, Ticket, client_identity
from services.gateway.budget import BudgetPolicy
from services.gateway.monitor import WorkerMonitor
from services.gateway.runahead import RunAhead
from services.gateway.speculation import DraftShape, Mode, SpeculationOptions, SpeculativeSequence
from services.gateway.workers import DraftClient, TargetClient
from services.metrics import GatewayMetrics, RequestObserver
from splitspec import __version__
from splitspec.errors import FailedPrecondition, InvalidArgument, Unavailable
from splitspec.text.chat import ChatTemplate, ChatTemplateError
from splitspec.text.textstream import TextStream
from splitspec.text.tokenizer import Tokenizer
from splitspec.transport.interceptors import request_id
from splitspec.transport.rpc import new_request_id as new_sequence_id
from splitspec.v1 import common_pb2, draft_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2

logger = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name

_MODES = {
    gateway_pb2.Speculation.DDTREE: Mode.DDTREE,
    gateway_pb2.Speculation.CHAIN: Mode.CHAIN,
    gateway_pb2.Speculation.OFF: Mode.OFF,
}
_MODE_PB = {mode: pb for pb, mode in _MODES.items()}
# speculation.scores -> SpeculationOptions.lattice (unspecified: the gateway's default)
_SCORES = {gateway_pb2.Speculation.SCORES_UNSPECIFIED: None, gateway_pb2.Speculation.LATTICE: True, gateway_pb2.Speculation.INDEPENDENT: False}
MAX_BUDGET = 256
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKENS = 16, 256, 64
MAX_TOP_LOGPROBS = 20  # as OpenAI's API and the target worker allow


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


@dataclass(frozen=True)
class Call:
    """What the generation path needs to know of the call that asks: the request id of logs, the
    client (admission's fairness), and the deadline (event-loop time; None: none). gRPC Generate
    takes them from its context (:meth:`of_grpc`), the HTTP API (services/gateway/http) from its
    request. Cancelling the task that iterates :meth:`GatewayServicer.generate` cancels the call."""

    request_id: str
    client: str
    deadline: float | None = None

    @classmethod
    def of_grpc(cls, context, identity: str) -> Call:
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        return cls(request_id(context), client_identity(context, identity), deadline)


@dataclass(frozen=True)
class ChatInput:
    """A chat prompt with what ``GenerateRequest.messages`` cannot carry (the HTTP APIs): messages
    with tool calls and tool results, and the tools offered, for the chat template.
    ``fill_context``: a ``max_tokens`` of 0 means as many as the context leaves (OpenAI's default)."""

    messages: list[dict]
    tools: list[dict] | None = None
    fill_context: bool = False


@dataclass
class GatewayState:
    """What the gateway learned from its workers at start-up. ``chat`` is the model's chat template,
    or None with ``chat_problem`` saying why chat requests are refused."""

    target_info: target_pb2.TargetInfo
    draft_info: draft_pb2.DraftInfo | None
    tokenizer: Tokenizer
    chat: ChatTemplate | None = None
    chat_problem: str = "the model has no chat template"
    # Whether special-token strings typed in chat messages are control tokens (trusted callers
    # only; --chat-special-tokens) rather than plain text.
    chat_special_tokens: bool = False

    @property
    def draft_shape(self) -> DraftShape | None:
        d = self.draft_info
        return DraftShape(d.block_size, tuple(d.target_layer_ids)) if d is not None else None


def load_chat_template(tokenizer: Tokenizer) -> tuple[ChatTemplate | None, str]:
    """The tokenizer's chat template compiled, or None and the reason there is none."""
    if not tokenizer.chat_template:
        return None, "the model has no chat template"
    try:
        return ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens), ""
    except ChatTemplateError as exc:
        return None, str(exc)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        target: TargetClient,
        draft: DraftClient | None,
        state: GatewayState,
        defaults: SpeculationOptions,
        admission: Admission,
        monitor: WorkerMonitor,
        metrics: GatewayMetrics,
        budget_policy: BudgetPolicy,
        identity: str = "peer",
    ) -> None:
        self.target, self.draft, self.state, self.defaults = target, draft, state, defaults
        self.admission, self.monitor, self.metrics = admission, monitor, metrics
        self.identity = identity  # how a request's client is told apart (admission.client_identity)
        # Shared by every sequence: learns from all their steps; chooses the budgets of adaptive ones.
        self.budget_policy = budget_policy

    @property
    def max_budget(self) -> int:
        return min(MAX_BUDGET, self.state.target_info.max_tree_nodes)

    def _options(self, spec: gateway_pb2.Speculation) -> SpeculationOptions:
        if spec.mode not in (gateway_pb2.Speculation.MODE_UNSPECIFIED, *_MODES):
            raise InvalidArgument(f"speculation.mode: unknown value {spec.mode} (use DDTREE, CHAIN or OFF)")
        mode = _MODES.get(spec.mode, self.defaults.mode)
        # A request's own budget wins; without one, DDTree follows the gateway's default: fixed, or
        # adaptive (trees built at the policy's largest budget and cut per step). Chain mode under an
        # adaptive default keeps the fixed default as its length. A default larger than the target
        # verifies is cut to it: only a request's own budget can be out of range.
        if spec.budget and not 0 < spec.budget <= self.max_budget:
            raise InvalidArgument(f"speculation.budget: {spec.budget} is outside [1, {self.max_budget}]")
        adaptive = not spec.budget and self.defaults.adaptive and mode is Mode.DDTREE
        budget = min(self.budget_policy.max_budget, self.max_budget) if adaptive else spec.budget or min(self.defaults.budget, self.max_budget)
        if spec.scores not in _SCORES:
            raise InvalidArgument(f"speculation.scores: unknown value {spec.scores} (use LATTICE or INDEPENDENT)")
        lattice = _SCORES[spec.scores] if spec.scores else self.defaults.lattice
        top_k = min(self.defaults.top_k, budget)
        selector = self.state.draft_info.selector_top_k if self.state.draft_info is not None else 0
        if lattice and selector:  # the selector's walk and pair scores range over the candidates it was trained at
            top_k = max(top_k, selector)
        return SpeculationOptions(
            mode=mode,
            budget=budget,
            adaptive=adaptive,
            chain_seed=spec.chain_seed if spec.HasField("chain_seed") else self.defaults.chain_seed,
            lattice=lattice,
            top_k=top_k,
            draft_window=self.defaults.draft_window,
            feature_dtype=self.defaults.feature_dtype,
            draft_timeout_s=self.defaults.draft_timeout_s,
        )

    async def _prompt(self, request: gateway_pb2.GenerateRequest, ticket: Ticket, chat: ChatInput | None = None) -> list[int]:
        """The prompt's token ids, and ``request.max_tokens`` checked against the context (set, when
        ``chat.fill_context`` and it is 0, to what the context leaves)."""
        ids = await self._prompt_ids(request, ticket, chat)
        geometry = self.state.target_info.geometry
        if request.max_tokens <= 0 and chat is not None and chat.fill_context:
            request.max_tokens = geometry.max_context - len(ids)
        if request.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: {request.max_tokens} must be >= 1")
        if len(ids) + request.max_tokens > geometry.max_context:
            raise InvalidArgument(
                f"max_tokens: {request.max_tokens} beyond the context: the prompt has {len(ids)} tokens, "
                f"so at most {geometry.max_context - len(ids)} fit in {geometry.max_context}"
            )
        return ids

    async def _prompt_ids(self, request: gateway_pb2.GenerateRequest, ticket: Ticket, chat: ChatInput | None = None) -> list[int]:
        """The prompt's token ids. Everything that grows with the request's size is bounded before
        it runs: a text prompt's size is checked on its bytes, never tokenized when it cannot fit;
        tokenizing and chat rendering run on the admission's preparation threads, off the event loop."""
        geometry = self.state.target_info.geometry
        which = request.WhichOneof("prompt")
        if which == "text":
            text = request.text
            self._check_size(len(text.encode("utf-8")), request.max_tokens, "text")
            ids = await self.admission.prepare(ticket, self.state.tokenizer.encode, text)
        elif which == "messages":
            if self.state.chat is None:
                raise FailedPrecondition(f"messages: {self.state.chat_problem}; send the prompt as text or tokens")
            if not request.messages.messages:
                raise InvalidArgument("messages: empty")
            ids = await self.admission.prepare(ticket, self._chat_ids, request, chat)
        elif which == "tokens":
            count = len(request.tokens.ids)
            if count >= geometry.max_context:
                raise InvalidArgument(f"prompt: {count} tokens leave no room in the context of {geometry.max_context}")
            ids = list(request.tokens.ids)
            bad = [t for t in ids if not 0 <= t < geometry.vocab_size]
            if bad:
                raise InvalidArgument(f"tokens.ids: {bad[0]} is outside [0, {geometry.vocab_size})")
        else:
            raise InvalidArgument("prompt: set text, tokens or messages")
        if not ids:
            raise InvalidArgument("prompt: empty after tokenization")
        if len(ids) >= geometry.max_context:
            raise InvalidArgument(f"prompt: {len(ids)} tokens leave no room in the context of {geometry.max_context}")
        return ids

    def _check_size(self, num_bytes: int, max_tokens: int, what: str) -> None:
        """Refuse a prompt of ``num_bytes`` UTF-8 bytes that cannot fit the context, from its size alone:
        it has at least ``tokenizer.min_tokens(num_bytes)`` tokens (no bound: nothing is refused here)."""
        least = self.state.tokenizer.min_tokens(num_bytes)
        context = self.state.target_info.geometry.max_context
        if least >= context:
            most = self.state.tokenizer.max_input_bytes_per_token
            raise InvalidArgument(
                f"prompt: the {what} is {num_bytes} bytes, so at least {least} tokens (a token stands for at most "
                f"{most} bytes), which leaves no room in the context of {context}; refused before tokenization"
            )
        if max_tokens > 0 and least + max_tokens > context:
            raise InvalidArgument(
                f"max_tokens: {max_tokens} beyond the context: the prompt ({what}, {num_bytes} bytes) has at least "
                f"{least} tokens, so at most {context - least} fit in {context}"
            )

    def _chat_ids(self, request: gateway_pb2.GenerateRequest, chat: ChatInput | None = None) -> list[int]:
        """The token ids of ``request.messages`` (the template's own BOS included, so none is added).
        Runs on a preparation thread: render, check the size, tokenize."""
        add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        if chat is not None:
            messages, tools = chat.messages, chat.tools
        else:
            messages, tools = [{"role": m.role, "content": m.content} for m in request.messages.messages], None
        tokenizer = self.state.tokenizer
        strings = () if self.state.chat_special_tokens else tokenizer.special_token_strings
        try:
            prompt = self.state.chat.prompt(messages, add_generation_prompt, strings, {"tools": tools} if tools else None)
        except ChatTemplateError as exc:
            raise InvalidArgument(f"messages: {exc}") from exc
        self._check_size(prompt.num_bytes, request.max_tokens, "rendered chat prompt")
        return prompt.encode(tokenizer)

    @staticmethod
    def _sampling(request: gateway_pb2.GenerateRequest) -> common_pb2.Sampling:
        if not (math.isfinite(request.temperature) and 0 <= request.temperature <= 100):
            raise InvalidArgument(f"temperature: {request.temperature} is outside [0, 100]")
        top_p = request.top_p if request.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:  # also rejects NaN
            raise InvalidArgument(f"top_p: {top_p} is outside (0, 1]")
        if request.top_k < 0:
            raise InvalidArgument(f"top_k: {request.top_k} must be >= 0 (0 disables top-k)")
        return common_pb2.Sampling(temperature=request.temperature, top_p=top_p, top_k=request.top_k, seed=request.seed)

    def _stops(self, request: gateway_pb2.GenerateRequest) -> tuple[list[str], set[int]]:
        stops = list(request.stop)
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} characters")
        vocab = self.state.target_info.geometry.vocab_size
        ids = list(request.stop_token_ids)
        if len(ids) > MAX_STOP_TOKENS or any(not 0 <= t < vocab for t in ids):
            raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP_TOKENS} ids, each in [0, {vocab})")
        return stops, set(ids)

    async def Info(self, request, context):
        s = self.state
        d = s.draft_info
        return gateway_pb2.GatewayInfo(
            version=__version__,
            target=s.target_info.geometry,
            draft_path=d.path if d else "",
            draft_block_size=d.block_size if d else 0,
            tap_layer_ids=list(d.target_layer_ids) if d else [],
            default_speculation=gateway_pb2.Speculation(  # budget 0: adaptive (--budget auto)
                mode=_MODE_PB[self.defaults.mode], budget=0 if self.defaults.adaptive else self.defaults.budget,
                chain_seed=self.defaults.chain_seed,
            ),
            default_top_k=self.defaults.top_k,
            max_budget=self.max_budget,
            target_available=self.monitor.target_up,
            draft_available=self.monitor.draft_up,
            running_requests=self.admission.running,
            waiting_requests=self.admission.waiting,
            max_running_requests=self.admission.max_running,
            max_waiting_requests=self.admission.max_waiting,
        )

    async def Generate(self, request, context):
        async for response in self.generate(request, Call.of_grpc(context, self.identity)):
            yield response

    async def generate(self, request: gateway_pb2.GenerateRequest, call: Call, chat: ChatInput | None = None):
        """The one generation path (gRPC Generate and the HTTP API): validate, admit, speculate,
        stream ``GenerateResponse`` messages, the last one with ``final``. Raises ServiceError."""
        with self.metrics.request() as timing:
            async with self.admission.request(call.client) as ticket:
                async for response in self._generate(request, call, timing, ticket, chat):
                    yield response

    async def count_prompt_tokens(self, request: gateway_pb2.GenerateRequest, call: Call, chat: ChatInput | None = None) -> int:
        """The prompt's length in tokens, prepared as :meth:`generate` would (admitted, off the event loop)."""
        async with self.admission.request(call.client) as ticket:
            return len(await self._prompt_ids(request, ticket, chat))

    async def _generate(self, request, call: Call, timing: RequestObserver, ticket: Ticket, chat: ChatInput | None = None):
        # The client's x-request-id (or a fresh one) names the request in logs and traces only. The
        # workers key the sequence by the gateway's own id, unique per request and never taken from
        # client input, so no two requests (a retry reusing its id, or a hostile client) share one.
        rid = call.request_id
        sequence_id = new_sequence_id()
        logger.info("request %s: sequence %s", rid, sequence_id)
        options = self._options(request.speculation)
        sampling = self._sampling(request)
        stop_strings, stop_ids = self._stops(request)
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs: {request.top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]")
        if request.top_logprobs and not request.logprobs:
            raise InvalidArgument("top_logprobs: set logprobs too")
        top_logprobs = request.top_logprobs if request.logprobs else None
        prompt = await self._prompt(request, ticket, chat)  # the costly part last
        if not self.monitor.target_up:
            raise Unavailable(f"the target worker at {self.target.address} is unavailable")
        eos = set() if request.ignore_eos else set(self.state.target_info.eos_token_ids)
        async with self.admission.slot(ticket) as queued_s:
            timing.admitted(len(prompt))
            seq = SpeculativeSequence(
                sequence_id=sequence_id,
                target=self.target,
                draft=self.draft,
                draft_shape=self.state.draft_shape,
                options=options,
                prompt=prompt,
                sampling=sampling,
                max_new_tokens=request.max_tokens,
                max_context=self.state.target_info.geometry.max_context,
                deadline=call.deadline,
                draft_available=lambda: self.monitor.draft_up,
                on_draft_failure=self.monitor.mark_draft_down,
                on_step=self.metrics.step_observer(options.mode.value),
                top_logprobs=top_logprobs,
                budget_policy=self.budget_policy,
            )
            stream = TextStream(self.state.tokenizer, stop_strings=stop_strings, stop_token_ids=eos | stop_ids, prompt_ids=prompt)
            finish = gateway_pb2.CONTEXT
            # Logprobs of the tokens pushed into `stream` and not reported yet, in order: the stream
            # reports its tokens in the order pushed, so a delta's ids are the front of this list.
            unreported: list = []

            def reply(delta) -> gateway_pb2.GenerateResponse:
                logprobs = None
                if top_logprobs is not None:
                    logprobs = unreported[: len(delta.token_ids)]
                    del unreported[: len(delta.token_ids)]
                return gateway_pb2.GenerateResponse(text=delta.text, token_ids=delta.token_ids, logprobs=logprobs)

            try:
                async with RunAhead(seq.run()) as steps:
                    async for new_tokens in steps:
                        pushed = new_tokens[: request.max_tokens - stream.num_tokens]
                        if top_logprobs is not None:
                            unreported.extend(new_tokens.logprobs[: len(pushed)])
                        delta = stream.push(pushed)
                        timing.tokens(len(delta.token_ids))
                        if delta.text or delta.token_ids:
                            yield reply(delta)
                        if delta.finished:
                            last = delta.token_ids[-1] if delta.token_ids else None
                            is_eos = delta.stop_reason == "stop_token" and last in eos and last not in stop_ids
                            finish = gateway_pb2.EOS if is_eos else gateway_pb2.STOP
                            break
                        if stream.num_tokens >= request.max_tokens:
                            finish = gateway_pb2.LENGTH
                            break
            finally:
                await seq.release()
        if finish in (gateway_pb2.LENGTH, gateway_pb2.CONTEXT):
            tail = stream.flush()
            timing.tokens(len(tail.token_ids))
            if tail.text or tail.token_ids:
                yield reply(tail)
            if tail.finished:  # the released text completed a stop string
                finish = gateway_pb2.STOP
        stats = seq.stats
        usage = gateway_pb2.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=stream.num_reported,  # the tokens sent: those of the text sent, and a stop token
            steps=stats.steps,
            mean_acceptance_length=stats.mean_acceptance_length,
            draft_fallbacks=stats.fallbacks,
        )
        reason = gateway_pb2.FinishReason.Name(finish).lower()
        elapsed = timing.finished(reason)
        summary = {
            "request_id": rid, "sequence_id": sequence_id, "finish_reason": reason, "prompt_tokens": len(prompt),
            "completion_tokens": stream.num_reported, "steps": stats.steps,
            "mean_acceptance_length": round(stats.mean_acceptance_length, 3), "draft_fallbacks": stats.fallbacks,
            "fallback_reasons": stats.fallback_reasons, "recoveries": stats.recoveries,
            "queued_s": round(queued_s, 6), "ttft_s": round(timing.first_token_s or 0.0, 6), "duration_s": round(elapsed, 6),
        }
        logger.info(
            "request %(request_id)s (sequence %(sequence_id)s) done: %(finish_reason)s, %(prompt_tokens)d prompt + %(completion_tokens)d generated "
            "tokens, %(steps)d steps, AL %(mean_acceptance_length).2f, %(draft_fallbacks)d fallbacks %(fallback_reasons)s, "
            "%(recoveries)d recoveries, queued %(queued_s).3f s, first token %(ttft_s).3f s, %(duration_s).3f s",
            summary, extra={"request": summary},
        )
        yield gateway_pb2.GenerateResponse(final=gateway_pb2.Final(finish_reason=finish, usage=usage))
