"""OracleDrafter — FOR BENCHMARKS AND TESTS ONLY, never for serving users.

It proposes continuations it was told in advance: a JSONL table whose lines are
``{"tokens": [prompt..., continuation...]}``, usually the target's own output recorded with
speculation off. Each depth's true token is corrupted with probability ``corruption``: it is
replaced at rank 0 by another token and either moved to rank 1 (a DDTree branch can still find
it) or dropped. That drives the whole gateway -> draft -> target path at a chosen acceptance
length, and exercises acceptance, rejection and branching deterministically. It runs no model and
asks the target for no tap features, so its rounds are cheaper than a real draft's: a benchmark
times a real-shaped DFlash draft beside it for the true round (splitspec/bench/system.py).

With ``selector`` it answers as a DFlash2 draft (``splitspec.models.dflash2``): pair scores are the
depth's log-probabilities plus ``SELECTOR_BONUS`` on each edge from the true token to the true token
of the next depth (from the anchor at depth 1), so a lattice walk finds a corrupted depth's true
token wherever it is still a candidate and a tree grown by pair scores differs from one grown by
log-probabilities alone.

The table is re-read when its file changes, so a harness can record references first and then
serve them without restarting the worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from services.draft.engine import Proposal, ProposeStep
from services.worker.hosting import SequenceTable
from splitspec.errors import InvalidArgument, ServiceError


class OracleTable:
    HEAD = 16  # sequences are indexed by their first HEAD tokens (a prompt's): a lookup compares few

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self._sequences: list[list[int]] = []
        self._by_head: dict[tuple[int, ...], list[list[int]]] = {}  # in file order

    def _refresh(self) -> None:
        mtime = self.path.stat().st_mtime if self.path.exists() else None
        if mtime != self._mtime:
            text = self.path.read_text() if mtime is not None else ""
            self._sequences = [json.loads(line)["tokens"] for line in text.splitlines() if line.strip()]
            self._by_head = {}
            for seq in self._sequences:
                self._by_head.setdefault(tuple(seq[: self.HEAD]), []).append(seq)
            self._mtime = mtime

    def continuation(self, history: list[int]) -> list[int]:
        """Tokens that followed ``history`` in the first recorded sequence extending it, or []."""
        self._refresh()
        n = len(history)
        # A sequence extending a history of HEAD tokens or more starts with the same HEAD tokens.
        candidates = self._by_head.get(tuple(history[: self.HEAD]), []) if n >= self.HEAD else self._sequences
        for seq in candidates:
            if len(seq) > n and seq[:n] == history:
                return seq[n:]
        return []


SELECTOR_BONUS = 3.0  # added to a true-to-true edge's pair score (``selector``)


class OracleDrafter:
    """Same interface as ``DraftEngine``; needs token ids, not tap features."""

    target_layer_ids: tuple[int, ...] = ()  # asks the target for no features
    mask_token_id = 0
    num_layers = 0

    def __init__(
        self, table: OracleTable, vocab_size: int, block_size: int = 16, corruption: float = 0.0, max_top_k: int = 64,
        delay_s: float = 0.0, selector: bool = False,
    ) -> None:
        if not 0.0 <= corruption <= 1.0:
            raise ValueError(f"--corruption {corruption} must be in [0, 1]")
        self.table, self.vocab_size, self.block_size = table, vocab_size, block_size
        self.corruption, self.max_top_k = corruption, max_top_k
        self.delay_s = delay_s  # a slow drafter, for deadline tests
        self.selector_top_k = 8 if selector else 0  # as DraftEngine's: a DFlash2 draft's advertised top-K
        self.sequences = SequenceTable()  # of token histories
        self._tiles: dict[tuple[int, int], np.ndarray] = {}  # (top_k, depth) -> _rank_tile

    @property
    def context_bytes(self) -> int:
        return sum(8 * len(h) for h in self.sequences.values())  # what the histories hold, roughly

    def pins(self, features) -> bool:
        return False  # it reads no features (DraftEngine.pins)

    def propose_batch(self, steps: list[ProposeStep]) -> list[Proposal | ServiceError]:
        """The steps of a pass, each on its own (no forward pass to share); ``--delay`` per step, as a
        drafter whose pass grows with its batch (a deadline test's blockers make a late pass)."""
        t0 = time.perf_counter_ns()
        if self.delay_s:
            time.sleep(self.delay_s * len(steps))
        results: list[Proposal | ServiceError] = []
        for step in steps:
            try:
                results.append(self._propose(step))
            except ServiceError as exc:
                results.append(exc)
        elapsed = time.perf_counter_ns() - t0
        for result in results:
            if isinstance(result, Proposal):
                result.forward_ns, result.pass_sequences = elapsed, len(steps)
        return results

    def propose(
        self, sequence_id: str, anchor_token: int, anchor_position: int, features, top_k: int, window: int = 0, tokens=(),
        context: int = 0, depths: int = 0,
    ) -> Proposal:
        step = ProposeStep(sequence_id, anchor_token, anchor_position, features, top_k, window, tokens, context, depths)
        result = self.propose_batch([step])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _propose(self, step: ProposeStep) -> Proposal:
        sequence_id, anchor_token, anchor_position, top_k = step.sequence_id, step.anchor_token, step.anchor_position, step.top_k
        context, tokens = step.context, step.tokens
        if not 1 <= top_k <= min(self.max_top_k, self.vocab_size - 1):
            raise InvalidArgument(f"top_k: {top_k} is outside [1, {min(self.max_top_k, self.vocab_size - 1)}]")
        if step.depths < 0:
            raise InvalidArgument(f"depths: {step.depths} must be >= 0")
        history = self.sequences.claim(sequence_id, context, list)
        history.extend(tokens)
        if len(history) != anchor_position:
            raise InvalidArgument(f"tokens: history has {len(history)} positions, anchor_position is {anchor_position}")
        depth = self.block_size - 1
        truth = self.table.continuation(history + [anchor_token])[:depth]
        rng = np.random.default_rng([anchor_position, len(truth), anchor_token])
        true = np.empty(depth, dtype=np.int64)
        corrupted: list[tuple[int, int, bool]] = []  # (depth, wrong token, true token kept at rank 1)
        for d in range(depth):  # the draws, in the order that fixes each row's corruption
            true[d] = truth[d] if d < len(truth) else int(rng.integers(self.vocab_size))
            if rng.random() < self.corruption:
                wrong = (int(true[d]) + 1 + int(rng.integers(self.vocab_size - 1))) % self.vocab_size
                corrupted.append((d, wrong, bool(rng.random() < 0.5)))
        # Rank 0 the true token, then the tokens after it: one array op for every clean row.
        ids = ((true[:, None] + np.arange(top_k)) % self.vocab_size).astype(np.int32)  # [depth, K]
        for d, wrong, kept in corrupted:
            ranked = [wrong, int(true[d])] if kept else [wrong]
            others = (int(true[d]) + 1 + np.arange(top_k + 2)) % self.vocab_size  # enough to fill the ranks
            ranked += [int(t) for t in others if t not in ranked][: top_k - len(ranked)]
            ids[d] = ranked[:top_k]
        logprobs = self._rank_tile(top_k, depth)  # [depth, K]
        pairs = None
        if self.selector_top_k:
            on_path = ids == true[:, None]  # [depth, K]: the true token among each depth's candidates
            after = np.concatenate([np.ones((1, top_k), bool), on_path[:-1]])  # [depth, K]: predecessor a on the path
            pairs = torch.from_numpy((logprobs[:, None, :] + SELECTOR_BONUS * (after[:, :, None] & on_path[:, None, :])).astype(np.float32))
        cut = step.depths or depth  # every depth is drawn above, so a row does not depend on how many are asked for
        return Proposal(torch.from_numpy(ids[:cut]), torch.from_numpy(logprobs[:cut]), 0, pair_scores=None if pairs is None else pairs[:cut])

    def _rank_tile(self, top_k: int, depth: int) -> np.ndarray:
        """``[depth, K]``: :meth:`_rank_logprobs` at every depth, a copy of one made once per shape."""
        tile = self._tiles.get((top_k, depth))
        if tile is None:
            tile = self._tiles[top_k, depth] = np.tile(self._rank_logprobs(top_k), (depth, 1))
        return tile.copy()

    def _rank_logprobs(self, top_k: int) -> np.ndarray:
        """``[K]`` float32: the probability that the true token sits at each rank, as the corruption
        draws it (rank 0 with 1 - p; rank 1 with p / 2, a corrupted row that kept it; the rest share
        the p / 2 of rows that lost it), the same at every depth and whatever the row: a tree built
        from them, and an adaptive budget reading them, see what a calibrated draft would show."""
        p = self.corruption
        probs = np.full(top_k, p / 2 / max(1, top_k - 2))
        probs[0] = 1 - p
        if top_k > 1:
            probs[1] = p / 2
        # A draft ranks by its own probabilities: never more likely further down (p > 2/3 would be).
        return np.log(np.maximum(np.minimum.accumulate(probs), 1e-6)).astype(np.float32)
