"""The draft's block pass (16 rows, the target's LM head, top-K) replayed as CUDA graphs.

Eagerly, a 5-layer draft of an 8B target spends most of a proposal launching ~200 small kernels.
A graph needs fixed shapes and addresses, so:

- a sequence's context K/V (a ``ContextCache``) lives in one of ``sequences`` preallocated slots
  of ``context`` positions and is never regrown while it fits (sequences beyond the slots grow
  their own and run eagerly: the preallocation costs memory);
- a pass attends over the first ``span`` slots (a power of two covering the filled ones) with a
  mask of the visible slots (``[first, end)``: a draft window hides the older ones);
- the anchor token and positions are read from a static buffer inside the graph;
- the block's own keys and values are written to the ``B`` slots after the context (rewritten by
  the next append), so attention reads one cache instead of a concatenation;
- the context append (``fc`` of the new tap features and every layer's K/V of them) runs inside
  the same graph for up to ``B`` new rows, padded to ``B``: the pad rows land in slots the block
  overwrites. Larger appends (a prompt) run eagerly before a block-only pass.

One graph per (slot, span, top_k, append) is captured on first use and replayed by every later
sequence in that slot. Without ``capture`` (a CPU) the same fixed-shape pass runs eagerly, which
is how CI tests it.
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
from services.worker.cuda_graphs import StagedInputs, attention_span, capture
from splitspec.models.dflash import DFlashDraft

logger = logging.getLogger(__name__)


# head [6] int64: anchor token, anchor position, first visible slot, end of the context (the
# block's first slot), first slot and first position of the appended rows.
HEAD = 6


@dataclass
class BlockPass:
    """Static buffers of one captured pass: inputs are copied in, outputs read out."""

    inputs: StagedInputs  # the head, then (appending) B feature rows
    feature_dtype: torch.dtype | None  # of the appended rows; None: a block-only pass
    width: int  # of a feature row: taps * hidden
    graph: torch.cuda.CUDAGraph | None = None
    top_ids: torch.Tensor | None = None  # [B-1, K] int32
    top_logprobs: torch.Tensor | None = None  # [B-1, K] float32

    @staticmethod
    def allocate(device: torch.device, rows: int, width: int, feature_dtype: torch.dtype | None) -> BlockPass:
        size = 8 * HEAD + (rows * width * feature_dtype.itemsize if feature_dtype else 0)
        return BlockPass(StagedInputs.allocate(size, device), feature_dtype, width)

    @property
    def head(self) -> torch.Tensor:
        """[HEAD] int64."""
        return self.inputs.on_device[: 8 * HEAD].view(torch.int64)

    @property
    def features(self) -> torch.Tensor | None:
        """[B, taps * hidden]: rows to append, or None (block only)."""
        if self.feature_dtype is None:
            return None
        return self.inputs.on_device[8 * HEAD :].view(self.feature_dtype).view(-1, self.width)

    def write(self, head: tuple[int, ...], features: torch.Tensor | None) -> None:
        """Fill the head and the first ``len(features)`` feature rows, in one copy to the device
        (host features; rows already on the device are copied there directly)."""
        raw = self.inputs.writable()
        raw[: 8 * HEAD].view(np.int64)[:] = head
        size = 8 * HEAD
        if features is not None:
            if features.device == self.inputs.on_device.device:
                self.features[: len(features)].copy_(features)
            else:  # numpy's copy: one thread (torch's would wake its pool for a few hundred KB)
                rows = features.to(self.feature_dtype).contiguous().view(torch.uint8).numpy().reshape(-1)
                raw[size : size + rows.size] = rows
                size += rows.size
        self.inputs.upload(size)


def top_k_log_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] -> top-K ids [R, K] int32 and log-probs [R, K] float32, each row on its own."""
    if use_triton(logits, "top_k") and native_top_k.supported(logits, top_k):
        return native_top_k.top_k_log_softmax(logits, top_k)
    return native_top_k.top_k_log_softmax_reference(logits, top_k)


