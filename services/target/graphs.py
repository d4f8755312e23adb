"""The target's forward passes over paged sequences: exact shapes eagerly, or fixed shapes replayed
as CUDA graphs.

Batch-1 decode on a GPU is bound by kernel launches long before it is bound by memory unless the
whole pass is one CUDA graph, and a graph replays fixed shapes at fixed addresses. A pass over
several sequences (``splitspec.models.paged``) reads only its :class:`PassInputs` buffers, so with
fixed ``(N, B, T, S)`` it can be captured once and replayed with new inputs:

- **Rows** ``N`` (all sequences' rows) and **block rows** ``T`` (the largest sequence's) pad up to
  ``ROW_BUCKETS``; **sequences** ``B`` up to a power of two. A pad row is token 0 writing to the pad
  block; a pad sequence owns only the pad block.
- **Keys** ``S``: attention reads the first ``S`` positions of each sequence (a power of two
  >= 256 covering the longest), masked, so one graph serves every length up to it.
- **Prompt chunks** of up to ``PREFILL_CHUNK`` rows pad to ``PREFILL_BUCKETS`` and project only
  their last row to logits.

**When a shape is captured.** :meth:`PassRunner.warm_up` captures, at start, the shapes steps
make: batches of any size whose sequences' blocks are all of one of the sizes the adaptive
budget chooses (``WARM_BLOCKS``; the gateway's policy gives all its sequences one budget,
``services.gateway.budget``), and the prompt chunks of prompts up to the largest warm span,
recording the features of the draft's taps (``--draft-taps``) so that a draft's steps replay
them. A shape first met while serving is captured at its
``HOT_PASSES``-th pass: a capture stalls every sequence of the pass for two passes and the graph's
instantiation (on an H200, 60-120 ms for the 8B once warm-up compiled the Triton kernels), worth
it only for a shape that comes again. Until then it runs eagerly at its fixed shape, far slower
than a replay where launches, not kernels, take the time (on an H200, 75-200 ms for the 27B
hybrid against a 24 ms replay), unless a captured pass covers it (:func:`stand_in`: more rows,
sequences or keys, padded). That one it replays for as long as padding costs less than a capture
would: until the passes' padding (:func:`padding`) adds up to ``HOT_PADDING`` passes, about what a
capture costs, so that a shape which comes and goes (two gateways' budgets mixed in one pass
while one of them changes its choice) is never captured, and one that stays pays about twice
what the best choice in hindsight would at most (rent until the rent adds up to the price). A
pass that wants no features replays a tapped graph of its shape for good. Graphs share one memory pool and write their logits and
features into buffers of the runner, so a graph keeps no memory of its own beyond the pool. Without
``capture`` (a CPU) the fixed shapes run eagerly (how CI tests this path); with ``fixed_shapes``
off every pass runs eagerly at its exact shape.

**Recurrent families** (the hybrid Qwen3.5: ``PagedState.slots``) run the same fixed shapes, since
their passes read nothing on the host and their padding only reads (``Qwen35ForCausalLM.forward_paged``).
What a tree pass keeps of its rows until the commit (``slots.pending``) goes to buffers reserved
once for ``max_rows`` rows (``slots.reserve``), which every captured pass writes; a replay runs no
Python, so the runner points ``slots.pending`` at the replayed pass's rows itself. Tree passes of
more rows, which would need more of those buffers, run eagerly at their exact shape.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.cuda_graphs import WARM_SPANS, StagedInputs, attention_span, capture
from splitspec.models.paged import PAD_BLOCK, PagedState, PassInputs, PassLayout, pass_layout
from splitspec.spec.budget import ADAPTIVE_BUDGETS

logger = logging.getLogger(__name__)

# 40 and 72 rows measured slower than 48 and 96 (cuBLAS tiles); above 264, batches of trees.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 264, 384, 512, 768, 1024, 1536, 2048)
# Prompt chunks pad to few sizes: each is a graph holding its own feature buffer (a 512-row chunk
# of five 4096-wide taps: 21 MB).
PREFILL_BUCKETS = (64, 128, 256, 512)
PREFILL_CHUNK = PREFILL_BUCKETS[-1]
WARM_TREE_ROWS = 24  # a budget-22 tree (23 rows), padded: the default budget's block
# Block rows warm_up captures: a decode step's one row and every adaptive budget's tree (b + 1 rows,
# each a bucket), the default budget's among them.
WARM_BLOCKS = tuple(b + 1 for b in ADAPTIVE_BUDGETS)
HOT_PASSES = 3  # the pass of a shape not warmed up at which it is captured
# A capture's cost in passes: on an H200 the 27B's captures while serving took 184-345 ms, 3-6
# passes of 64-384 rows (42-84 ms) and 11-12 of 16-32 (17-22 ms), where padding costs little
# (BENCHMARKS.md [O1], [O2]).
HOT_PADDING = 4.0


def warm_up_start(span: int, rows: int) -> int:
    """The first position of a warm-up pass of ``rows`` rows whose keys need exactly ``span`` slots
    (``attention_span``): they end one past half of it. (< 1: no such pass.)"""
    return span // 2 + 1 - rows


def recurrent_pass_rows(max_sequences: int) -> int:
    """The most rows of a recurrent family's fixed-shape tree pass: a budget-22 tree of every
    sequence, as :meth:`PassRunner.warm_up` captures (a bucket). The rows its tree passes keep are
    reserved for that many (at the Qwen3.5-27B geometry ~2 MB a row: ``qwen35.tree_row_bytes``),
    so it grows with the sequences, as their state slots do (151 MB each in float32)."""
    return bucket(min(max_sequences * WARM_TREE_ROWS, ROW_BUCKETS[-1]), ROW_BUCKETS)


def pass_row_limit(recurrent: bool, max_sequences: int) -> int:
    """The most rows of a fixed-shape tree pass (``PassRunner``'s ``max_rows``): a recurrent family's
    is bounded by the tree rows its state slots reserve (:func:`recurrent_pass_rows`)."""
    return recurrent_pass_rows(max_sequences) if recurrent else ROW_BUCKETS[-1]


def warm_up_passes(
    max_sequences: int, max_rows: int, blocks: tuple[int, ...] = WARM_BLOCKS, spans: tuple[int, ...] = WARM_SPANS
) -> list[tuple[int, int, int]]:
    """The passes :meth:`PassRunner.warm_up` runs: ``(span, block rows, sequences)``, one for each
    shape that a batch of up to ``max_sequences`` sequences with blocks of one size makes (its
    rows and its sequences padded to their buckets) and ``max_rows`` holds; largest first (the first
    capture sizes the runner's output buffers for all)."""
    passes = {}
    for span in spans:
        for rows in blocks:
            for n in range(1, max(1, max_sequences) + 1):
                total = bucket(n * rows, ROW_BUCKETS)
                if warm_up_start(span, rows) >= 1 and total is not None and total <= max_rows:
                    passes.setdefault((span, rows, total, 1 << (n - 1).bit_length()), (span, rows, n))
    return sorted(passes.values(), key=lambda p: -p[1] * p[2])


def warm_up_prompt_chunks(chunk: int, spans: tuple[int, ...] = WARM_SPANS) -> list[tuple[int, int]]:
    """The prompt chunks :meth:`PassRunner.warm_up` runs: ``(start, rows)``, one for each shape that
    the chunks of prompts of up to ``max(spans)`` positions make when they are cut every ``chunk``
    rows (``TargetEngine._prefill``): a chunk's rows padded to ``PREFILL_BUCKETS``, its keys to the
    span that covers them (past ``max(spans)`` where the padding reaches beyond it); largest first."""
    limit = max(spans)
    shapes = {}
    for start in range(0, limit, chunk):
        most = min(chunk, limit - start)  # the real rows of this chunk: 1 to most
        for rows in sorted({b for b in PREFILL_BUCKETS if b < most} | {bucket(most, PREFILL_BUCKETS)}):
            shapes.setdefault((rows, attention_span(start + rows)), (start, rows))
    return sorted(shapes.values(), key=lambda p: (-p[1], p[0]))


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``value``, or None above the largest."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def stand_in(key: tuple, captured) -> tuple | None:
    """The captured pass that can run the pass of ``key`` ``(N, B, T, S, taps, prompt_chunk)``: of
    the same kind, with at least its rows ``N``, sequences ``B``, block rows ``T`` and keys ``S``,
    and its taps (any taps where it asks for none: their features are dropped); of those, the
    fewest rows, then keys. None when no key of ``captured`` is such a pass."""
    n, b, t, s, taps, prompt_chunk = key
    fits = [
        k for k in captured
        if k[5] == prompt_chunk and (k[4] == taps or not taps) and k[0] >= n and k[1] >= b and k[2] >= t and k[3] >= s
    ]
    return min(fits, key=lambda k: (k[0], k[3], k[1], k[2], len(k[4])), default=None)


def padding(shape: tuple, other: tuple) -> float:
    """The share of a pass of ``other`` ``(N, B, T, S, ...)`` that is padding when it stands in for
    one of ``shape``: ``1 - `` the smallest ratio of their rows, sequences, block rows or keys. (A
    pass's time grows with each, none faster than in proportion; where it is flat this overstates
    the waste, which only brings a capture forward.)"""
    return 1.0 - min(a / b for a, b in zip(shape[:4], other[:4]))


@dataclass
class _Pass:
    """One fixed shape: its input buffers, and once captured its graph and the outputs its replays rewrite."""

    staged: StagedInputs  # the inputs' bytes: written on the host, one copy to the device a pass
    inputs: PassInputs  # views of the staged device bytes
    passes: int = 0  # passes run at this shape
    padding: float = 0.0  # the passes of it that larger stand-ins ran, weighed by their padding
    logits: torch.Tensor | None = None  # [N or 1, vocab] float32 once captured, a view of the runner's buffer
    features: torch.Tensor | None = None  # [N, taps * hidden], likewise
    graph: torch.cuda.CUDAGraph | None = None
    pending: object | None = None  # a recurrent family's rows kept by this pass (views of reserved buffers)
    never_captured: bool = False  # its capture failed: it runs eagerly for good


def _state_restorer(slots, state_slots) -> Callable[[], None]:
    """A function that puts the state of ``state_slots`` back as it is now, kept on the host
    meanwhile: a 27B sequence's state is ~150 MB, which a capped device may not have to spare
    while serving."""
    kept = {int(slot): {name: t.to("cpu", copy=True) for name, t in slots.read(int(slot)).items()} for slot in state_slots}

    def restore() -> None:
        for slot, tensors in kept.items():
            for name, t in slots.read(slot).items():
                t.copy_(tensors[name])

    return restore


@dataclass
class StagedPass:
    """A pass whose inputs are written on the host (:meth:`PassRunner.stage`), ready to launch."""

    layout: PassLayout
    taps: tuple[int, ...]
    prompt_chunk: bool
    run: _Pass | None = None  # the fixed-shape pass that runs it (None: eagerly at its exact shape)
    features_wanted: bool = True  # False: a stand-in's features, which this pass did not ask for
    stopgap: bool = False  # run by a larger stand-in until its own shape's capture: no measure of its shape


class PassRunner:
    """Runs :meth:`forward_paged` of a target over a :class:`PassLayout`."""

    def __init__(
        self, model, state: PagedState, fixed_shapes: bool, capture: bool, max_rows: int = ROW_BUCKETS[-1], hot_passes: int = HOT_PASSES,
        hot_padding: float = HOT_PADDING,
    ) -> None:
        """``max_rows``: the most rows of a fixed-shape tree (verify or decode) pass; larger ones run
        eagerly at their exact shape. A recurrent family's state slots reserve their tree rows for it.
        A shape not warmed up is captured at its ``hot_passes``-th pass, and where a larger captured
        pass stands in for it not before their padding adds up to ``hot_padding`` passes (1 and 0:
        at its first, as tools that time one shape want)."""
        self.model, self.state = model, state
        self.device = state.kv.k.device
        self.fixed_shapes, self.capture = fixed_shapes, capture and fixed_shapes
        self.max_rows, self.hot_passes, self.hot_padding = max_rows, hot_passes, hot_padding
        if fixed_shapes and state.slots is not None:
            state.slots.reserve(max_rows)
        self._passes: dict[tuple, _Pass] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._outputs: dict[tuple, torch.Tensor] = {}  # (width, dtype) -> [rows, width]: where graphs write outputs
        self._warming = False
        # The most rows of a tree pass captured while serving (warm_up lowers it to its largest
        # pass): larger ones run eagerly, their kernels' time far above their launches', and keep
        # the logits buffer at the size the memory plan counts.
        self.capture_rows = max_rows
        self.graphs = 0  # CUDA graphs captured so far
        self.capture_failures = 0  # shapes whose capture failed (they run eagerly)
        # Passes whose time is no measure of a pass of their shape: captures, and eager runs or
        # larger stand-ins of a shape that is captured at its hot pass (on an H200 the 27B's eager
        # runs took 75-200 ms against a 24 ms replay; the adaptive budget learns pass costs).
        self.unmeasured = 0
        self.stand_in_passes = 0  # passes run in a captured pass of another shape (stand_in)

    def run(
        self, layout: PassLayout, taps: tuple[int, ...], prompt_chunk: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (``[N, vocab]``, or ``[1, vocab]`` of the last row for a prompt chunk) and features
        ``[N, taps * hidden]`` of the layout's rows. A fixed-shape pass returns views of the runner's
        buffers, which its next pass rewrites: read them before the next pass."""
        return self.launch(self.stage(layout, taps, prompt_chunk))

    def stage(self, layout: PassLayout, taps: tuple[int, ...], prompt_chunk: bool = False) -> StagedPass:
        """The host half of :meth:`run`: choose the pass that runs the layout and write its inputs'
        host bytes. Nothing here waits for the device, so it may overlap the pass before, which
        must be launched first: passes launch in the order they were staged."""
        shape = self._shape(layout, prompt_chunk) if self.fixed_shapes else None
        if shape is None:  # exact inputs are copied to the device as they are made: at the launch
            return StagedPass(layout, taps, prompt_chunk)
        block_size = self.state.kv.block_size
        key = (*shape, taps, prompt_chunk)
        p = self._passes.get(key)
        if p is None:
            staged = StagedInputs.allocate(PassInputs.nbytes(*shape, block_size), self.device)
            p = self._passes[key] = _Pass(staged, PassInputs.on(staged.on_device, *shape, block_size, static=True))
        p.passes += 1
        run, features_wanted, stopgap = p, True, False
        if p.graph is None and not self._warming:
            other = stand_in(key, self._captured())
            # A stand-in of the same shape (its taps' features dropped) serves for good; a larger one
            # until this shape's own capture: either replays in a fraction of an eager pass's time.
            hot = p.passes >= self.hot_passes and p.padding >= self.hot_padding
            if other not in (None, key) and (other[:4] == shape or not hot or p.never_captured):
                run, features_wanted = self._passes[other], bool(taps)
                self.stand_in_passes += 1
                stopgap = other[:4] != shape  # a larger pass's time, until this shape's capture
                if stopgap:
                    p.padding += padding(shape, other)
        # The chunk's last real row is read inside the pass: one graph serves every chunk length.
        run.inputs.fill(layout, run.staged.writable(), layout.num_rows - 1)
        return StagedPass(layout, taps, prompt_chunk, run, features_wanted, stopgap)

    def launch(self, staged: StagedPass) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a staged pass (see :meth:`run`)."""
        layout, taps, prompt_chunk = staged.layout, staged.taps, staged.prompt_chunk
        if staged.run is None:
            inputs = PassInputs.exact(layout, self.state.kv.block_size, self.device, layout.num_rows - 1)
            return self.model.forward_paged(inputs, self.state, taps, logit_rows=inputs.last_row if prompt_chunk else None, chain=prompt_chunk)
        self.unmeasured += staged.stopgap
        staged.run.staged.upload()
        logits, features = self._run(staged.run, taps, prompt_chunk, layout.state_slots)
        n = layout.num_rows
        return (logits if prompt_chunk else logits[:n]), (None if features is None or not staged.features_wanted else features[:n])

    def warm_up(
        self, max_sequences: int, blocks: tuple[int, ...] = WARM_BLOCKS, spans: tuple[int, ...] = WARM_SPANS, taps: tuple[int, ...] = (),
        prompt_chunk: int = 0,
    ) -> int:
        """Capture the passes of every batch of up to ``max_sequences`` sequences (one per shape), each
        sequence's block ``blocks`` rows (a decode step; the adaptive budgets' trees, the default
        budget's among them), at key ``spans``, and with ``prompt_chunk`` (the rows a prompt is cut
        into) the prompt chunks of prompts up to the largest span, recording the features of
        ``taps`` (a draft's: its verify steps replay these graphs, and steps that want no features
        replay them too). Their graphs, and the Triton kernels of those shapes, are made now, not
        mid-stream, where a new shape would stall every sequence of its pass (py-spy on an H200: 42%
        of the engine thread in captures during a timed run, before shapes met while serving ran
        eagerly first; a 27B prompt chunk's capture took 184-345 ms). The pad sequences read and
        write only the pad block and a recurrent family's pad state slot 0, which tree passes only
        read and the warm-up's prompt chunks leave as they found it. Passes run largest first: the
        first sizes the graphs' output buffers. Returns the passes made (none when passes run at
        exact shapes)."""
        if not self.fixed_shapes:
            return 0
        passes = warm_up_passes(max_sequences, self.max_rows, blocks, spans)
        self.capture_rows = max((bucket(n * rows, ROW_BUCKETS) for _, rows, n in passes), default=0)
        chunks = warm_up_prompt_chunks(prompt_chunk, spans) if prompt_chunk else []
        layouts = [(self._warm_up_layout(warm_up_start(span, rows), rows, n), False) for span, rows, n in passes]
        layouts += [(self._warm_up_layout(start, rows, 1), True) for start, rows in chunks]
        slots = self.state.slots
        restore = _state_restorer(slots, [0]) if chunks and slots is not None else None  # the chunks move the pad state on
        made = 0
        self._warming = True
        try:
            for layout, prompt in sorted(layouts, key=lambda item: -item[0].num_rows):
                before = len(self._passes)
                self.run(layout, taps, prompt_chunk=prompt)
                made += len(self._passes) - before
        finally:
            self._warming = False
            if restore is not None:
                restore()
        return made

    def _warm_up_layout(self, start: int, rows: int, sequences: int) -> PassLayout:
        """A warm-up pass of ``sequences`` pad sequences of ``rows`` rows (a causal chain) after
        ``start`` positions, every position in the pad block."""
        table = [PAD_BLOCK] * self.state.kv.blocks_for(start + rows)
        tree = np.tril(np.ones((rows, rows), dtype=bool))
        n = sequences
        return pass_layout(self.state.kv, [[0] * rows] * n, [np.arange(-1, rows - 1)] * n, [start] * n, [table] * n, [tree] * n)

    def _captured(self) -> list[tuple]:
        """The keys of the passes captured as graphs (those a stand-in is chosen from)."""
        return [key for key, p in self._passes.items() if p.graph is not None]

    def _shape(self, layout: PassLayout, prompt_chunk: bool) -> tuple[int, int, int, int] | None:
        """``(N, B, T, S)`` of the padded pass, or None when no bucket fits."""
        if prompt_chunk:
            rows = bucket(layout.num_rows, PREFILL_BUCKETS)
            block_rows, sequences = rows, 1
        else:
            rows, block_rows = bucket(layout.num_rows, ROW_BUCKETS), bucket(layout.max_rows, ROW_BUCKETS)
            sequences = 1 << (layout.num_sequences - 1).bit_length()
        if rows is None or block_rows is None or (not prompt_chunk and rows > self.max_rows):
            return None
        keys = attention_span(int(layout.starts.max()) + block_rows)
        keys = -(-keys // self.state.kv.block_size) * self.state.kv.block_size
        return rows, sequences, block_rows, keys

    def _output(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` ``[n, width]`` copied into the runner's buffer of its width and dtype: the one
        place every graph writes such outputs. The buffer grows in the run that :func:`capture` makes
        before capturing (a capture may not allocate outside its pool); graphs captured before keep
        the old one."""
        rows, width = value.shape
        buffer = self._outputs.get((width, value.dtype))
        if buffer is None or buffer.shape[0] < rows:
            buffer = self._outputs[width, value.dtype] = torch.empty((rows, width), dtype=value.dtype, device=value.device)
        return buffer[:rows].copy_(value)

    def _run(
        self, p: _Pass, taps: tuple[int, ...], prompt_chunk: bool, state_slots: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass at ``p``'s shape: replayed, captured, or eager (whose outputs ``p`` does not keep:
        a shape run eagerly now and then holds no memory). ``state_slots``: the layout's, [B]."""

        def compute():
            last = p.inputs.last_row if prompt_chunk else None
            return self.model.forward_paged(p.inputs, self.state, taps, logit_rows=last, chain=prompt_chunk)

        slots = self.state.slots
        if p.graph is not None:
            p.graph.replay()
            if slots is not None:  # the replay rewrote this pass's kept rows; no Python said so
                slots.pending = p.pending
            return p.logits, p.features
        if p.never_captured:
            return compute()
        capturable = prompt_chunk or p.inputs.shape[0] <= self.capture_rows
        if not self.capture or not (self._warming or (capturable and p.passes >= self.hot_passes)):
            if self.capture and capturable:  # replayed once hot: this run is a stopgap
                self.unmeasured += 1
            return compute()

        def into_buffers():
            logits, features = compute()
            return self._output(logits), None if features is None else self._output(features)

        t0 = time.perf_counter()
        n, b, t, s = p.inputs.shape
        # A hybrid's prompt chunk moves its sequence's recurrent and conv state on in place, and a
        # capture runs the pass twice: the state goes back before the second run. (Tree and decode
        # passes keep their state rows pending until the commit; keys written twice are the same.)
        restore = _state_restorer(slots, [s for s in state_slots if s]) if prompt_chunk and slots is not None else None
        try:
            p.graph, (p.logits, p.features) = capture(into_buffers, self.device, self._pool, restore)
        except RuntimeError as exc:  # contained: this shape runs eagerly from now on, the others keep their graphs
            if restore is not None:
                restore()  # the run before the capture moved the state on
            p.never_captured = True
            self.capture_failures += 1
            logger.error("capturing the %s graph of %d rows (%d sequences of up to %d) over %d positions failed; "
                         "that shape runs eagerly (%d shapes so far): %s", "prompt" if prompt_chunk else "verify", n, b, t, s,
                         self.capture_failures, exc)
            return compute()
        self.graphs += 1
        self.unmeasured += 1
        logger.info(
            "captured the %s graph of %d rows (%d sequences of up to %d) over %d positions, taps %s, %s, in %.0f ms (%d graphs)",
            "prompt" if prompt_chunk else "verify", n, b, t, s, list(taps),
            "at start" if self._warming else f"at its pass {p.passes}", 1e3 * (time.perf_counter() - t0), self.graphs,
        )
        if slots is not None:
            p.pending = slots.pending
        return p.logits, p.features
