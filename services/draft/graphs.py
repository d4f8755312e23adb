"""The draft's block pass (16 rows, the target's LM head, top-K) replayed as CUDA graphs.

Eagerly, a 5-layer draft of an 8B target spends most of a proposal launching ~200 small kernels.
A graph needs fixed shapes and addresses, so:

- a sequence's context K/V (a ``ContextCache``) lives in one of ``sequences`` slots of
  ``context`` positions and is never regrown while it fits. A sequence that finds every slot
  taken grows its own storage and runs eagerly until a slot frees: it is seated then, its keys
  and values copied in (``seat``), so a burst of arrivals does not leave sequences on the eager
  pass for their whole lives; one that outgrows its slot gives it back at once. The slots are
  regions of one pool per layer, K and V each ``[H_kv, sequences * context + B, D]`` (slot
  ``i`` is positions ``i * context ..``; the last ``B`` positions are a scratch region for pad
  rows), allocated when the first sequence is seated;
- a pass attends over the first ``span`` positions of a slot (a power of two covering the filled
  ones) with a mask of the visible ones (``[first, end)``: a draft window hides the older ones);
- the anchor token and positions are read from a static buffer inside the graph;
- the block's own keys and values are written to the ``B`` positions after the context
  (rewritten by the next append), so attention reads one cache instead of a concatenation;
- the context append (``fc`` of the new tap features and every layer's K/V of them) runs inside
  the same graph for up to ``B`` new rows. Larger appends (a prompt) run eagerly before a
  block-only pass.

A pass (``run_batch``) of S sequences, one alone included: one graph per (S, span, top-K values,
append) with S padded (``padded_batch``: a power of two up to 8, then a multiple of 4, then of
16), serving *any* S slots: the slot of each sequence is an input, so the warm-up captures every
graph before a sequence arrives. Every sequence's block rows, appended rows (packed, at most
``B`` each, pad rows written to the scratch region) and key positions are addressed through
pool indices computed from that input (``DFlashDraft.forward_pooled``); a pad sequence's block
lives in the scratch region and sees only its own keys. Attention reads each sequence's keys in place through the native paged kernel
(``native/paged_attention.py``: a slot is one page, the block table ``[slot]``, and the kernel
stops at each sequence's own end, so a short context next to a long one costs little), or, where
it does not run, gathers ``[S, H_kv, span, D]`` (torch). A span is the batch's longest; the
top-K runs once per distinct top_k over all rows (a row's top-K does not depend on the others).

Measured (scripts/gpu_draft_batch.py, H200, 8B-shaped bf16 draft, contexts ~900, 4 new host
feature rows per sequence a step, top-8; ms per ``propose_batch`` with staging and copies back):

    S                              1      2      4      8      16     32
    batched graph, paged kernel    -      1.61   1.72   2.31   3.06   5.90
    batched graph, torch gather    -      1.71   2.10   2.76   4.40   8.45
    eager batched pass             -      8.23   9.59   9.87   12.6   18.7
    S x a slot's own graph         1.21   2.42   4.84   9.67   19.3   38.7

so the kernel is the batched path's attention (the gather where it does not run: a CPU, float64,
``SPLITSPEC_NATIVE_OFF=paged_attention``). Batched against alone, 6 sequences over 11 steps:
every top-8 id equal; log-probs within 1.5e-3 in float32 and within one bfloat16 step of the
logits (1.0 at random weights' logits of ~200) in bfloat16. One sequence used to run in a graph
of its slot's own (over views of the slot, one graph per slot, span and kind, captured at its
first pass while serving: 17-34 captures, 1.3-2.4 s, in a 32-user bench); on an H100 the
pass of one sequence took 1.69, 1.70 ms against 1.58, 1.63 in its slot's graph, and at 32 users
without those captures the measured round was 62-65 against 83-99 ms (BENCHMARKS.md [S21]).

Why slots in one pool rather than the target's block-paged pool: a draft context is short and
bounded by the draft window (or ``context``), appended by at most a block a step and compacted
in place, so fixed regions need no block tables, no allocator and no copy on compaction; yet the
pool layout is the paged one with a page of ``context`` positions, so the pass reuses the paged
attention kernel.

Without ``capture`` (a CPU) the same fixed-shape passes run eagerly, which is how CI tests them.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from native import top_k as native_top_k
from native import use_triton
from services.worker.cuda_graphs import WARM_SPANS, StagedInputs, attention_span, capture
from splitspec.models.dflash import DFlashDraft, PooledAttention
from splitspec.models.quantized import embedding_rows, head_logits

logger = logging.getLogger(__name__)


def top_k_log_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] -> top-K ids [R, K] int32 and log-probs [R, K] float32, each row on its own."""
    if use_triton(logits, "top_k") and native_top_k.supported(logits, top_k):
        return native_top_k.top_k_log_softmax(logits, top_k)
    return native_top_k.top_k_log_softmax_reference(logits, top_k)


