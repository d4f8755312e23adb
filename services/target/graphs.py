"""Fixed-shape verify passes over preallocated KV slots, replayed as CUDA graphs.

Batch-1 decode on a GPU is bound by kernel launches long before it is bound by memory unless
the whole pass is one CUDA graph, and a graph replays fixed shapes at fixed addresses. So:

- **Slots.** A pool of ``slots`` KV caches of ``context`` positions each is allocated once;
  a sequence takes a slot at prefill (a :class:`PooledKVCache`, a view into the pool) and gives
  it back when nothing references its cache any more (release, TTL expiry or failure alike).
- **Rows.** The ``[root, nodes]`` block of a verify is padded up to a row bucket (budget 22 →
  24 rows). A pad row is token 0 at the root's position that sees only its own slot, written
  after the tree: it never sees or is seen by a real row, and a fully masked row would put NaN
  into the cache. Its K/V land in slots past the tree, which are rewritten before anyone can
  see them.
- **Span.** Attention reads the first ``span`` slots (a power of two ≥ 256 covering the block),
  masked, so one graph serves every start position up to its span.
- **Prefill.** A prompt runs as chunks of up to ``PREFILL_CHUNK`` rows, each a block whose mask is
  a chain (causal) padded to a prefill bucket, through passes that project only the chunk's last
  row to logits. Eagerly a prompt's ~800 kernels are launched one by one, and on the H100 host
  that took longer than running them (512 tokens: 30-43 ms eager, 17.7 ms of kernels).

One graph per (slot, rows, span, taps, prefill or verify) is captured on first use and replayed
after; graphs share one memory pool. On a CPU (``capture=False``) the same fixed-shape pass runs
eagerly, which is how CI tests this path.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.cuda_graphs import StagedInputs, attention_span, capture
from splitspec.models.dense import DenseForCausalLM, KVCache

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 264)  # 40 and 72 rows measured slower than 48 and 96 (cuBLAS tiles)
# Prompt chunks pad to few sizes: each (slot, size, span, taps) is a graph holding its own
# feature buffer (a 512-row chunk of five 4096-wide taps: 21 MB).
PREFILL_BUCKETS = (64, 128, 256, 512)
PREFILL_CHUNK = PREFILL_BUCKETS[-1]  # prompt rows per graphed pass


class PooledKVCache(KVCache):
    """A sequence's KV cache living in slot ``slot`` of a :class:`StaticVerifier`'s pool."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slot: int) -> None:
        super().__init__(k, v)
        self.slot = slot


def row_bucket(rows: int) -> int | None:
    """The padded row count of a block of ``rows`` rows, or None when it is larger than any bucket."""
    i = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[i] if i < len(ROW_BUCKETS) else None


def prefill_bucket(rows: int) -> int | None:
    """The padded row count of a prompt chunk of ``rows`` rows, or None above ``PREFILL_CHUNK``."""
    i = bisect.bisect_left(PREFILL_BUCKETS, rows)
    return PREFILL_BUCKETS[i] if i < len(PREFILL_BUCKETS) else None


@dataclass
class _Pass:
    """Static buffers of one captured shape: inputs are copied in, outputs read out."""

    rows: int
    span: int
    inputs: StagedInputs  # the head, then the tree
    last_only: bool = False  # a prefill chunk's pass: logits of the last real row only
    logits: torch.Tensor | None = None  # [rows, vocab] float32, or [1, vocab] when last_only
    features: torch.Tensor | None = None  # [rows, taps * hidden]
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def head(self) -> torch.Tensor:
        """[2 + 2 * rows] int64: start, token ids, positions, last real row."""
        return self.inputs.on_device[: 8 * (2 + 2 * self.rows)].view(torch.int64)

    @property
    def tree(self) -> torch.Tensor:
        """[rows, rows] bool: the block's own visibility, pad rows on the diagonal."""
        return self.inputs.on_device[8 * (2 + 2 * self.rows) :].view(torch.bool).view(self.rows, self.rows)

    @classmethod
    def allocate(cls, rows: int, span: int, device: torch.device, last_only: bool) -> _Pass:
        return cls(rows, span, StagedInputs.allocate(8 * (2 + 2 * rows) + rows * rows, device), last_only)

    def write(self, start: int, tokens: Sequence[int], positions: np.ndarray, tree_mask: np.ndarray) -> None:
        """Fill the inputs of a block of ``len(tokens)`` real rows: pad rows are token 0 at
        ``start`` seeing only themselves."""
        n, rows = len(tokens), self.rows
        raw = self.inputs.writable()
        head = raw[: 8 * (2 + 2 * rows)].view(np.int64)
        head[0] = start
        head[1 : 1 + n] = tokens
        head[1 + n : 1 + rows] = 0
        head[1 + rows : 1 + rows + n] = positions
        head[1 + rows + n : 1 + 2 * rows] = start
        head[-1] = n - 1
        tree = raw[8 * (2 + 2 * rows) :].view(np.bool_).reshape(rows, rows)
        tree[:] = np.eye(rows, dtype=bool)
        tree[:n, :n] = tree_mask
        self.inputs.upload()


