"""Draft engine: per-sequence DFlash context caches and block proposals.

Each sequence keeps, per draft layer, the RoPE'd keys and values of its projected context
(``fc`` + ``hidden_norm`` of the target's tap features) for positions ``[ctx_start, ctx_end)``.
A proposal appends the new features (positions ``ctx_end .. anchor_position - 1``), runs one
non-causal pass over ``[anchor, MASK × (B-1)]`` at positions ``anchor_position + 0..B-1``, applies
the target's LM head to rows 1..B-1, and returns per-depth top-K ids and log-probs (a DFlash2
draft: and its selector's pair scores of those candidates, ``splitspec.models.dflash2``).

Propose steps of several sequences (``ProposeStep``) run together (``propose_batch``): those in
context slots (``BlockGraphs``) as one CUDA graph replay over a padded batch size, the others
in one eager batched pass (S blocks, each attending to its own context, padded to the longest).

Not thread-safe: the service calls it from one worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.draft.graphs import BatchItem, BlockGraphs, top_k_proposal, top_k_proposals
from services.worker.hosting import SequenceTable
from splitspec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from splitspec.models.dflash import DFlashConfig, DFlashDraft
from splitspec.models.quantized import QuantEmbedding

logger = logging.getLogger(__name__)

APPEND_CHUNK = 512  # new context rows projected to keys and values at once (a prompt arrives whole)


class ContextCache:
    """Per-layer K/V [H_kv, capacity, D] with an optional window: in the storage of a
    ``BlockGraphs`` slot (``slot``), or growable with amortised doubling."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.slot: int | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.size = 0  # filled positions
        self._give_back: Callable[[], object] | None = None  # returns the slot (BlockGraphs.seat)

    def store_in(self, slot: int, k: list[torch.Tensor], v: list[torch.Tensor], give_back: Callable[[], object]) -> None:
        """Store in slot ``slot`` from now on: its per-layer views ``k`` and ``v`` hold this
        cache's filled positions already; ``give_back()`` returns the slot (once)."""
        self.slot, self.k, self.v, self._give_back = slot, k, v, give_back

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
            if self._give_back is not None:  # outgrew its slot: another sequence may have it now
                self._give_back()  # (the copies above are queued on the stream before its next pass)
                self.slot, self._give_back = None, None
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
class ProposeStep:
    """One sequence's Propose: the arguments of :meth:`DraftEngine.propose`."""

    sequence_id: str
    anchor_token: int
    anchor_position: int
    features: torch.Tensor | None  # [m, taps * hidden] for positions anchor_position - m ..
    top_k: int
    window: int = 0  # attend to the last ``window`` context positions only; 0: all
    tokens: Sequence[int] = ()  # token ids of the new positions; DFlash conditions on features only
    context: int = 0  # the gateway's number of this draft context (SequenceTable.claim)
    depths: int = 0  # candidates for depths 1..depths (0: every depth of the block; admitted, 1..B-1)

    @property
    def rows(self) -> int:
        """m: the new feature rows."""
        return 0 if self.features is None else self.features.shape[0]


@dataclass
class Proposal:
    top_ids: torch.Tensor  # [B-1, K] int32, on the host
    top_logprobs: torch.Tensor  # [B-1, K] float32, on the host
    forward_ns: int  # the whole pass's time (appends, block pass, host copies), shared by its sequences
    pass_sequences: int = 1  # sequences in the pass that computed this proposal
    pair_scores: torch.Tensor | None = None  # [B-1, K, K] float32 on the host: a DFlash2 draft's selector

    @classmethod
    def of(cls, host: tuple[torch.Tensor, ...], forward_ns: int, pass_sequences: int = 1) -> Proposal:
        """From a pass's host tensors: ids and log-probs, then (DFlash2) pair scores."""
        return cls(host[0], host[1], forward_ns, pass_sequences, host[2] if len(host) > 2 else None)


