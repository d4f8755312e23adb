"""Draft engine: per-sequence DFlash context caches and block proposals.

Each sequence keeps, per draft layer, the RoPE'd keys and values of its projected context
(``fc`` + ``hidden_norm`` of the target's tap features) for positions ``[ctx_start, ctx_end)``.
A proposal appends the new features (positions ``ctx_end .. anchor_position - 1``), runs one
non-causal pass over ``[anchor, MASK × (B-1)]`` at positions ``anchor_position + 0..B-1``, applies
the target's LM head to rows 1..B-1, and returns per-depth top-K ids and log-probs.

Not thread-safe: the service calls it from one worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.draft.graphs import BlockGraphs, top_k_proposal
from services.worker.hosting import SequenceTable
from splitspec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from splitspec.models.dflash import DFlashConfig, DFlashDraft


class ContextCache:
    """Per-layer K/V [H_kv, capacity, D] with an optional window: in the storage of a
    ``BlockGraphs`` slot (``slot``), or growable with amortised doubling."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.slot: int | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.size = 0  # filled positions

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        m = kv[0][0].shape[1]
        if not self.k:
            self.k = [torch.zeros(k.shape[0], max(m, 64), k.shape[2], dtype=k.dtype, device=k.device) for k, _ in kv]
            self.v = [torch.zeros_like(k) for k in self.k]  # zeros: masked slots must hold no NaN (0 * NaN = NaN)
        if self.size + m > self.k[0].shape[1]:
            new_cap = max(2 * self.k[0].shape[1], self.size + m)
            for i in range(self.num_layers):
                for store in (self.k, self.v):
                    grown = store[i].new_empty(store[i].shape[0], new_cap, store[i].shape[2])
                    grown[:, : self.size] = store[i][:, : self.size]
                    store[i] = grown
        for i, (k, v) in enumerate(kv):
            self.k[i][:, self.size : self.size + m] = k
            self.v[i][:, self.size : self.size + m] = v
        self.size += m

    def drop_front(self, count: int) -> None:
        """Forget the oldest ``count`` positions (draft window)."""
        if count <= 0:
            return
        keep = self.size - count
        for store in (self.k, self.v):
            for i in range(self.num_layers):
                store[i][:, :keep] = store[i][:, count : self.size].clone()
        self.size = keep

    def layers(self, window: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer views of the filled positions, or of the last ``window`` of them."""
        first = max(0, self.size - window) if window else 0
        return [(k[:, first : self.size], v[:, first : self.size]) for k, v in zip(self.k, self.v)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


@dataclass
class DraftSequence:
    cache: ContextCache
    ctx_start: int  # absolute position of cache slot 0
    ctx_end: int  # first position without features


@dataclass
class Proposal:
    top_ids: torch.Tensor  # [B-1, K] int32, on the host
    top_logprobs: torch.Tensor  # [B-1, K] float32, on the host
    forward_ns: int


class DraftEngine:
    def __init__(
        self,
        model: DFlashDraft,
        embed: torch.Tensor,  # [vocab, hidden] the target's token embedding
        lm_head: torch.Tensor,  # [vocab, hidden] the target's output projection
        max_sequences: int = 256,
        max_top_k: int = 64,
        graphs: BlockGraphs | None = None,
    ) -> None:
        self.model, self.config = model, model.config
        self.embed, self.lm_head = embed, lm_head
        self.graphs = graphs  # the CUDA-graph block pass, when enabled
        self.vocab_size = embed.shape[0]
        self.max_sequences, self.max_top_k = max_sequences, max_top_k
        self.device, self.dtype = embed.device, next(model.parameters()).dtype
        self.sequences = SequenceTable()  # of DraftSequence

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def context_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self.sequences.values())

    def propose(
        self,
        sequence_id: str,
        anchor_token: int,
        anchor_position: int,
        features: torch.Tensor | None,  # [m, taps * hidden] for positions anchor_position - m ..
        top_k: int,
        window: int = 0,
        tokens=(),  # token ids of the new positions; DFlash conditions on features only
        context: int = 0,  # the gateway's number of this draft context (SequenceTable.claim)
    ) -> Proposal:
        c: DFlashConfig = self.config
        if not sequence_id:
            raise InvalidArgument("sequence_id must not be empty")
        if not 0 <= anchor_token < self.vocab_size:
            raise InvalidArgument(f"anchor_token: {anchor_token} is outside [0, {self.vocab_size})")
        if not 1 <= top_k <= min(self.max_top_k, self.vocab_size):
            raise InvalidArgument(f"top_k: {top_k} is outside [1, {min(self.max_top_k, self.vocab_size)}]")
        if window < 0:
            raise InvalidArgument(f"window: {window} must be >= 0")
        m = 0 if features is None else features.shape[0]
        width = c.num_taps * c.hidden_size
        if features is not None and (features.dim() != 2 or features.shape[1] != width):
            raise InvalidArgument(f"features: shape {tuple(features.shape)} is not [rows, {width}]")

        def new_context() -> DraftSequence:
            if len(self.sequences) >= self.max_sequences and sequence_id not in self.sequences:
                raise ResourceExhausted(f"{len(self.sequences)} draft contexts are live, the limit is {self.max_sequences}")
            if m == 0:
                raise FailedPrecondition(f"sequence_id {sequence_id!r} is new to the draft worker and carries no features")
            cache = ContextCache(c.num_layers)
            if self.graphs:  # the slot comes back when the cache is garbage
                cache.slot, cache.k, cache.v = self.graphs.take(cache) or (None, [], [])
            return DraftSequence(cache, anchor_position - m, anchor_position - m)

        seq = self.sequences.claim(sequence_id, context, new_context)
        if seq.ctx_end + m != anchor_position:
            raise FailedPrecondition(
                f"features: the draft context ends at position {seq.ctx_end} but {m} rows before "
                f"anchor_position {anchor_position} start at {anchor_position - m}"
            )
        t0 = time.perf_counter_ns()
        dev = self.device
        out = None
        if m and self.graphs:  # the graphed pass appends up to a block of new rows itself
            first = max(0, seq.cache.size + m - window) if window else 0
            out = self.graphs.run(seq.cache, anchor_token, anchor_position, first, top_k, features, seq.ctx_end)
            if out:
                seq.cache.size += m
        if m and not out:
            positions = torch.arange(seq.ctx_end, anchor_position, device=dev)
            seq.cache.append(self.model.context_kv(features.to(device=dev, dtype=self.dtype), positions))
        seq.ctx_end = anchor_position
        if window and seq.cache.size > 2 * window:  # compact rarely; attention slices the window anyway
            seq.ctx_start += seq.cache.size - window
            seq.cache.drop_front(seq.cache.size - window)
        if not out:
            first = max(0, seq.cache.size - window) if window else 0
            out = self.graphs and self.graphs.run(seq.cache, anchor_token, anchor_position, first, top_k)
        if not out:
            block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.int64, device=dev)
            block[0] = anchor_token
            positions = torch.arange(anchor_position, anchor_position + c.block_size, device=dev)
            out = top_k_proposal(self.model, self.embed, self.lm_head, block, positions, seq.cache.layers(window), top_k)
        # Host copies, made here: a graph's outputs live in the graphs' shared pool, where another
        # slot's replay may write before the servicer has sent them. Both copies, then one wait.
        ids, logprobs = (t.to("cpu", non_blocking=True) for t in out)
        if out[0].is_cuda:
            torch.cuda.current_stream(out[0].device).synchronize()
        return Proposal(ids, logprobs, time.perf_counter_ns() - t0)