def top_k_of(hidden: torch.Tensor, lm_head: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block hidden states [B, hidden] -> per-depth top-K ids [B-1, K] int32 and log-probs [B-1, K]
    float32 (row 0 is the anchor's)."""
    return top_k_log_softmax(hidden[1:] @ lm_head.T.to(hidden.dtype), top_k)  # logits [B-1, vocab]


def top_k_proposal(
    model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
    context: list[tuple[torch.Tensor, torch.Tensor]], top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager block pass over ``context`` (per layer (k, v) [H_kv, S, D])."""
    return top_k_of(model(embed[block].to(model.fc.weight.dtype), positions, context), lm_head, top_k)


def top_k_proposals(
    model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor,
    contexts: list[list[tuple[torch.Tensor, torch.Tensor]]], top_ks: list[int],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`top_k_proposal` of S sequences in one eager pass (``DFlashDraft.forward_batch``):
    ``anchors`` and ``anchor_positions`` [S] int64, ``contexts`` per sequence, per layer (k, v)
    [H_kv, n_s, D]. Returns per sequence top-K ids [B-1, K_s] int32 and log-probs [B-1, K_s] float32.

    The top-K runs once per distinct K over the rows of the sequences asking for it, not once
    with the largest K sliced: ``torch.topk`` orders tied values differently for different K, and
    each row must come out as :func:`top_k_of` gives it alone."""
    c = model.config
    rows = torch.arange(c.block_size, device=anchors.device)  # [B]
    blocks = torch.where(rows == 0, anchors[:, None], c.mask_token_id)  # [S, B]: anchor, MASK × (B-1)
    hidden = model.forward_batch(embed[blocks].to(model.fc.weight.dtype), anchor_positions[:, None] + rows, contexts)  # [S, B, hidden]
    # One [S * (B-1), hidden] matmul: a 3-D operand would run as a batched matmul over the
    # broadcast LM head (H200, S=32, vocab 152k: 9 ms against well under one).
    logits = (hidden[:, 1:].flatten(0, 1) @ lm_head.T.to(hidden.dtype)).unflatten(0, (len(top_ks), -1))  # [S, B-1, vocab]
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(top_ks)  # type: ignore[list-item]
    for k in sorted(set(top_ks)):
        members = [s for s, ks in enumerate(top_ks) if ks == k]
        chosen = logits if len(members) == len(top_ks) else logits[members]  # [S_k, B-1, vocab]
        ids, logprobs = top_k_log_softmax(chosen.flatten(0, 1), k)  # [S_k * (B-1), K]
        for s, ids_s, logprobs_s in zip(members, ids.unflatten(0, chosen.shape[:2]), logprobs.unflatten(0, chosen.shape[:2])):
            out[s] = (ids_s, logprobs_s)
    return out


class BlockGraphs:
    """``sequences`` context slots of ``context`` positions each, and the graphs captured over them.

    A new sequence takes a free slot (its ``ContextCache`` stores into the slot's tensors) and
    gives it back when it is garbage. Graphs belong to the slot, not to the sequence, so the next
    sequence in that slot replays them: after warm-up no request pays for a capture.
    """

    def __init__(
        self, model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, context: int, sequences: int, capture: bool
    ) -> None:
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.context, self.sequences, self.capture = context, sequences, capture
        self.device = embed.device
        self.failed = False  # a capture failed: every sequence runs the eager pass
        self._lock = threading.Lock()  # slots come back on whichever thread drops the last reference
        self._free = list(range(sequences - 1, -1, -1))
        self._slots: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # allocated on first use
        self._passes: dict[tuple[int, int, int, bool], BlockPass] = {}  # (slot, span, top_k, append)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        b = model.config.block_size
        self._rows = torch.arange(b, device=self.device)
        self._cols = torch.arange(context, device=self.device)

    def take(self, owner: object) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """A free slot for ``owner`` (returned when ``owner`` is garbage): its number and per-layer
        K and V storage [H_kv, context, D]; None when all are taken (the sequence grows its own)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        if slot not in self._slots:
            c = self.model.config
            shape = (c.num_kv_heads, self.context, c.head_dim)
            dtype = self.model.fc.weight.dtype
            # Zeros: a masked slot is multiplied by 0 in attention, and 0 * NaN would be NaN.
            self._slots[slot] = tuple([torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(c.num_layers)] for _ in "kv")
        weakref.finalize(owner, self._give_back, slot)
        return slot, *self._slots[slot]

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def run(
        self, cache, anchor_token: int, anchor_position: int, first: int, top_k: int,
        features: torch.Tensor | None = None, feature_position: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Top-K ids and log-probs of one block, appending ``features`` [m, taps * hidden] (m <= B,
        positions ``feature_position ..``) to ``cache`` first; None when the pass cannot run here
        (no slot, the cache outgrew it, or capture failed): the caller runs it eagerly and
        appends nothing itself before asking again."""
        b = self.model.config.block_size
        m = 0 if features is None else features.shape[0]
        end = cache.size + m
        if self.failed or cache.slot is None or cache.k[0].shape[1] != self.context or end + b > self.context or m > b:
            return None
        span = min(attention_span(end + b), self.context)
        key = (cache.slot, span, top_k, features is not None)
        p = self._passes.get(key)
        fresh = p is None
        if fresh:
            dtype = None if features is None else self.model.fc.weight.dtype
            p = BlockPass.allocate(self.device, b, self.model.fc.in_features, dtype)
        p.write((anchor_token, anchor_position, first, end, cache.size, feature_position), features)
        compute = lambda: self._compute(cache, p.head, p.features, span, top_k)  # noqa: E731
        if not self.capture:  # the same fixed-shape pass, run eagerly (CPU; how CI tests it)
            return compute()
        if fresh:
            # Graphs live as long as the worker and replay one at a time: they share one memory pool.
            t0 = time.perf_counter()
            try:
                p.graph, (p.top_ids, p.top_logprobs) = capture(compute, self.device, self._pool)
            except RuntimeError as exc:  # contained: the worker keeps serving on the eager pass
                logger.error("CUDA graph capture of the draft's block pass failed; serving eagerly from now on: %s", exc)
                self.failed = True
                return None
            self._passes[key] = p
            logger.info(
                "captured the block graph of slot %d: span %d, top-%d, %s, in %.0f ms (%d graphs)",
                cache.slot, span, top_k, "appending" if features is not None else "block only",
                1e3 * (time.perf_counter() - t0), len(self._passes),
            )
        else:
            p.graph.replay()
        return p.top_ids, p.top_logprobs

    def _compute(self, cache, head: torch.Tensor, features: torch.Tensor | None, span: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.model.config
        rows = self._rows  # [B]
        caches = list(zip(cache.k, cache.v))
        if features is not None:
            self.model.append_cached(features, head[5] + rows, caches, head[4] + rows)
        block = torch.where(rows == 0, head[0], c.mask_token_id)  # [B]: anchor, MASK × (B-1)
        cols = self._cols[:span]
        visible = (cols >= head[2]) & (cols < head[3] + c.block_size)  # [span]: the window, then the block
        mask = visible[None, :].expand(c.block_size, -1)
        hidden = self.model.forward_cached(self.embed[block].to(self.model.fc.weight.dtype), head[1] + rows, caches, head[3] + rows, mask)
        return top_k_of(hidden, self.lm_head, top_k)