class DraftEngine:
    def __init__(
        self,
        model: DFlashDraft,
        embed: torch.Tensor | QuantEmbedding,  # [vocab, hidden] the target's token embedding (in its GGUF blocks: keep-quantized)
        lm_head: torch.Tensor | torch.nn.Module,  # [vocab, hidden] the target's output projection, or a QuantLinear
        max_sequences: int = 256,
        max_top_k: int = 64,
        graphs: BlockGraphs | None = None,
    ) -> None:
        self.model, self.config = model, model.config
        self.embed, self.lm_head = embed, lm_head
        self.graphs = graphs  # the CUDA-graph block pass, when enabled
        self.vocab_size = embed.num_embeddings if isinstance(embed, QuantEmbedding) else embed.shape[0]
        self.max_sequences, self.max_top_k = max_sequences, max_top_k
        param = next(model.parameters())  # the draft and the target's embedding share the device
        self.device, self.dtype = param.device, param.dtype
        self.sequences = SequenceTable()  # of DraftSequence

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def pins(self, features: torch.Tensor) -> bool:
        """Whether host ``features`` are rows a GPU pass appends eagerly (more than a block: a
        prompt's), which the servicer copies into pinned memory (:func:`pinned`) before the step
        reaches the engine thread: there their copy to the device is then a DMA, not a pageable
        copy (a 512-row prompt of the 8B shape: 2.4-3.2 ms less of the pass on an H100,
        BENCHMARKS.md [S17])."""
        return self.device.type == "cuda" and features.device.type == "cpu" and features.shape[0] > self.block_size

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
    def selector_top_k(self) -> int:
        """A DFlash2 draft's selector top-K (its proposals carry pair scores); 0 for DFlash."""
        return getattr(self.config, "selector_top_k", 0)

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
        depths: int = 0,  # candidates for depths 1..depths (0: every depth of the block)
    ) -> Proposal:
        """One sequence's step: :meth:`propose_batch` of that step alone, raising its error."""
        step = ProposeStep(sequence_id, anchor_token, anchor_position, features, top_k, window, tokens, context, depths)
        result = self.propose_batch([step])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def propose_batch(self, steps: list[ProposeStep]) -> list[Proposal | BaseException]:
        """The proposals of several sequences' steps, computed together; per step its
        ``Proposal`` or the error that refused or failed it.

        Each step is admitted on its own, with the checks of :meth:`propose`: a refused step gets
        its error (InvalidArgument, FailedPrecondition, ResourceExhausted, Aborted) and changes
        nothing :meth:`propose` would not, and the other steps go on. A step whose sequence_id an
        earlier step of the batch has (admitted or not) is refused (FailedPrecondition): a
        sequence's steps depend on each other, so two in one pass are the caller's mistake.

        The admitted steps run in up to two passes, each computing its steps' proposals together
        (an error there goes to each of them): those whose contexts are in ``BlockGraphs`` slots
        and fit one more block there, and the others. Those in slots, one or more, run one graph
        (``BlockGraphs.run_batch``: the batch size padded by ``padded_batch``, their new rows of up
        to a block appended inside it). The others share one eager pass: their new rows' keys and
        values in one ``context_kv``, appended to each context, then one block pass
        (``DFlashDraft.forward_batch``; one step alone, ``top_k_proposal``). On an H200 (bf16,
        8B-sized draft, contexts ~900) the graph takes 1.6 ms for 2 sequences, 2.3 ms for 8 and
        5.9 ms for 32, the eager pass 8.2, 9.9 and 18.7 ms (services/draft/graphs.py).
        """
        results: list[Proposal | BaseException | None] = [None] * len(steps)
        admitted: list[tuple[int, ProposeStep, DraftSequence]] = []
        seen: set[str] = set()
        for i, step in enumerate(steps):
            earlier = step.sequence_id in seen
            seen.add(step.sequence_id)
            try:
                admitted.append((i, step, self._admit(step, earlier)))
            except Exception as exc:  # a refusal (a ServiceError) or a bad argument's own error: that step's alone
                results[i] = exc
        # A slot holds one context: at most ``graphs.sequences`` steps are slotted.
        fits = [bool(self.graphs and self.graphs.fits(seq.cache, step.rows)) for _, step, seq in admitted]
        slotted = [a for a, ok in zip(admitted, fits) if ok]
        others = [a for a, ok in zip(admitted, fits) if not ok]
        for group, graphed in ((slotted, True), (others, False)):
            if len(group) == 1 and not graphed:  # the eager pass of one sequence, at its exact shape
                i, step, seq = group[0]
                try:
                    results[i] = self._propose_one(step, seq)
                except Exception as exc:  # the step's result: propose raises it
                    results[i] = exc
            elif group:
                for (i, _, _), result in zip(group, self._propose_many([(step, seq) for _, step, seq in group], graphed)):
                    results[i] = result
        return results  # type: ignore[return-value]

    def _admit(self, step: ProposeStep, earlier: bool) -> DraftSequence:
        """The step's sequence, created if new, after the checks of :meth:`propose`; ``earlier``:
        a step of the same sequence_id came before it in the batch."""
        c: DFlashConfig = self.config
        if not step.sequence_id:
            raise InvalidArgument("sequence_id must not be empty")
        if not 0 <= step.anchor_token < self.vocab_size:
            raise InvalidArgument(f"anchor_token: {step.anchor_token} is outside [0, {self.vocab_size})")
        if not 1 <= step.top_k <= min(self.max_top_k, self.vocab_size):
            raise InvalidArgument(f"top_k: {step.top_k} is outside [1, {min(self.max_top_k, self.vocab_size)}]")
        if step.window < 0:
            raise InvalidArgument(f"window: {step.window} must be >= 0")
        if step.depths < 0:
            raise InvalidArgument(f"depths: {step.depths} must be >= 0")
        step.depths = min(step.depths or c.block_size - 1, c.block_size - 1)
        features, m = step.features, step.rows
        width = c.num_taps * c.hidden_size
        if features is not None and (features.dim() != 2 or features.shape[1] != width):
            raise InvalidArgument(f"features: shape {tuple(features.shape)} is not [rows, {width}]")
        if earlier:
            raise FailedPrecondition(f"sequence_id {step.sequence_id!r} has more than one step in this batch")
        sliding = self.model.sliding_window
        if sliding:  # a DFlash2 draft's rows see at most sliding_window - 1 context rows (the anchor's row sees that many)
            step.window = min(step.window or sliding - 1, sliding - 1)

        def new_context() -> DraftSequence:
            if len(self.sequences) >= self.max_sequences and step.sequence_id not in self.sequences:
                raise ResourceExhausted(f"{len(self.sequences)} draft contexts are live, the limit is {self.max_sequences}")
            if m == 0:
                raise FailedPrecondition(f"sequence_id {step.sequence_id!r} is new to the draft worker and carries no features")
            return DraftSequence(ContextCache(c.num_layers), step.anchor_position - m, step.anchor_position - m)

        seq = self.sequences.claim(step.sequence_id, step.context, new_context)
        if seq.ctx_end + m != step.anchor_position:
            raise FailedPrecondition(
                f"features: the draft context ends at position {seq.ctx_end} but {m} rows before "
                f"anchor_position {step.anchor_position} start at {step.anchor_position - m}"
            )
        if self.graphs and seq.cache.slot is None and self.graphs.seat(seq.cache, m) and seq.cache.size:
            # It ran eagerly first: only under slot pressure (a burst of arrivals, more sequences than slots).
            logger.info("sequence %s seated in slot %d with %d context positions: it ran the eager pass until then", step.sequence_id, seq.cache.slot, seq.cache.size)
        return seq

    def _extend(self, step: ProposeStep, seq: DraftSequence, kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Bring ``seq``'s context up to the anchor: append ``kv`` (per layer (k, v) [H_kv, m, D],
        the step's new rows; None when there are none or a graphed pass appended them already),
        then compact a windowed cache."""
        if kv is not None:
            seq.cache.append(kv)
        seq.ctx_end = step.anchor_position
        window = step.window
        if window and seq.cache.size > 2 * window:  # compact rarely; attention slices the window anyway
            seq.ctx_start += seq.cache.size - window
            seq.cache.drop_front(seq.cache.size - window)

    def _context_kv(self, admitted: list[tuple[ProposeStep, DraftSequence]]) -> list[list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Per step the keys and values of its new rows, per layer (k, v) [H_kv, m, D] (None: it has
        none), computed in as few ``context_kv`` calls as ``APPEND_CHUNK`` allows over all of them:
        rows are independent, and one call launches its kernels once instead of once per sequence."""
        new = [n for n, (step, _) in enumerate(admitted) if step.rows]
        out: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(admitted)
        if not new:
            return out
        chunks = [self.model.context_kv(f, p) for f, p in self._row_chunks([admitted[n] for n in new])]
        kv = chunks[0] if len(chunks) == 1 else [
            (torch.cat([c[i][0] for c in chunks], dim=1), torch.cat([c[i][1] for c in chunks], dim=1)) for i in range(len(chunks[0]))
        ]  # per layer (k, v) [H_kv, M, D]
        rows = [admitted[n][0].rows for n in new]
        pieces = [list(zip(k.split(rows, dim=1), v.split(rows, dim=1))) for k, v in kv]  # [layer][j]: (k, v) [H_kv, m_j, D]
        for j, n in enumerate(new):
            out[n] = [layer[j] for layer in pieces]
        return out

    def _row_chunks(self, new: list[tuple[ProposeStep, DraftSequence]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The steps' new rows in order, on the device, as chunks of at most ``APPEND_CHUNK`` rows:
        features [r, taps * hidden] and positions [r]. A prompt's rows go through a chunk at a time:
        all 16K rows' features, fc and norm outputs at once would take 1.25 GiB at the 27B draft's
        width."""
        pieces: list[tuple[torch.Tensor, int]] = []  # a chunk's rows: (features [r, W], first position)
        size = 0  # rows in the chunk being gathered
        for step, seq in new:
            for a in range(0, step.rows, APPEND_CHUNK):
                piece = step.features[a : a + APPEND_CHUNK]
                if size + piece.shape[0] > APPEND_CHUNK:
                    yield self._to_device(pieces)
                    pieces, size = [], 0
                pieces.append((piece, seq.ctx_end + a))
                size += piece.shape[0]
        yield self._to_device(pieces)

    def _to_device(self, pieces: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's ``pieces`` (features from the wire: on the host) joined on the device:
        features [r, W] and positions [r]. Steps' short runs are joined on the host and go with the
        positions in one pinned copy each; a prompt's rows (pinned by the servicer: :meth:`pins`)
        go as they came, since joining them on the host copies tens of MB on the engine thread.
        A copy from pageable memory first waits for the work queued before it (CUDA's rule for
        pageable copies): a copy a step between the chunks' kernels would wait for each; one from
        pinned memory is queued, and the engine thread goes on."""
        host = self.device.type == "cuda" and pieces[0][0].device.type == "cpu"
        join = pinned_cat if host else _joined
        parts = [
            group[0] if group[0].shape[0] > self.block_size else join(group)  # a prompt's rows / steps' short runs
            for group in host_groups([f for f, _ in pieces], self.block_size)
        ]
        features = _joined([part.to(self.device, self.dtype, non_blocking=True) for part in parts])
        positions = join([torch.arange(p, p + f.shape[0]) for f, p in pieces])  # [r]
        return features, positions.to(self.device, non_blocking=True)

    def _propose_one(self, step: ProposeStep, seq: DraftSequence) -> Proposal:
        """One sequence's eager pass (its context outside the slots)."""
        c: DFlashConfig = self.config
        t0 = time.perf_counter_ns()
        dev = self.device
        self._extend(step, seq, self._context_kv([(step, seq)])[0])
        block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.int64, device=dev)
        block[0] = step.anchor_token
        positions = torch.arange(step.anchor_position, step.anchor_position + c.block_size, device=dev)
        out = top_k_proposal(self.model, self.embed, self.lm_head, block, positions, seq.cache.layers(step.window), step.top_k, step.depths)
        [host] = _to_host([out])
        return Proposal.of(host, time.perf_counter_ns() - t0)

    def _propose_many(self, admitted: list[tuple[ProposeStep, DraftSequence]], graphed: bool = False) -> list[Proposal | BaseException]:
        """Several sequences' pass: with ``graphed`` (every context fits its slot) one batched graph
        (:meth:`_graphed_pass`), else (or when its capture fails) their new rows' keys and values
        in one ``context_kv``, appended to each context, then one eager batched block pass. An
        error fails every step of it."""
        t0 = time.perf_counter_ns()
        steps = [step for step, _ in admitted]
        try:
            outs = self._graphed_pass(admitted) if graphed else None
            if outs is None:
                # Contexts the graphed pass brought up to their anchors already need no append.
                pending = [(step, seq) for step, seq in admitted if seq.ctx_end != step.anchor_position]
                for (step, seq), kv in zip(pending, self._context_kv(pending)):
                    self._extend(step, seq, kv)
                anchors = torch.tensor([s.anchor_token for s in steps], dtype=torch.int64).to(self.device)  # [S]
                anchor_positions = torch.tensor([s.anchor_position for s in steps], dtype=torch.int64).to(self.device)  # [S]
                contexts = [seq.cache.layers(step.window) for step, seq in admitted]
                outs = _to_host(top_k_proposals(
                    self.model, self.embed, self.lm_head, anchors, anchor_positions, contexts, [s.top_k for s in steps], [s.depths for s in steps],
                ))
        except Exception as exc:  # every step of the pass fails with it
            return [exc] * len(admitted)
        forward_ns = time.perf_counter_ns() - t0
        return [Proposal.of(host, forward_ns, len(admitted)) for host in outs]

    def _graphed_pass(self, admitted: list[tuple[ProposeStep, DraftSequence]]) -> list[tuple[torch.Tensor, ...]] | None:
        """Host (ids, log-probs) of the sequences' blocks by one ``BlockGraphs.run_batch``: new rows
        beyond a block appended eagerly first (one ``context_kv``), the others inside the pass.
        None when the capture failed: then the larger appends are done, the others are not."""
        b = self.block_size
        big = [(step, seq) for step, seq in admitted if step.rows > b]
        for (step, seq), kv in zip(big, self._context_kv(big)):
            self._extend(step, seq, kv)
        items = []
        for step, seq in admitted:
            m = step.rows if step.rows <= b else 0  # appended in the pass
            first = max(0, seq.cache.size + m - step.window) if step.window else 0
            items.append(BatchItem(seq.cache, step.anchor_token, step.anchor_position, first, step.top_k, step.features if m else None, seq.ctx_end))
        ran = self.graphs.run_batch(items)
        if ran is None:
            return None
        outs, where = ran
        host = _to_host(outs)
        for step, seq in admitted:
            if 0 < step.rows <= b:
                seq.cache.size += step.rows
                self._extend(step, seq, None)
        return [tuple(part[n, : step.depths] for part in host[k]) for (k, n), (step, _) in zip(where, admitted)]


def pinned(features: torch.Tensor) -> torch.Tensor:
    """A copy of host ``features`` in pinned (page-locked) memory; ``features`` themselves when none
    can be had (the host's page-locked memory exhausted, or no CUDA): their copy is then pageable."""
    return pinned_cat([features])


def pinned_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Host tensors ``parts`` joined along their first dimension into pinned memory (joined in
    pageable memory when none can be had, warned once)."""
    global _unpinned_logged
    try:
        out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=True)
    except RuntimeError as exc:
        if not _unpinned_logged:
            logger.warning("no pinned memory for %s rows (%s): copied to the device from pageable memory", sum(p.shape[0] for p in parts), exc)
            _unpinned_logged = True
        return _joined(parts)
    # Byte copies by numpy, on this thread: a torch.cat or copy_ of host tensors this size runs on
    # torch's CPU thread pool, which the busy-polling services' cores starve (BENCHMARKS.md [S16]).
    raw, at = out.view(-1).view(torch.uint8).numpy(), 0
    for p in parts:
        data = p.contiguous().view(-1).view(torch.uint8).numpy()
        raw[at : at + data.size] = data
        at += data.size
    return out


_unpinned_logged = False  # pinned() warns once


def host_groups(features: list[torch.Tensor], block: int) -> list[list[torch.Tensor]]:
    """``features`` (one chunk's pieces in order) grouped for their copy to the device: consecutive
    pieces of at most ``block`` rows (steps' new rows) share a group, joined on the host where that
    is cheap; a longer piece (a prompt's) is a group of its own."""
    groups: list[list[torch.Tensor]] = []
    short = False  # whether the last group takes more short pieces
    for f in features:
        if f.shape[0] <= block and short:
            groups[-1].append(f)
        else:
            groups.append([f])
            short = f.shape[0] <= block
    return groups


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _to_host(outs: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """Host copies of (ids, log-probs[, pair scores]) tuples, made here: a graph's outputs live in the graphs'
    shared pool, where another slot's replay may write before the servicer has sent them. All
    copies, then one wait."""
    host = [tuple(t.to("cpu", non_blocking=True) for t in out) for out in outs]
    if outs and outs[0][0].is_cuda:
        torch.cuda.current_stream(outs[0][0].device).synchronize()
    return host
