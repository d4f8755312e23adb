"""Target engine: per-sequence KV caches, prefill, one-pass tree verify, acceptance, compaction.

Terms (see ``splitspec.spec.tree``): the *root* is the pending token drawn last step (not yet in
the KV cache); a verify pass runs ``[root, nodes]`` at positions ``length + depth`` with an
ancestor-only mask, draws the target's own token at every row, walks the tree, compacts the
accepted rows' K/V down to ``length ..``, and returns the *committed* tokens (root + accepted
nodes) and the *bonus* (the target's token after the last accepted node: the next root).

Not thread-safe: the service calls it from one worker thread, which serialises device work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from splitspec.models.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM
from splitspec.spec.acceptance import accept_path, compact_rows
from splitspec.spec.sampling import SamplingParams, draw_tokens
from splitspec.spec.tree import node_depths, tree_attention_mask, validate_tree


@dataclass
class TargetLimits:
    max_sequences: int = 64
    max_kv_tokens: int = 1 << 20  # positions over all live sequences
    max_tree_nodes: int = 256
    prefill_chunk: int = 512


@dataclass
class SequenceState:
    cache: KVCache
    length: int  # positions in the KV cache (committed)
    pending_token: int  # the root of the next verify
    sampling: SamplingParams
    taps: tuple[int, ...]
    feature_dtype: torch.dtype | None  # wire dtype of returned features (None = compute dtype)
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PrefillResult:
    next_token: int
    features: torch.Tensor | None  # [rows, taps * hidden]
    forward_ns: int


@dataclass
class VerifyResult:
    committed_tokens: list[int]  # root + accepted nodes' tokens
    accepted_nodes: list[int]  # 1-based node indices
    next_token: int
    features: torch.Tensor | None  # [len(committed_tokens), taps * hidden]
    committed_length: int
    forward_ns: int


class TargetEngine:
    def __init__(self, model: Qwen3ForCausalLM, limits: TargetLimits | None = None) -> None:
        self.model = model
        self.config: Qwen3Config = model.config
        self.limits = limits or TargetLimits()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.sequences: dict[str, SequenceState] = {}

    @property
    def reserved_tokens(self) -> int:
        # A snapshot of the values: the metrics thread reads this while the engine thread runs.
        return sum(s.cache.capacity for s in list(self.sequences.values()))

    def _get(self, sequence_id: str) -> SequenceState:
        state = self.sequences.get(sequence_id)
        if state is None:
            raise NotFound(f"sequence_id {sequence_id!r} is not live on this target worker")
        state.last_used = time.monotonic()
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
    ) -> PrefillResult:
        n = len(tokens)
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
        t0 = time.perf_counter_ns()
        cache = KVCache(self.config, capacity, self.device, self.dtype)
        ids = torch.tensor(tokens, device=self.device, dtype=torch.int64)
        rows = n if feature_rows <= 0 else min(feature_rows, n)
        feature_chunks, logits = [], None
        chunk = self.limits.prefill_chunk
        for begin in range(0, n, chunk):
            end = min(n, begin + chunk)
            positions = torch.arange(begin, end, device=self.device)
            mask = torch.arange(end, device=self.device)[None, :] <= positions[:, None]  # causal [T, end]
            last = torch.tensor([end - begin - 1], device=self.device) if end == n else torch.empty(0, dtype=torch.int64, device=self.device)
            logits, features = self.model(ids[begin:end], positions, cache, begin, mask, taps, logit_rows=last)
            if features is not None and end > n - rows:
                feature_chunks.append(features[max(0, n - rows - begin) :])
        next_token = int(draw_tokens(logits, torch.tensor([n], device=self.device), sampling)[0])
        features = torch.cat(feature_chunks).to(feature_dtype or self.dtype) if feature_chunks else None
        self.sequences[sequence_id] = SequenceState(cache, n, next_token, sampling, taps, feature_dtype)
        return PrefillResult(next_token, features, time.perf_counter_ns() - t0)

    def verify(
        self, sequence_id: str, tokens: Sequence[int], parents: Sequence[int], return_features: bool = False
    ) -> VerifyResult:
        state = self._get(sequence_id)
        tokens_np = np.asarray(tokens, dtype=np.int64)
        parents_np = np.asarray(parents, dtype=np.int64)
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
        index = torch.tensor(accepted, device=self.device, dtype=torch.int64)
        compact_rows(state.cache.k, start, index)
        compact_rows(state.cache.v, start, index)
        committed = [state.pending_token] + [int(tokens_np[a - 1]) for a in accepted[1:]]
        state.length = start + len(accepted)
        state.pending_token = int(next_token)
        out_features = None
        if return_features and features is not None:
            out_features = features.index_select(0, index).to(state.feature_dtype or self.dtype)
        return VerifyResult(committed, accepted[1:], int(next_token), out_features, state.length, time.perf_counter_ns() - t0)

    def tree_forward(
        self, state: SequenceState, tokens: np.ndarray, parents: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One pass over ``[root, nodes]``: logits [n+1, vocab], features [n+1, taps*hidden], positions [n+1].

        Writes the rows' K/V to slots ``length .. length + n`` (compaction happens after the walk).
        """
        n, start, dev = len(tokens), state.length, self.device
        ids = torch.tensor([state.pending_token, *tokens.tolist()], device=dev, dtype=torch.int64)  # [n+1]
        depths = torch.from_numpy(np.concatenate([[0], node_depths(parents)])).to(dev)  # [n+1]
        positions = start + depths  # siblings share a position
        tree_mask = torch.from_numpy(tree_attention_mask(parents)).to(dev)  # [n+1, n+1] ancestor-only
        mask = torch.cat([torch.ones(n + 1, start, dtype=torch.bool, device=dev), tree_mask], dim=1)
        logits, features = self.model(ids, positions, state.cache, start, mask, state.taps)
        return logits, features, positions

    def release(self, sequence_id: str) -> bool:
        return self.sequences.pop(sequence_id, None) is not None

    def expire_idle(self, max_idle_s: float) -> list[str]:
        """Release sequences nobody touched for ``max_idle_s`` seconds; returns their ids."""
        now = time.monotonic()
        stale = [sid for sid, s in self.sequences.items() if now - s.last_used > max_idle_s]
        for sid in stale:
            del self.sequences[sid]
        return stale
