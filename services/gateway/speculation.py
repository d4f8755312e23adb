"""The speculation loop for one sequence: prefill, then Propose -> build tree -> Verify, repeated.

Per step the gateway sends the draft the *anchor* (the target's pending token), the token ids and
tap features of the positions committed since the last call, builds a DDTree (or a chain, or
nothing) from the returned per-depth top-K (a DFlash2 draft's pair scores, unless the request asks
for independent scores: the selector's walk for a chain, a tree over its candidate lattice;
``splitspec.spec.lattice``), and has the target verify it. Each step commits the
root plus the accepted nodes and yields the *new* tokens: the accepted nodes' tokens and the bonus
(the root itself was yielded the step before, as that step's bonus).

Faults never change the output, because the target's rule picks every token:
- the draft fails or misses its deadline: the sequence continues target-only (a root-only tree),
  counted as a fallback; when the draft answers again the sequence resumes speculating with a
  fresh draft context that starts at the current position;
- the target answers NOT_FOUND (it restarted and lost the sequence): the gateway prefills the
  prompt plus everything generated so far and carries on;
- any other target failure ends the request with the target's status.

With an adaptive budget (``SpeculationOptions.adaptive``) each DDTree step builds the tree of the
largest budget once and cuts it to the gateway's :class:`~services.gateway.budget.BudgetPolicy`
choice; a prefix of best-first pops is the tree of the smaller budget (``DraftTree.prefix``). Every
verify feeds the policy its pass (rows, sequences, time), and a speculating step its round time and
acceptance, whatever the step's mode or budget: the cost and calibration are the gateway's, not the
request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from services.gateway.budget import BudgetPolicy
from services.gateway.stats import SequenceStats, StepStats
from services.gateway.workers import DraftClient, Prefilled, TargetClient, Verified
from splitspec.errors import UpstreamError
from splitspec.spec.budget_choice import BudgetVote
from splitspec.spec.lattice import build_lattice_tree, check_lattice, path_chain, sampled_path, selector_path
from splitspec.spec.tree import DEFAULT_TOP_K, DraftTree, build_chain, build_ddtree
from splitspec.transport.tensors import concat_rows, last_rows
from splitspec.v1 import common_pb2, target_pb2

logger = logging.getLogger(__name__)
_last_draft_context = 0


def next_draft_context() -> int:
    """A draft context number above every earlier one: microseconds of the wall clock, so numbers
    also grow across gateway restarts and a reused request id starts above the draft's released
    ones (``ProposeRequest.context``)."""
    global _last_draft_context
    _last_draft_context = max(_last_draft_context + 1, time.time_ns() // 1000)
    return _last_draft_context


class Mode(enum.Enum):
    DDTREE = "ddtree"
    CHAIN = "chain"
    OFF = "off"


@dataclass(frozen=True)
class SpeculationOptions:
    mode: Mode = Mode.DDTREE
    # Tree nodes per step, root excluded (chain mode: the chain's length). Adaptive: the most a step
    # gets, the budget its tree is built at before the policy cuts it.
    budget: int = 22
    adaptive: bool = False  # DDTree only: each step's budget is the BudgetPolicy's choice, at most `budget`
    chain_seed: bool = True
    # A DFlash2 draft's candidates: chained by the selector's walk and grown into trees by its pair
    # scores (splitspec.spec.lattice), or by each depth's log-probabilities alone (False).
    lattice: bool = True
    top_k: int = DEFAULT_TOP_K  # candidates per depth asked of the draft
    draft_window: int = 0  # context positions the draft attends to (0 = all)
    feature_dtype: str = ""  # wire dtype of tap features ("" = the target's compute dtype)
    draft_timeout_s: float = 5.0


@dataclass(frozen=True)
class DraftShape:
    block_size: int
    taps: tuple[int, ...]


def upstream(worker: str, exc: grpc.aio.AioRpcError) -> UpstreamError:
    """A worker's RPC error as the gateway's own, keeping its status code."""
    return UpstreamError(exc.code().name, f"{worker} worker: {exc.details()}")


class Committed(list):
    """Newly committed token ids (a list, as ``run`` yields them), with their ``logprobs`` (one
    ``TokenLogprob`` per id) when the sequence asked for them, else None."""

    def __init__(self, tokens, logprobs=None) -> None:
        super().__init__(tokens)
        self.logprobs = logprobs


# Target-only steps an adaptive sequence takes in one pipelined run while the budget is 0; then it
# drafts one step (explores: the policy keeps observing the draft, and may leave 0). Each sequence
# explores on its own, so the draft's context misses at most this many positions' features.
TARGET_ONLY_RUN = 20


class SpeculativeSequence:
    MAX_DRAFT_RESUMES = 3  # a draft that keeps failing for this sequence is given up on

    def __init__(
        self,
        sequence_id: str,
        target: TargetClient,
        draft: DraftClient | None,
        draft_shape: DraftShape | None,
        options: SpeculationOptions,
        prompt: list[int],
        sampling: common_pb2.Sampling,
        max_new_tokens: int,
        max_context: int,
        deadline: float | None = None,  # event-loop time by which everything must end
        draft_available: Callable[[], bool] = lambda: True,
        on_draft_failure: Callable[[], None] = lambda: None,
        on_step: Callable[[StepStats], None] = lambda step: None,  # called after every verify
        top_logprobs: int | None = None,  # None: no logprobs; N: each token's logprob and N alternatives
        budget_policy: BudgetPolicy | None = None,  # the gateway's; observes every step, chooses adaptive budgets
    ) -> None:
        if options.adaptive and (options.mode is not Mode.DDTREE or budget_policy is None):
            raise ValueError("an adaptive budget needs DDTree mode and a budget policy")
        self.budget_policy = budget_policy
        self.top_logprobs = top_logprobs
        self.sequence_id = sequence_id
        self.target, self.draft, self.shape = target, draft, draft_shape
        self.options = options
        self.prompt, self.sampling = prompt, sampling
        self.max_new_tokens = max_new_tokens
        self.capacity = min(max_context, len(prompt) + max_new_tokens + options.budget + 1)
        self.deadline = deadline
        self.draft_available, self.on_draft_failure, self.on_step = draft_available, on_draft_failure, on_step
        self.stats = SequenceStats()
        self.wants_draft = options.mode is not Mode.OFF and draft is not None and draft_shape is not None
        self.draft_live = False  # the draft holds a context for this sequence, in sync with the target
        self.draft_context = 0  # the number of the last draft context started (ProposeRequest.context)
        self.draft_synced = 0  # positions whose token ids the draft has been sent
        self.resumes = 0
        self.draft_s = 0.0  # the last proposal's time, as the gateway waited for it
        self.explore = False  # a run of target-only steps ended: the next adaptive step drafts
        self.generated: list[int] = []  # every token yielded so far
        # Draws the selector walks of chain mode under sampling (seeded requests repeat their drafts).
        self.walk_rng = np.random.default_rng([sampling.seed, 0x5E1EC7] if sampling.seed else None)

    def _tokens(self, begin: int, end: int) -> list[int]:
        """Token ids of positions [begin, end) (prompt, then generated) without joining the lists."""
        p = len(self.prompt)
        return self.prompt[begin:min(end, p)] + self.generated[max(0, begin - p) : max(0, end - p)]

    def _timeout(self, cap: float | None = None) -> float | None:
        if self.deadline is None:
            return cap
        left = max(0.001, self.deadline - asyncio.get_running_loop().time())
        return left if cap is None else min(left, cap)

    def _speculating(self) -> bool:
        return self.wants_draft and (self.draft_live or (self.draft_available() and self.resumes < self.MAX_DRAFT_RESUMES))

    async def _prefill(self, tokens: list[int]) -> Prefilled:
        speculating = self._speculating()
        try:
            return await self.target.prefill(
                target_pb2.PrefillRequest(
                    sequence_id=self.sequence_id,
                    tokens=tokens,
                    sampling=self.sampling,
                    tap_layer_ids=list(self.shape.taps) if speculating else [],
                    reserve_tokens=max(self.capacity, len(tokens) + 1),
                    feature_rows=self.options.draft_window,
                    feature_dtype=self.options.feature_dtype,
                    logprobs=self.top_logprobs is not None,
                    top_logprobs=self.top_logprobs or 0,
                ),
                timeout=self._timeout(),
            )
        except grpc.aio.AioRpcError as exc:
            raise upstream("target", exc) from exc

    async def run(self) -> AsyncIterator[list[int]]:
        """Yield newly committed tokens after prefill and after every step, until ``max_new_tokens``."""
        policy = self.budget_policy if self.options.adaptive else None
        if policy is not None:
            policy.sequences += 1  # its votes weigh the sequences they speak for
        try:
            async with contextlib.aclosing(self._run()) as steps:
                async for tokens in steps:
                    yield tokens
        finally:
            if policy is not None:
                policy.sequences -= 1

    def _vote(self) -> BudgetVote | None:
        """The gateway's budget vote for this step's request, where it is due (an adaptive step's)."""
        return self.budget_policy.take_vote() if self.options.adaptive else None

    async def _run(self) -> AsyncIterator[list[int]]:
        prefilled = await self._prefill(self.prompt)
        anchor, features = prefilled.next_token, prefilled.features
        self.generated.append(anchor)
        yield self._committed([anchor], [prefilled.logprob])
        while len(self.generated) < self.max_new_tokens:
            start = len(self.prompt) + len(self.generated) - 1  # positions in the target's KV cache
            # The tree's depth is bounded by the tokens still wanted and by the reserved positions,
            # its size by the reserved positions (near the end of the context they are fewer than the budget).
            max_nodes = self.capacity - start - 1
            max_depth = min(self.max_new_tokens - len(self.generated) - 1, max_nodes)
            if max_depth < 0:
                return
            # Features are missing after steps run without the draft; a resumed draft needs them.
            speculating = self._speculating() and (features is not None or not self.shape.taps)
            run = 0  # pipelined target-only steps to take now
            fits = min(self.max_new_tokens - len(self.generated), max_nodes + 1)  # decode steps still wanted and reserved
            if self.options.mode is Mode.OFF:
                run = fits
            elif speculating and self.options.adaptive and max_depth > 0 and self.budget_policy.choice == 0 and not self.explore:
                run, self.explore = min(fits, TARGET_ONLY_RUN), True  # the adaptive budget is 0
            if run:
                missed = []  # the run's tap features, for the draft's next proposal (mode off asks for none)
                try:
                    async for new, verified in self._decode(run, adaptive=self.options.mode is not Mode.OFF):
                        anchor = verified.next_token
                        if verified.features is not None:
                            missed.append(verified.features)
                        yield new
                    if missed:
                        features = await self._behind(features, concat_rows(*missed))
                    continue
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise upstream("target", exc) from exc
                prefilled = await self._recover()
                anchor, features = prefilled.next_token, prefilled.features
                yield self._committed([anchor], [prefilled.logprob])
                continue
            step_start = time.perf_counter()
            tree, fallback, budget = DraftTree.empty(), "", None
            if speculating:
                tree, fallback, budget = await self._draft_tree(anchor, start, features, max_depth, max_nodes)
                self.explore = False
            else:
                fallback = "draft_down" if self.wants_draft else "no_draft"
            try:
                verified = await self.target.verify(
                    self.sequence_id, tree.tokens, tree.parents, self._speculating() and bool(self.shape.taps),
                    timeout=self._timeout(), vote=self._vote(),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise upstream("target", exc) from exc
                prefilled = await self._recover()
                anchor, features = prefilled.next_token, prefilled.features
                yield self._committed([anchor], [prefilled.logprob])
                continue
            accepted = len(verified.committed_tokens) - 1
            self._observe(tree, budget is not None, verified, accepted, time.perf_counter() - step_start)
            new = self._advance(verified, StepStats(tree.num_nodes, int(tree.depths.max(initial=0)), accepted, fallback, budget))
            anchor, features = verified.next_token, verified.features
            yield self._committed(new, verified.logprobs)

    async def _decode(self, steps: int, adaptive: bool = False) -> AsyncIterator[tuple[Committed, Verified]]:
        """``steps`` target-only decode steps (trees of no node), pipelined (``TargetClient.decode``):
        mode off's, or, ``adaptive``, a run of them while the adaptive budget is 0. Pipelined, each
        step waits at the target while the one before runs, so the sequences of a gateway whose
        budget is 0 all join each pass, as mode off's do; as single steps, the two groups that had
        taken turns at the draft and the target kept taking turns (``StepBatcher`` starts a group
        that is back), every step waiting for the other group's pass (on the 2-core CPU at 8 users,
        ``q`` 1.95 with 4 sequences a pass). An adaptive run's steps return their rows' tap
        features for the draft's next proposal, count as budget 0 and price target-only rounds
        (:meth:`_observe`). A step past the one that finishes the request (an EOS, a stop string)
        may already wait at the target: it runs, its token is never yielded, and the sequence is
        released after."""
        want = adaptive and self._speculating() and bool(self.shape.taps)
        answered = time.perf_counter()
        # The step after a run drafts: the target holds no pass for it meanwhile.
        decoded = self.target.decode(self.sequence_id, steps, self._timeout, want, late_last=adaptive, vote=self._vote())
        async with contextlib.aclosing(decoded):
            async for verified in decoded:
                now = time.perf_counter()
                self._observe(DraftTree.empty(), False, verified, 0, now - answered, target_only=adaptive)
                answered = now
                step = StepStats(0, 0, 0, "", 0 if adaptive else None)
                yield self._committed(self._advance(verified, step), verified.logprobs), verified

    def _advance(self, verified: Verified, step: StepStats) -> list[int]:
        """Count a verified step and take its new tokens (the accepted nodes' and the bonus)."""
        self.stats.add(step)
        self.on_step(step)
        new = verified.committed_tokens[1:] + [verified.next_token]
        self.generated.extend(new)
        return new

    def _observe(self, tree: DraftTree, drafted: bool, verified: Verified, accepted: int, step_s: float, target_only: bool = False) -> None:
        """Feed the budget policy a verified step; ``drafted``: the step proposed and built ``tree``;
        ``target_only``: a pipelined step of an adaptive run at budget 0 (:meth:`_decode`), its
        ``step_s`` the time since the answer before."""
        policy = self.budget_policy
        if policy is None:
            return
        policy.agree(verified.agreed_budget)
        forward_s = verified.forward_ns / 1e9
        if forward_s > 0:  # 0: the pass captured a CUDA graph; its time says nothing of a pass or a round
            # A target that does not batch reports no pass figures: its pass was this step's alone.
            pass_rows = verified.pass_rows or tree.num_nodes + 1
            policy.observe_pass(pass_rows, verified.pass_sequences or 1, forward_s)
            if drafted or target_only:
                # The wait behind other sequences' passes is priced as passes (BudgetPolicy's q), not as
                # t_other: as a constant it would argue for larger trees, which lengthen it. The wait
                # behind their prompts is priced nowhere: no budget changes it. A pipelined step waited
                # behind its own step before, not others': its round is the time between answers.
                prompt_s = verified.queue_prompt_ns / 1e9
                queue_s = prompt_s if target_only else verified.queue_ns / 1e9
                policy.observe_round(
                    step_s, forward_s, queue_s, verified.pass_sequences or 1, self.draft_s, prompt_s, target_only=target_only, pass_rows=pass_rows,
                )
        if drafted:
            policy.observe_acceptance(tree, accepted)
            if not self.options.adaptive and self.options.mode is Mode.DDTREE:
                policy.observe_fixed_tree(tree, self.options.budget)

    def _committed(self, tokens: list[int], logprobs) -> Committed:
        if self.top_logprobs is None:
            return Committed(tokens)
        if logprobs is None or len(logprobs) != len(tokens) or any(lp is None or lp.id != t for lp, t in zip(logprobs, tokens)):
            raise UpstreamError("INTERNAL", "target worker: logprobs were asked for but it returned none, or not those of its tokens")
        return Committed(tokens, list(logprobs))

    async def _recover(self) -> Prefilled:
        """The target lost the sequence: prefill everything generated so far and go on from there."""
        self.stats.recoveries += 1
        tokens = self._tokens(0, len(self.prompt) + len(self.generated))
        logger.warning("sequence %s: the target lost it; re-prefilling %d tokens", self.sequence_id, len(tokens))
        await self._forget_draft()
        prefilled = await self._prefill(tokens)
        self.generated.append(prefilled.next_token)
        return prefilled

    async def _behind(self, features: common_pb2.Tensor | None, new: common_pb2.Tensor | None) -> common_pb2.Tensor | None:
        """The tap features the draft has not seen, after steps it was not asked for: ``features``
        (the rows since its last proposal) then those steps' ``new`` rows. A windowed draft attends to
        its last ``draft_window`` positions only: past that many rows its context is released, and
        the next proposal starts a fresh one from the last rows."""
        if features is None or new is None:
            return new if features is None else features
        joined = concat_rows(features, new)
        window = self.options.draft_window
        if window and joined.shape[0] > window:
            await self._forget_draft()
            return last_rows(joined, window)
        return joined

    async def _forget_draft(self) -> None:
        self.draft_synced = 0
        if self.draft_live:
            try:
                await self.draft.release(self.sequence_id, self.draft_context)
            except grpc.aio.AioRpcError:
                pass  # a draft that cannot be reached holds nothing we can free now; its TTL will
            # Not live once the Release was answered or failed. Cancelled before (the client left
            # or its deadline passed meanwhile), the context stays live here, so release() frees it.
            self.draft_live = False

    async def _draft_tree(
        self, anchor: int, start: int, features, max_depth: int, max_nodes: int
    ) -> tuple[DraftTree, str, int | None]:
        """Propose from the draft and build a tree of at most ``max_nodes`` nodes and ``max_depth``
        depth; returns it, the fallback reason ("" = none) and the budget it was built under (None:
        none was built). ``features`` are the rows ending at ``start``;
        the token ids sent are those of every position the draft has not seen (all of them when a
        fresh context starts: token-based drafters need the whole history)."""
        opts = self.options
        if max_depth == 0:  # the last step: only the bonus token is still wanted
            return DraftTree.empty(), "", None
        if not self.draft_live:
            self.resumes += self.stats.steps > 0  # the first context is a start, not a resume
            self.draft_context = next_draft_context()  # a fresh context: steps of the released one stay refused
        self.draft_live = True
        history = self._tokens(self.draft_synced, start)
        budget = min(opts.budget, max_nodes)
        if opts.mode is Mode.CHAIN:
            budget = size = min(budget, max_depth)
        else:
            size = min(budget, self.budget_policy.tree_budget()) if opts.adaptive else budget
        timeout = self._timeout(opts.draft_timeout_s)
        asked = time.perf_counter()
        try:
            # A tree of `size` nodes reaches that depth at most: the draft's head runs for those depths only.
            proposed = await self.draft.propose(
                self.sequence_id, anchor, start, history, features, opts.top_k, opts.draft_window,
                timeout=timeout, context=self.draft_context, depths=max(1, min(size, max_depth, self.shape.block_size - 1)),
            )
            self.draft_synced = start
            self.draft_s = time.perf_counter() - asked
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "sequence %s: draft failed (%s: %s); continuing target-only",
                self.sequence_id, exc.code().name, exc.details(),
            )
            # The draft is down for everyone only through its own fault: a step cut short by the
            # client's deadline (shorter than --draft-timeout) says nothing about it.
            late = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= opts.draft_timeout_s
            if exc.code() == grpc.StatusCode.UNAVAILABLE or late:
                self.on_draft_failure()
            await self._forget_draft()
            return DraftTree.empty(), exc.code().name.lower(), None
        top_ids, pairs = proposed.top_ids, proposed.pair_scores if opts.lattice else None
        try:
            if opts.mode is Mode.CHAIN:
                if pairs is None:
                    return build_chain(top_ids, budget), "", budget
                top_ids, pairs = check_lattice(top_ids, pairs)
                t = self.sampling.temperature
                path = sampled_path(pairs, budget, t, self.walk_rng) if t > 0 else selector_path(pairs, budget)
                return path_chain(top_ids, path), "", budget
            if pairs is None:
                tree = build_ddtree(top_ids, proposed.top_logprobs, size, chain_seed=opts.chain_seed, max_depth=max_depth)
            else:
                tree = build_lattice_tree(top_ids, pairs, size, chain_seed=opts.chain_seed, max_depth=max_depth)
        except ValueError as exc:  # the draft's answer is input too: a broken one costs this step's speculation only
            logger.warning("sequence %s: malformed draft proposal (%s); continuing target-only", self.sequence_id, exc)
            await self._forget_draft()
            return DraftTree.empty(), "malformed", None
        if opts.adaptive:
            budget = self.budget_policy.choose(tree, full=size == budget)
            tree = tree.prefix(budget)
        return tree, "", budget

    async def release(self) -> None:
        """Free the sequence on both workers; errors are logged, never raised. Survives cancellation."""
        calls = [self.target.release(self.sequence_id)]
        if self.draft_live:
            calls.append(self.draft.release(self.sequence_id, self.draft_context))
        results = await asyncio.shield(asyncio.gather(*calls, return_exceptions=True))
        for result in results:
            if isinstance(result, Exception):
                logger.warning("sequence %s: release failed: %s", self.sequence_id, result)
