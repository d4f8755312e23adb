"""The speculation loop for one sequence: prefill, then Propose -> build tree -> Verify, repeated.

Per step the gateway sends the draft the *anchor* (the target's pending token) and the tap
features of the tokens committed since the last call, builds a DDTree (or a chain, or nothing)
from the returned per-depth top-K, and has the target verify it. Each step commits the root plus
the accepted nodes and yields the *new* tokens: the accepted nodes' tokens and the bonus (the root
itself was yielded the step before, as that step's bonus).

If the draft fails or misses its deadline, the sequence continues target-only (a root-only tree)
and the fallback is counted: the output is unchanged, because the target's rule picks every token.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from splitspec.spec.tree import DraftTree, build_chain, build_ddtree
from splitspec.v1 import common_pb2, target_pb2
from splitspec.services.gateway.workers import DraftClient, TargetClient

logger = logging.getLogger(__name__)


class Mode(enum.Enum):
    DDTREE = "ddtree"
    CHAIN = "chain"
    OFF = "off"


@dataclass(frozen=True)
class SpeculationOptions:
    mode: Mode = Mode.DDTREE
    budget: int = 22  # tree nodes per step, root excluded
    chain_seed: bool = True
    top_k: int = 8  # candidates per depth asked of the draft
    draft_window: int = 0  # context positions the draft attends to (0 = all)
    feature_dtype: str = ""  # wire dtype of tap features ("" = the target's compute dtype)
    draft_timeout_s: float = 5.0


@dataclass(frozen=True)
class StepStats:
    """What one verify step did."""

    tree_nodes: int  # drafted nodes sent to verification (0 = target-only)
    draft_depth: int  # draft positions speculated: the depth of the deepest node
    accepted: int  # accepted nodes, i.e. the depth of the accepted path; the step commits accepted + 1
    fallback: str = ""  # why the step ran target-only although speculation was asked ("" = it did not)


@dataclass
class SequenceStats:
    steps: int = 0  # verify passes
    committed: int = 0  # tokens committed by verifies (root + accepted nodes)
    tree_nodes: int = 0  # drafted nodes sent to verification
    fallbacks: int = 0  # steps run target-only because the draft failed

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.committed += step.accepted + 1
        self.tree_nodes += step.tree_nodes
        self.fallbacks += bool(step.fallback)

    @property
    def mean_acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class DraftShape:
    block_size: int
    taps: tuple[int, ...]


class SpeculativeSequence:
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
        on_step: Callable[[StepStats], None] = lambda step: None,  # called after every verify
    ) -> None:
        self.sequence_id = sequence_id
        self.target, self.draft, self.shape = target, draft, draft_shape
        self.options = options
        self.prompt, self.sampling = prompt, sampling
        self.max_new_tokens = max_new_tokens
        self.capacity = min(max_context, len(prompt) + max_new_tokens + options.budget + 1)
        self.deadline = deadline
        self.stats = SequenceStats()
        self.on_step = on_step
        self.speculating = options.mode is not Mode.OFF and draft is not None and draft_shape is not None
        # Why a sequence that asked for speculation runs target-only: no draft, or the draft's failure.
        self.fallback = "" if self.speculating or options.mode is Mode.OFF else "no_draft"
        self._draft_touched = False

    def _timeout(self, cap: float | None = None) -> float | None:
        if self.deadline is None:
            return cap
        left = max(0.001, self.deadline - asyncio.get_running_loop().time())
        return left if cap is None else min(left, cap)

    async def run(self) -> AsyncIterator[list[int]]:
        """Yield newly committed tokens after prefill and after every step, until ``max_new_tokens``."""
        opts = self.options
        prefilled = await self.target.prefill(
            target_pb2.PrefillRequest(
                sequence_id=self.sequence_id,
                tokens=self.prompt,
                sampling=self.sampling,
                tap_layer_ids=list(self.shape.taps) if self.speculating else [],
                reserve_tokens=self.capacity,
                feature_rows=opts.draft_window,
                feature_dtype=opts.feature_dtype,
            ),
            timeout=self._timeout(),
        )
        generated, anchor, start, features = 1, prefilled.next_token, len(self.prompt), prefilled.features
        history = self.prompt  # tokens of positions the draft has not been sent yet
        yield [anchor]
        while generated < self.max_new_tokens:
            # The tree's depth is bounded by the tokens still wanted and by the reserved positions.
            max_depth = min(self.max_new_tokens - generated - 1, self.capacity - start - 1)
            if max_depth < 0:
                return
            tree = DraftTree.empty()
            if self.speculating:
                tree = await self._draft_tree(anchor, start, history, features, max_depth)
            verified = await self.target.verify(
                self.sequence_id, tree.tokens, tree.parents, self.speculating and bool(self.shape.taps),
                timeout=self._timeout(),
            )
            step = StepStats(tree.num_nodes, int(tree.depths.max(initial=0)), len(verified.committed_tokens) - 1, self.fallback)
            self.stats.add(step)
            self.on_step(step)
            new = verified.committed_tokens[1:] + [verified.next_token]
            generated += len(new)
            anchor, start, features = verified.next_token, verified.committed_length, verified.features
            history = verified.committed_tokens
            yield new

    async def _draft_tree(self, anchor: int, start: int, history: list[int], features, max_depth: int) -> DraftTree:
        opts = self.options
        if max_depth == 0:  # the last step: only the bonus token is still wanted
            return DraftTree.empty()
        self._draft_touched = True  # from here on the draft may hold state for this sequence
        try:
            top_ids, top_logprobs = await self.draft.propose(
                self.sequence_id, anchor, start, history, features, opts.top_k, opts.draft_window,
                timeout=self._timeout(opts.draft_timeout_s),
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "sequence %s: draft failed (%s: %s); continuing target-only",
                self.sequence_id, exc.code().name, exc.details(),
            )
            self.speculating, self.fallback = False, exc.code().name.lower()
            return DraftTree.empty()
        if opts.mode is Mode.CHAIN:
            return build_chain(top_ids, min(opts.budget, max_depth))
        return build_ddtree(top_ids, top_logprobs, opts.budget, chain_seed=opts.chain_seed, max_depth=max_depth)

    async def release(self) -> None:
        """Free the sequence on both workers; errors are logged, never raised."""
        calls = [self.target.release(self.sequence_id)]
        if self._draft_touched and self.draft is not None:
            calls.append(self.draft.release(self.sequence_id))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("sequence %s: release failed: %s", self.sequence_id, result)