class StaticVerifier:
    def __init__(self, model: DenseForCausalLM, slots: int, context: int, capture: bool) -> None:
        c = model.config
        param = next(model.parameters())
        self.model, self.device, self.context, self.capture = model, param.device, context, capture
        shape = (c.num_layers, slots, c.num_kv_heads, context, c.head_dim)
        self._k = torch.zeros(shape, device=self.device, dtype=param.dtype)
        self._v = torch.zeros(shape, device=self.device, dtype=param.dtype)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()  # slots come back from whichever thread drops the last reference
        self._passes: dict[tuple[int, int, int, tuple[int, ...], bool], _Pass] = {}  # (slot, rows, span, taps, last_only)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._cols = torch.arange(context, device=self.device)

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def graphs(self) -> int:
        return sum(p.graph is not None for p in self._passes.values())

    def new_cache(self, capacity: int) -> PooledKVCache | None:
        """A pooled cache of ``context`` positions, or None when none is free or it is too short."""
        if capacity > self.context:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        cache = PooledKVCache(self._k[:, slot], self._v[:, slot], slot)
        weakref.finalize(cache, self._give_back, slot)
        return cache

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def forward(
        self,
        cache: PooledKVCache,
        tokens: Sequence[int],  # [n + 1] root first
        positions: np.ndarray,  # [n + 1] absolute positions
        start: int,  # slot of the root
        tree_mask: np.ndarray,  # [n + 1, n + 1] bool, ancestor-only
        taps: tuple[int, ...],
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits [n + 1, vocab] (with ``last_only``, [1, vocab] of the last row) and features
        [n + 1, taps * hidden] of one block, or None when the block fits no bucket (the caller
        runs the eager pass instead). The results are the pass's own buffers: the next replay of
        the same shape rewrites them."""
        n_rows = len(tokens)
        rows = prefill_bucket(n_rows) if last_only else row_bucket(n_rows)
        if rows is None or start + rows > self.context:
            return None
        span = min(attention_span(start + rows), self.context)
        key = (cache.slot, rows, span, taps, last_only)
        p = self._passes.get(key)
        fresh = p is None
        if fresh:
            if not last_only:
                self._make_smaller(cache, start, rows, taps)
            p = self._passes[key] = _Pass.allocate(rows, span, self.device, last_only)
        p.write(start, tokens, positions, tree_mask)
        self._run(cache, p, taps, fresh)
        features = None if p.features is None else p.features[:n_rows]
        return (p.logits if last_only else p.logits[:n_rows]), features

    def _run(self, cache: PooledKVCache, p: _Pass, taps: tuple[int, ...], fresh: bool) -> None:
        """The pass over the inputs written: captured on first use, replayed after (eager on a CPU)."""
        if not self.capture:
            p.logits, p.features = self._compute(cache, p, taps)
        elif fresh:
            t0 = time.perf_counter()
            p.graph, (p.logits, p.features) = capture(lambda: self._compute(cache, p, taps), self.device, self._pool)
            logger.info(
                "captured the %s graph of slot %d: %d rows over %d slots, taps %s, in %.0f ms (%d graphs)",
                "prefill" if p.last_only else "verify", cache.slot, p.rows, p.span, list(taps),
                1e3 * (time.perf_counter() - t0), self.graphs,
            )
        else:
            p.graph.replay()

    def _make_smaller(self, cache: PooledKVCache, start: int, rows: int, taps: tuple[int, ...]) -> None:
        """Make the verify passes of every smaller row bucket at ``start`` as well, so that the
        sequence's later, smaller trees (near ``max_tokens``, a shallow draft) find their graph
        ready instead of capturing one mid-stream (36-146 ms each on an H100 with Triton's cache
        warm). They run first: their K/V land in slots that the pass of ``rows`` then rewrites."""
        for bucket in ROW_BUCKETS[: ROW_BUCKETS.index(rows)]:
            span = min(attention_span(start + bucket), self.context)
            key = (cache.slot, bucket, span, taps, False)
            if key not in self._passes:
                p = self._passes[key] = _Pass.allocate(bucket, span, self.device, False)
                p.write(start, [0], np.array([start]), np.ones((1, 1), dtype=bool))
                self._run(cache, p, taps, fresh=True)

    def prefill(
        self, cache: PooledKVCache, tokens: Sequence[int], start: int, taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits [1, vocab] of the last of ``tokens`` (positions ``start ..``, one chunk of at most
        ``PREFILL_CHUNK`` rows, padded to a ``PREFILL_BUCKETS`` size) and features [len(tokens),
        taps * hidden]; None when the chunk fits no pass (the caller runs it eagerly)."""
        n = len(tokens)
        chain = np.tril(np.ones((n, n), dtype=bool))  # causal: a chain is a tree of one path
        return self.forward(cache, tokens, start + np.arange(n), start, chain, taps, last_only=True)

    def _compute(self, cache: KVCache, p: _Pass, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass itself, from the static inputs only (so that it can be captured)."""
        start, ids, positions = p.head[0], p.head[1 : 1 + p.rows], p.head[1 + p.rows : 1 + 2 * p.rows]
        slots = start + self._cols[: p.rows]  # [rows]
        cols = self._cols[: p.span]  # [span]
        offset = cols - start  # column of slot `cols` inside the block
        inside = (offset >= 0) & (offset < p.rows)
        mask = (cols < start)[None, :] | (inside[None, :] & p.tree[:, offset.clamp(0, p.rows - 1)])  # [rows, span]
        return self.model(ids, positions, cache, slots, mask, taps, logit_rows=p.head[-1:] if p.last_only else None)
