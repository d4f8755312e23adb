"""The draft's block pass (16 rows, the target's LM head, top-K) replayed as CUDA graphs.

Eagerly, a 5-layer draft of an 8B target spends most of a proposal launching ~200 small kernels.
A graph needs fixed shapes and addresses, so:

- a sequence's context K/V (a ``ContextCache``) is preallocated to ``context`` positions and never
  regrown while it fits (the first ``sequences`` sequences only: the preallocation costs memory);
- a pass attends over the first ``span`` slots (a power of two covering the filled ones) with a
  mask of the visible slots (``[first, end)``: a draft window hides the older ones);
- the anchor token and positions are read from a static buffer inside the graph.

One graph per (span, top_k) is kept with its sequence and dropped with it. The context append
(the ``fc`` projection of new tap features) stays eager: its row count changes every step.
Without ``capture`` (a CPU) the same fixed-shape pass runs eagerly, which is how CI tests it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from splitspec.cuda_graphs import attention_span, capture
from splitspec.models.dflash import DFlashDraft

logger = logging.getLogger(__name__)


@dataclass
class BlockPass:
    head: torch.Tensor  # [4] int64: anchor token, anchor position, first visible slot, end slot
    graph: torch.cuda.CUDAGraph
    top_ids: torch.Tensor  # [B-1, K] int64
    top_logprobs: torch.Tensor  # [B-1, K] float32


def top_k_proposal(
    model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
    context: list[tuple[torch.Tensor, torch.Tensor]], top_k: int, context_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block pass: per-depth top-K ids and log-probs [B-1, K] (the eager and graphed paths alike)."""
    hidden = model(embed[block].to(model.fc.weight.dtype), positions, context, context_mask)
    logprobs = torch.log_softmax((hidden[1:] @ lm_head.T.to(hidden.dtype)).float(), dim=-1)  # [B-1, vocab]
    top = torch.topk(logprobs, top_k, dim=-1)
    return top.indices, top.values


class BlockGraphs:
    def __init__(
        self, model: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, context: int, sequences: int, capture: bool
    ) -> None:
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.context, self.sequences, self.capture = context, sequences, capture
        self.device = embed.device
        self._live = 0
        self.failed = False  # a capture failed: every sequence runs the eager pass
        self._lock = threading.Lock()  # caches are dropped on whichever thread releases them last
        b = model.config.block_size
        self._rows = torch.arange(b, device=self.device)
        self._cols = torch.arange(context, device=self.device)

    def reserve(self) -> int:
        """Context positions to preallocate for a new sequence (0 = none left: grow as needed)."""
        with self._lock:
            if self._live >= self.sequences:
                return 0
            self._live += 1
        return self.context

    def attach(self, owner: object) -> None:
        """Count ``owner``'s reservation until it is garbage."""
        weakref.finalize(owner, self._give_back)

    def _give_back(self) -> None:
        with self._lock:
            self._live -= 1

    def run(
        self, cache, graphs: dict, anchor_token: int, anchor_position: int, first: int, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Top-K ids and log-probs of one block, or None when the cache has outgrown its preallocation."""
        if cache.k[0].shape[1] != self.context:
            return None
        span = min(attention_span(cache.size), self.context)
        key = (span, top_k)
        p = graphs.get(key)
        head = torch.tensor([anchor_token, anchor_position, first, cache.size], dtype=torch.int64)
        if not self.capture:  # the same fixed-shape pass, run eagerly (CPU; how CI tests it)
            return self._compute(cache, head.to(self.device), span, top_k)
        if self.failed:
            return None
        if p is None:
            buf = head.to(self.device)
            # Each graph gets its own memory pool: graphs die with their sequence, and a pool shared
            # with dead graphs is gone (capturing into it again fails inside the CUDA allocator).
            try:
                graph, (ids, logprobs) = capture(lambda: self._compute(cache, buf, span, top_k), self.device)
            except RuntimeError as exc:  # contained: the worker keeps serving on the eager pass
                logger.error("CUDA graph capture of the draft's block pass failed; serving eagerly from now on: %s", exc)
                self.failed = True
                return None
            p = graphs[key] = BlockPass(buf, graph, ids, logprobs)
        else:
            p.head.copy_(head)
            p.graph.replay()
        return p.top_ids, p.top_logprobs

    def _compute(self, cache, head: torch.Tensor, span: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.model.config
        block = torch.where(self._rows == 0, head[0], c.mask_token_id)  # [B]: anchor, MASK × (B-1)
        positions = head[1] + self._rows
        cols = self._cols[:span]
        visible = (cols >= head[2]) & (cols < head[3])  # [span]
        context = [(k[:, :span], v[:, :span]) for k, v in zip(cache.k, cache.v)]
        return top_k_proposal(self.model, self.embed, self.lm_head, block, positions, context, top_k, visible)
