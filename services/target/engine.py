"""Target engine: per-sequence model state, prefill, one-pass tree verify, acceptance, commit.

Terms (see ``splitspec.spec.tree``): the *root* is the pending token drawn last step (not yet in
the KV cache); a verify pass runs ``[root, nodes]`` at positions ``length + depth`` with an
ancestor-only mask and the rows' parents, draws the target's own token at every row, walks the
tree, commits the accepted rows (K/V compacted down to ``length ..``; for hybrid models also the
deepest accepted row's recurrent and conv state), and returns the *committed* tokens (root +
accepted nodes) and the *bonus* (the target's token after the last accepted node: the next root).

The engine knows model families only through :class:`TargetModel` and :class:`SequenceCache`.

Not thread-safe: the service calls it from one worker thread, which serialises device work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from services.target.graphs import PREFILL_CHUNK, PooledKVCache, StaticVerifier
from services.worker.hosting import SequenceTable
from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from splitspec.spec.acceptance import accept_path
from splitspec.spec.sampling import SamplingParams, draw_tokens, token_logprobs
from splitspec.spec.tree import node_depths, tree_attention_mask, validate_tree


class SequenceCache(Protocol):
    """One sequence's model state: K/V slots for ``capacity`` positions (plus recurrent state)."""

    @property
    def capacity(self) -> int: ...

    def commit(self, start: int, accepted: Sequence[int]) -> None:
        """Keep the accepted rows ``[AL]`` (root row 0 first) of the verify block written at ``start``."""


class TargetModel(Protocol):
    """A target family: ``Qwen3ForCausalLM``, ``Qwen35ForCausalLM``."""

    config: Any  # vocab_size, num_layers, max_context

    def new_cache(self, capacity: int, device: torch.device, dtype: torch.dtype) -> SequenceCache: ...

    def __call__(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: SequenceCache,
        start: int,
        mask: torch.Tensor,  # [T, start + T] bool
        taps: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R]
        parents: torch.Tensor | None = None,  # [T] parent rows of a tree (-1 = committed state); None = a chain
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class TargetLimits:
    max_sequences: int = 64
    max_kv_tokens: int = 1 << 20  # positions over all live sequences
    max_tree_nodes: int = 256
    prefill_chunk: int = 512


@dataclass
class SequenceState:
    cache: SequenceCache
    length: int  # positions in the KV cache (committed)
    pending_token: int  # the root of the next verify
    sampling: SamplingParams
    taps: tuple[int, ...]
    feature_dtype: torch.dtype | None  # wire dtype of returned features (None = compute dtype)
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token (``token_logprobs``)


# One generated token's logprob under the target's sampling distribution, and the top alternatives:
# (id, logprob, [(id, logprob), ...]); see ``splitspec.spec.sampling.token_logprobs``.
TokenLogprob = tuple[int, float, list[tuple[int, float]]]
MAX_TOP_LOGPROBS = 20


@dataclass
class PrefillResult:
    next_token: int
    features: torch.Tensor | None  # [rows, taps * hidden]
    forward_ns: int
    logprob: TokenLogprob | None = None  # next_token's, when the prefill asked for logprobs


@dataclass
class VerifyResult:
    committed_tokens: list[int]  # root + accepted nodes' tokens
    accepted_nodes: list[int]  # 1-based node indices
    next_token: int
    features: torch.Tensor | None  # [len(committed_tokens), taps * hidden]
    committed_length: int
    forward_ns: int
    # When the sequence asked for logprobs: those of committed_tokens[1:] + [next_token], in order.
    logprobs: list[TokenLogprob] | None = None