def top_k_of(hidden: torch.Tensor, lm_head: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block hidden states [B, hidden] -> per-depth top-K ids [B-1, K] int32 and log-probs [B-1, K]
    float32 (row 0 is the anchor's)."""
    return top_k_log_softmax(head_logits(hidden[1:], lm_head), top_k)  # logits [B-1, vocab]


def top_k_proposal(
    model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
    context: list[tuple[torch.Tensor, torch.Tensor]], top_k: int, depths: int = 0,
) -> tuple[torch.Tensor, ...]:
    """One eager block pass over ``context`` (per layer (k, v) [H_kv, S, D]): top-K ids [D, K]
    int32 and log-probs [D, K] float32, then for a DFlash2 draft its pair scores [D, K, K], for
    depths 1..D (``depths``; 0: all, D = B-1)."""
    hidden = model(embedding_rows(embed, block).to(model.norm.weight.dtype), positions, context)  # [B, hidden]
    return proposals_of(model, hidden[None, 1:], lm_head, block[:1], [top_k], [depths])[0]


def top_k_proposals(
    model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor,
    contexts: list[list[tuple[torch.Tensor, torch.Tensor]]], top_ks: list[int], depths: list[int] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`top_k_proposal` of S sequences in one eager pass (``DFlashDraft.forward_batch``):
    ``anchors`` and ``anchor_positions`` [S] int64, ``contexts`` per sequence, per layer (k, v)
    [H_kv, n_s, D], ``depths`` per sequence (default: all). Returns per sequence what
    :func:`top_k_proposal` returns."""
    c = model.config
    rows = torch.arange(c.block_size, device=anchors.device)  # [B]
    blocks = torch.where(rows == 0, anchors[:, None], c.mask_token_id)  # [S, B]: anchor, MASK × (B-1)
    hidden = model.forward_batch(embedding_rows(embed, blocks).to(model.norm.weight.dtype), anchor_positions[:, None] + rows, contexts)  # [S, B, hidden]
    return proposals_of(model, hidden[:, 1:], lm_head, anchors, top_ks, depths)


@torch.inference_mode()
def proposals_of(
    model: DFlashDraft, rows: torch.Tensor, lm_head: torch.Tensor, anchors: torch.Tensor, top_ks: list[int],
    depths: list[int] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """S blocks' draft rows [S, B-1, hidden] -> per block its top-K ids [D_s, K_s] int32 and
    log-probs [D_s, K_s] float32, and a DFlash2 draft's pair scores [D_s, K_s, K_s] float32 of
    those candidates after ``anchors`` [S] (``CandidateSelector.pair_scores``), for depths
    1..D_s (``depths``, 0 or none: B-1).

    The LM head and the top-K run over the rows of the deepest depth asked for only: on the
    2-core CPU they took 4.0 of the built-in draft's 10.6 ms one-sequence pass, and a tree of 3
    nodes reads 3 of its 15 depths (BENCHMARKS.md, [P13] and [D7]). Each depth's row is its
    own, whatever the others (every part is per row).

    The top-K runs once per distinct K over the rows of the sequences asking for it, not once
    with the largest K sliced: ``torch.topk`` orders tied values differently for different K, and
    each row must come out as it would alone."""
    cut = [d or rows.shape[1] for d in depths] if depths else [rows.shape[1]] * len(top_ks)  # D_s
    rows = rows[:, : max(cut)]  # [S, D, hidden]
    # One [S * D, hidden] matmul: a 3-D operand would run as a batched matmul over the
    # broadcast LM head (H200, S=32, vocab 152k: 9 ms against well under one).
    logits = head_logits(rows.flatten(0, 1), lm_head).unflatten(0, rows.shape[:2])  # [S, D, vocab]
    selector = getattr(model, "candidate_selector", None)
    if selector is not None:
        logits = model.draft_logits(logits)
    out: list[tuple[torch.Tensor, ...]] = [None] * len(top_ks)  # type: ignore[list-item]
    for k in sorted(set(top_ks)):
        members = [s for s, ks in enumerate(top_ks) if ks == k]
        everyone = len(members) == len(top_ks)
        chosen = logits if everyone else logits[members]  # [S_k, D, vocab]
        ids, logprobs = (t.unflatten(0, chosen.shape[:2]) for t in top_k_log_softmax(chosen.flatten(0, 1), k))  # [S_k, D, K]
        parts: tuple[torch.Tensor, ...] = (ids, logprobs)
        if selector is not None:
            parts += (selector.pair_scores(rows if everyone else rows[members], logprobs, ids, anchors if everyone else anchors[members]),)
        for j, s in enumerate(members):
            out[s] = tuple(part[j, : cut[s]] for part in parts)
    return out


@dataclass
class BatchItem:
    """One sequence of a pass (:meth:`BlockGraphs.run_batch`)."""

    cache: object  # its ContextCache, in a slot
    anchor_token: int
    anchor_position: int
    first: int  # first visible context position (a draft window)
    top_k: int
    features: torch.Tensor | None = None  # [m, taps * hidden], m <= B: appended in the pass
    feature_position: int = 0  # the absolute position of features[0]


@dataclass
class _WarmUpContext:
    """What a batched pass reads of a sequence's context (its slot and filled positions), for
    :meth:`BlockGraphs.warm_up`'s passes, which no sequence owns."""

    slot: int
    size: int


@dataclass
class BatchInputs:
    """The static inputs of every batched pass of S (padded) sequences, shared by their graphs
    (passes replay one at a time): ``head`` [S, BATCH_HEAD] int64, then the appended rows' pool
    slots and positions [2, S * B] int64, then their features [S * B, taps * hidden], packed:
    the real rows first."""

    staged: StagedInputs
    sequences: int
    rows: int  # S * B
    width: int
    feature_dtype: torch.dtype

    @property
    def head(self) -> torch.Tensor:
        return self.staged.on_device[: 8 * BATCH_HEAD * self.sequences].view(torch.int64).view(self.sequences, BATCH_HEAD)

    @property
    def _rows_at(self) -> int:
        return 8 * BATCH_HEAD * self.sequences

    @property
    def row_index(self) -> torch.Tensor:
        """[2, S * B]: pool slot and position of each appended row."""
        return self.staged.on_device[self._rows_at : self._rows_at + 16 * self.rows].view(torch.int64).view(2, self.rows)

    @property
    def features(self) -> torch.Tensor:
        return self.staged.on_device[self._rows_at + 16 * self.rows :].view(self.feature_dtype).view(self.rows, self.width)


# head per sequence: anchor token, anchor position, first visible position, end of the context
# (the block's first position), slot (the scratch region's number for a pad sequence).
BATCH_HEAD = 5


def padded_batch(sequences: int) -> int:
    """The number of sequences a batched pass of ``sequences`` runs as (the rest pad sequences):
    a power of two up to 8 (one alone), then a multiple of 4 up to 32, then of 16. A pad sequence
    costs its block's rows in every matmul and in the top-K: at the 8B shape on an H200, 18
    sequences ran in 4.16 ms as 20 against 5.44 ms as 32, and 12 in 2.92 ms against 3.69 as 16
    (BENCHMARKS.md, [D6]). Each size is a graph per span and top-K set, captured at warm-up."""
    if sequences <= 8:
        return 1 << (sequences - 1).bit_length()
    step = 4 if sequences <= 32 else 16
    return -(-sequences // step) * step


class BlockGraphs:
    """``sequences`` context slots of ``context`` positions each, and the graphs captured over them.

    A sequence is seated in a free slot (its ``ContextCache`` stores into the slot's region of the
    pool) and gives it back when it is garbage or outgrows it. Graphs belong to the (padded) number
    of sequences in a pass, not to a sequence or a slot: after warm-up no request pays for a capture.
    """

    def __init__(
        self, model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, context: int, sequences: int, capture: bool
    ) -> None:
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.context, self.sequences, self.capture = context, sequences, capture
        self.device = model.norm.weight.device
        self.uncaptured: set[tuple] = set()  # keys of passes whose capture failed: they run eagerly
        self._lock = threading.Lock()  # slots come back on whichever thread drops the last reference
        self._free = list(range(sequences - 1, -1, -1))
        self.pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v) [H_kv, sequences * context + B, D]
        # (S, span, top-K values, append) -> (graph, outputs per top-K value)
        self._batch_passes: dict[tuple[int, int, tuple[int, ...], bool], tuple[torch.cuda.CUDAGraph, list]] = {}
        self._batch_inputs: dict[int, BatchInputs] = {}  # S -> inputs
        self.batch_shapes: set[tuple[int, int, tuple[int, ...], bool]] = set()  # batched shapes run so far
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        b = model.config.block_size
        self._rows = torch.arange(b, device=self.device)
        self._cols = torch.arange(context, device=self.device)

    @property
    def scratch(self) -> int:
        """The scratch region's number: its positions follow the last slot's."""
        return self.sequences

    def seat(self, cache, rows: int) -> bool:
        """Gives ``cache`` (a ``ContextCache`` holding no slot) a free slot when one is free and its
        filled positions, ``rows`` new ones and a block fit: its keys and values are copied into the
        slot's region (on the device's stream, before any later pass reads them) and it stores there
        from now on. The slot comes back when ``cache`` is garbage or outgrows it
        (``ContextCache.append``). Returns whether it was seated."""
        if cache.slot is not None or cache.size + rows + self.model.config.block_size > self.context:
            return False
        with self._lock:
            if not self._free:
                return False
            slot = self._free.pop()
        self._allocate_pool()
        region = slice(slot * self.context, (slot + 1) * self.context)
        k, v = [k[:, region] for k, _ in self.pool], [v[:, region] for _, v in self.pool]
        for own, seated in ((cache.k, k), (cache.v, v)):
            for layer, store in zip(own, seated):  # none while the cache is empty
                store[:, : cache.size] = layer[:, : cache.size]
        cache.store_in(slot, k, v, weakref.finalize(cache, self._give_back, slot))
        return True

    @property
    def seated(self) -> int:
        """Slots held by sequences."""
        return self.sequences - len(self._free)

    def _allocate_pool(self) -> None:
        """The slots' pool, at the first slot taken (or warm-up)."""
        if not self.pool:
            c = self.model.config
            shape = (c.num_kv_heads, self.sequences * self.context + c.block_size, c.head_dim)
            dtype = self.model.norm.weight.dtype
            # Zeros: a masked position is multiplied by 0 in attention, and 0 * NaN would be NaN.
            self.pool = [tuple(torch.zeros(shape, device=self.device, dtype=dtype) for _ in "kv") for _ in range(c.num_layers)]

    def warm_up(self, top_k: int, spans: tuple[int, ...] = WARM_SPANS) -> int:
        """Capture, before any sequence takes a slot, the passes that steps of 1 to
        ``sequences`` sequences asking for ``top_k`` make at each of ``spans``: one per padded
        batch size and span with new rows appended in the pass, and one without (a sequence's first
        step, its prompt appended before). Otherwise each is captured at its first
        run, holding every sequence of that pass: 0.1-0.4 s a graph at 32 users with Triton's
        kernels compiled, 1-4 s with them compiling (BENCHMARKS.md, [R7]). The passes write into
        the slots, which no sequence holds yet. Returns the passes run (captured, with
        ``capture``; run eagerly without it, as on a CPU)."""
        with self._lock:
            if len(self._free) < self.sequences:
                raise RuntimeError("BlockGraphs.warm_up: slots are taken; warm up before serving")
        self._allocate_pool()
        b = self.model.config.block_size
        width = self.model.fc.in_features
        row = torch.zeros(1, width, dtype=self.model.norm.weight.dtype, device=self.device)
        sizes = sorted({padded_batch(n) for n in range(1, self.sequences + 1)})
        runs = 0
        for span in sorted({min(s, self.context) for s in spans}):  # a pass's span is capped at the slot
            for features in (row, None):
                # The block ends where the span does, after the appended row if any: the pass's span
                # is then exactly `span`, also where the slot caps it below a power of two (a
                # --graph-context of 728 puts every pass of a 512-token prompt at 728).
                end = span - b
                size = end - (features is not None)
                if size < 0:
                    continue
                for s in sizes:
                    items = [BatchItem(_WarmUpContext(slot, size), 0, end, 0, top_k, features, size) for slot in range(min(s, self.sequences))]
                    runs += self.run_batch(items) is not None  # None: its capture failed (logged)
        return runs

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def fits(self, cache, rows: int) -> bool:
        """Whether ``cache`` (a ``ContextCache``) can take ``rows`` new rows and a block in its
        slot: then :meth:`run_batch` serves it (unless a capture fails)."""
        b = self.model.config.block_size
        return (
            cache.slot is not None and bool(cache.k) and cache.k[0].shape[1] == self.context
            and cache.size + rows + b <= self.context
        )

    def _capture(self, compute, key: tuple, what: str):
        """(graph, outputs) of ``compute`` captured, or None when capture fails: logged, and the
        passes of ``key`` run eagerly from then on (the caller's fallback); other shapes keep theirs."""
        # Graphs live as long as the worker and replay one at a time: they share one memory pool.
        t0 = time.perf_counter()
        try:
            graph, outputs = capture(compute, self.device, self._graph_pool)
        except RuntimeError as exc:  # contained: this shape's passes run eagerly, the others keep their graphs
            self.uncaptured.add(key)
            logger.error("CUDA graph capture of the draft's block pass of %s failed; passes of that shape run eagerly "
                         "(%d shapes so far): %s", what, len(self.uncaptured), exc)
            return None
        logger.info(
            "captured the block graph of %s in %.0f ms (%d graphs)",
            what, 1e3 * (time.perf_counter() - t0), len(self._batch_passes) + 1,
        )
        return graph, outputs

    def run_batch(self, items: list[BatchItem]) -> tuple[list[tuple[torch.Tensor, ...]], list[tuple[int, int]]] | None:
        """The blocks of one or more sequences in slots, in one pass: each appends its ``features``
        (at most B rows) first. Returns the outputs per distinct top_k (top-K ids [S', B-1, K]
        int32 and log-probs [S', B-1, K] float32 over the padded S' sequences, in the graphs'
        pool: read them before the next pass) and, per item, (output, row) of its proposal; None
        when capture failed (nothing was appended: the caller runs the pass eagerly).

        Every item must :meth:`fits` its rows, and there are at most ``sequences`` of them. A
        DFlash2 draft's outputs carry its pair scores [S', B-1, K, K] after the log-probs."""
        c = self.model.config
        b = c.block_size
        assert 1 <= len(items) <= self.sequences and all(it.cache.slot is not None for it in items)
        s = padded_batch(len(items))
        ends = [it.cache.size + (0 if it.features is None else len(it.features)) for it in items]
        assert all(e + b <= self.context and (it.features is None or len(it.features) <= b) for it, e in zip(items, ends))
        span = min(attention_span(max(ends) + b), self.context)
        ks = tuple(sorted({it.top_k for it in items}))
        append = any(it.features is not None for it in items)
        key = (s, span, ks, append)
        if key in self.uncaptured:
            return None
        self.batch_shapes.add(key)
        inputs = self._batch_inputs.get(s)
        if inputs is None:
            dtype = self.model.norm.weight.dtype
            rows, width = s * b, self.model.fc.in_features
            staged = StagedInputs.allocate(8 * BATCH_HEAD * s + 16 * rows + rows * width * dtype.itemsize, self.device)
            inputs = self._batch_inputs[s] = BatchInputs(staged, s, rows, width, dtype)
        self._write_batch(inputs, items, ends, append)
        compute = lambda: self._compute_batch(inputs, span, ks, append)  # noqa: E731
        where = [(ks.index(it.top_k), n) for n, it in enumerate(items)]
        if not self.capture:
            return compute(), where
        entry = self._batch_passes.get(key)
        if entry is None:
            entry = self._capture(compute, key, f"{s} sequences: span {span}, top-{ks}, {'appending' if append else 'block only'}")
            if entry is None:
                return None
            self._batch_passes[key] = entry
        else:
            entry[0].replay()
        return entry[1], where

    def _write_batch(self, inputs: BatchInputs, items: list[BatchItem], ends: list[int], append: bool) -> None:
        """Fill the batch's inputs, in one copy to the device (host features; features already on
        the device are copied there directly). Pad sequences: the scratch region, nothing visible
        but their own block."""
        s, rows = inputs.sequences, inputs.rows
        raw = inputs.staged.writable()
        head = raw[: 8 * BATCH_HEAD * s].view(np.int64).reshape(s, BATCH_HEAD)
        head[:] = (0, 0, 0, 0, self.scratch)
        head[: len(items)] = [(it.anchor_token, it.anchor_position, it.first, end, it.cache.slot) for it, end in zip(items, ends)]
        size = 8 * BATCH_HEAD * s
        if append:
            index = raw[size : size + 16 * rows].view(np.int64).reshape(2, rows)
            index[0], index[1] = self.scratch * self.context, 0  # pad rows: the scratch region
            at, chunks = 0, []
            for it in items:
                if it.features is None:
                    continue
                m = len(it.features)
                start = it.cache.slot * self.context + it.cache.size
                index[0, at : at + m] = np.arange(start, start + m)
                index[1, at : at + m] = np.arange(it.feature_position, it.feature_position + m)
                chunks.append(it.features)
                at += m
            size += 16 * rows
            if chunks[0].device.type != "cpu":  # features already on a GPU (in-process callers)
                torch.cat([f.to(device=inputs.features.device, dtype=inputs.feature_dtype) for f in chunks], out=inputs.features[:at])
            else:
                # Host features (the wire's): each step's rows packed by numpy (one thread, no joined
                # copy first). A torch.cat of host tensors runs on torch's CPU thread pool, which took
                # ~100 ms of a 119 ms pass at 32 users on an H100 host whose cores the other services kept busy
                # (BENCHMARKS.md [S16]).
                for f in chunks:
                    packed = f.to(device="cpu", dtype=inputs.feature_dtype).contiguous().view(torch.uint8).numpy().reshape(-1)
                    raw[size : size + packed.size] = packed
                    size += packed.size
        inputs.staged.upload(size)

    @torch.inference_mode()
    def _compute_batch(self, inputs: BatchInputs, span: int, ks: tuple[int, ...], append: bool) -> list[tuple[torch.Tensor, ...]]:
        c = self.model.config
        b, s = c.block_size, inputs.sequences
        head, rows = inputs.head, self._rows
        if append:
            index = inputs.row_index
            self.model.append_cached(inputs.features, index[1], self.pool, index[0])
        slots, ends = head[:, 4], head[:, 3]
        block = torch.where(rows == 0, head[:, :1], c.mask_token_id)  # [S, B]: anchor, MASK × (B-1)
        positions = head[:, 1:2] + rows  # [S, B]
        cols = self._cols[:span]
        first = head[:, 2:3, None]  # [S, 1, 1]
        sliding = self.model.sliding_window
        if sliding:  # DFlash2: row t sees the context columns >= end - window + 1 + t (and the whole block)
            first = torch.maximum(first, (ends[:, None] - sliding + 1 + rows)[..., None])  # [S, B, 1]
        visible = (cols >= first) & (cols < ends[:, None, None] + b)  # [S, B or 1, span]: the window, then the block
        at = PooledAttention(
            slots, ends, (slots[:, None] * self.context + ends[:, None] + rows).flatten(), visible.expand(s, b, span), self.context,
            first.flatten(1).amax(1),  # [S]: from there on every row sees the context
        )
        dtype = self.model.norm.weight.dtype
        hidden = self.model.forward_pooled(embedding_rows(self.embed, block.flatten()).to(dtype), positions.flatten(), self.pool, at)  # [S * B, hidden]
        drafted = hidden.view(s, b, -1)[:, 1:]  # [S, B-1, hidden]
        # One [S * (B-1), hidden] matmul (see proposals_of).
        logits = head_logits(drafted.flatten(0, 1), self.lm_head)  # [S * (B-1), vocab]
        selector = getattr(self.model, "candidate_selector", None)
        if selector is not None:
            logits = self.model.draft_logits(logits)
        out = []
        for k in ks:
            ids, logprobs = (t.view(s, b - 1, k) for t in top_k_log_softmax(logits, k))
            out.append((ids, logprobs) if selector is None else (ids, logprobs, selector.pair_scores(drafted, logprobs, ids, head[:, 0])))
        return out