class TargetEngine:
    def __init__(self, model: TargetModel, limits: TargetLimits | None = None, static: StaticVerifier | None = None) -> None:
        self.model = model
        self.config = model.config
        self.limits = limits or TargetLimits()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.sequences = SequenceTable()  # of SequenceState
        self.static = static  # fixed-shape (CUDA-graph) verify over pooled KV slots, when enabled

    @property
    def reserved_tokens(self) -> int:
        # A snapshot of the values: the metrics thread reads this while the engine thread runs.
        return sum(s.cache.capacity for s in list(self.sequences.values()))

    def _get(self, sequence_id: str) -> SequenceState:
        state = self.sequences.get(sequence_id)
        if state is None:
            raise NotFound(f"sequence_id {sequence_id!r} is not live on this target worker")
        return state

    def _check_taps(self, taps: Sequence[int]) -> tuple[int, ...]:
        for t in taps:
            if not 0 <= t < self.config.num_layers:
                raise InvalidArgument(f"tap_layer_ids: {t} is outside [0, {self.config.num_layers})")
        return tuple(taps)

    def prefill(
        self,
        sequence_id: str,
        tokens: Sequence[int],
        sampling: SamplingParams,
        taps: Sequence[int] = (),
        reserve_tokens: int = 0,
        feature_rows: int = 0,
        feature_dtype: torch.dtype | None = None,
        top_logprobs: int | None = None,
    ) -> PrefillResult:
        """``top_logprobs``: None = no logprobs (nothing extra computed, then or in this sequence's
        verifies); N >= 0 = return every generated token's logprob and its top N alternatives."""
        n = len(tokens)
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs: {top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]")
        if not sequence_id:
            raise InvalidArgument("sequence_id must not be empty")
        if sequence_id in self.sequences:
            raise FailedPrecondition(f"sequence_id {sequence_id!r} is already live")
        if n == 0:
            raise InvalidArgument("tokens must not be empty")
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidArgument(f"tokens: id {bad[0]} is outside [0, {self.config.vocab_size})")
        taps = self._check_taps(taps)
        capacity = max(reserve_tokens, n + 1)
        if capacity > self.config.max_context:
            raise InvalidArgument(f"reserve_tokens: {capacity} positions exceed the context length {self.config.max_context}")
        if len(self.sequences) >= self.limits.max_sequences:
            raise ResourceExhausted(f"{len(self.sequences)} sequences are live, the limit is {self.limits.max_sequences}")
        if self.reserved_tokens + capacity > self.limits.max_kv_tokens:
            raise ResourceExhausted(
                f"KV cache full: {self.reserved_tokens} of {self.limits.max_kv_tokens} positions reserved, {capacity} more asked"
            )
        # Opened until the sequence is live: a Release arriving meanwhile (or before) makes this
        # prefill end with ABORTED instead of leaving a sequence nobody will release.
        self.sequences.open(sequence_id)
        try:
            state, result = self._prefill(tokens, sampling, taps, capacity, feature_rows, feature_dtype, top_logprobs)
        except BaseException:
            self.sequences.abandon(sequence_id)
            raise
        self.sequences.finish(sequence_id, state)
        return result

    def _prefill(
        self,
        tokens: Sequence[int],
        sampling: SamplingParams,
        taps: tuple[int, ...],
        capacity: int,
        feature_rows: int,
        feature_dtype: torch.dtype | None,
        top_logprobs: int | None = None,
    ) -> tuple[SequenceState, PrefillResult]:
        n = len(tokens)
        t0 = time.perf_counter_ns()
        cache = (self.static and self.static.new_cache(capacity)) or self.model.new_cache(capacity, self.device, self.dtype)
        rows = n if feature_rows <= 0 else min(feature_rows, n)
        feature_chunks, logits = [], None
        graphed = isinstance(cache, PooledKVCache)
        chunk = min(self.limits.prefill_chunk, PREFILL_CHUNK) if graphed else self.limits.prefill_chunk
        for begin in range(0, n, chunk):
            end = min(n, begin + chunk)
            out = self.static.prefill(cache, tokens[begin:end], begin, taps) if graphed else None
            if out is None:
                positions = torch.arange(begin, end, device=self.device)
                mask = torch.arange(end, device=self.device)[None, :] <= positions[:, None]  # causal [T, end]
                last = torch.tensor([end - begin - 1], device=self.device) if end == n else torch.empty(0, dtype=torch.int64, device=self.device)
                ids = torch.tensor(tokens[begin:end], device=self.device, dtype=torch.int64)
                out = self.model(ids, positions, cache, begin, mask, taps, logit_rows=last)
            logits, features = out
            if features is not None and end > n - rows:
                # A copy where graphed: the pass's buffers are rewritten by its next replay.
                features = features[max(0, n - rows - begin) :]
                feature_chunks.append(features.clone() if graphed else features)
        next_token = int(draw_tokens(logits, torch.tensor([n], device=self.device), sampling)[0])
        features = torch.cat(feature_chunks).to(feature_dtype or self.dtype) if feature_chunks else None
        logprob = None
        if top_logprobs is not None:
            logprob = token_logprobs(logits[-1:], [next_token], sampling, top_logprobs)[0]
        state = SequenceState(cache, n, next_token, sampling, taps, feature_dtype, top_logprobs)
        return state, PrefillResult(next_token, features, time.perf_counter_ns() - t0, logprob)

    def verify(
        self, sequence_id: str, tokens: Sequence[int], parents: Sequence[int], return_features: bool = False
    ) -> VerifyResult:
        state = self._get(sequence_id)
        tokens_np = np.asarray(tokens, dtype=np.int64)
        parents_np = np.asarray(parents, dtype=np.int64)
        if len(tokens_np) or len(parents_np):  # a decode step (no tree) has nothing to check
            try:
                validate_tree(tokens_np, parents_np, self.config.vocab_size, self.limits.max_tree_nodes)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
        n, start = len(tokens_np), state.length
        if start + n + 1 > state.cache.capacity:
            raise FailedPrecondition(
                f"tokens: a tree of {n} nodes needs {start + n + 1} positions, sequence reserved {state.cache.capacity}"
            )
        t0 = time.perf_counter_ns()
        logits, features, positions = self.tree_forward(state, tokens_np, parents_np)
        target_tokens = draw_tokens(logits, positions, state.sampling).cpu().numpy()  # [n+1]
        accepted, next_token = accept_path(tokens_np, parents_np, target_tokens)
        state.cache.commit(start, accepted)
        committed = [state.pending_token] + [int(tokens_np[a - 1]) for a in accepted[1:]]
        logprobs = None
        if state.top_logprobs is not None:
            # Token i of committed[1:] + [bonus] was drawn at row accepted[i] (its parent's row). Read
            # now: a graphed pass's logits are rewritten by its next replay.
            rows = logits.index_select(0, torch.tensor(accepted, device=logits.device, dtype=torch.int64))
            logprobs = token_logprobs(rows, committed[1:] + [int(next_token)], state.sampling, state.top_logprobs)
        state.length = start + len(accepted)
        state.pending_token = int(next_token)
        out_features = None
        if return_features and features is not None:
            if accepted == list(range(len(accepted))):  # a decode step, or a first-child chain
                rows = features[: len(accepted)]
            else:
                rows = features.index_select(0, torch.tensor(accepted, device=self.device, dtype=torch.int64))
            # On the host now: a graphed pass's features are rewritten by its next replay.
            out_features = rows.to(state.feature_dtype or self.dtype).cpu()
        return VerifyResult(
            committed, accepted[1:], int(next_token), out_features, state.length, time.perf_counter_ns() - t0, logprobs
        )

    def tree_forward(
        self, state: SequenceState, tokens: np.ndarray, parents: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One pass over ``[root, nodes]``: logits [n+1, vocab], features [n+1, taps*hidden], positions [n+1]
        (on the host for the fixed-shape pass: a greedy step never reads them, and a copy to the
        device would wait for the pass).

        Writes the rows' K/V to slots ``length .. length + n`` and keeps every row's recurrent state
        candidate; ``cache.commit`` after the walk keeps the accepted ones.
        """
        n, start, dev = len(tokens), state.length, self.device
        row_tokens = [state.pending_token, *tokens.tolist()]  # [n+1]
        if n:
            positions = start + np.concatenate([[0], node_depths(parents)])  # [n+1] siblings share a position
            tree_mask = tree_attention_mask(parents)  # [n+1, n+1] ancestor-only
        else:  # a decode step
            positions, tree_mask = np.array([start]), np.ones((1, 1), dtype=bool)
        if isinstance(state.cache, PooledKVCache):
            out = self.static.forward(state.cache, row_tokens, positions, start, tree_mask, state.taps)
            if out is not None:
                return *out, torch.from_numpy(positions)
        ids = torch.tensor(row_tokens, device=dev, dtype=torch.int64)
        row_parents = torch.from_numpy(np.concatenate([[-1], parents])).to(dev)  # [n+1], node j is row j
        positions_t = torch.from_numpy(positions).to(dev)
        mask = torch.cat([torch.ones(n + 1, start, dtype=torch.bool, device=dev), torch.from_numpy(tree_mask).to(dev)], dim=1)
        logits, features = self.model(ids, positions_t, state.cache, start, mask, state.taps, parents=row_parents)
        return logits, features, positions_t
