"""Target engine: paged sequence state, prefill, and tree verification of many sequences in one pass.

Terms (see ``splitspec.spec.tree`` and ``splitspec.models.paged``): the *root* is the pending token
drawn last step (not yet in the KV cache); a verify pass runs ``[root, nodes]`` of each sequence at
positions ``length + depth`` with an ancestor-only mask, draws the target's own token at every row,
walks the tree, commits the accepted rows (K/V compacted down to ``length ..``; for hybrid models
also the deepest accepted row's recurrent and conv state), and returns the *committed* tokens
(root + accepted nodes) and the *bonus* (the target's token after the last accepted node: the next
root).

**Batching.** :meth:`TargetEngine.verify_batch` takes the steps of several sequences and runs them
as one forward pass (their rows concatenated, each attending to its own sequence's blocks); the
walks and the compaction stay per sequence. A decode step (no tree) is a tree of one row and
batches alike. Each step is checked on its own: a bad one fails alone.

**Stages.** A pass runs as :meth:`TargetEngine.prepare_pass` (host work only: checks, blocks,
layout, inputs), :meth:`~TargetEngine.launch_pass`, :meth:`~TargetEngine.settle_pass` (tokens
read, trees walked, rows committed, the runner's buffers read) and
:meth:`~TargetEngine.finish_pass` (results); the target's batcher prepares a pass while the one
before is on the device (``services.worker.batching``). Passes run on the device in the order they
launch, and each is prepared only once the one before has launched.

**Paged KV.** Sequences own KV blocks (and, for recurrent families, one state slot), taken as
they grow and given back when their state is dropped (release, expiry, failure). Only the engine
thread takes blocks (when it prepares a pass or a prompt); a release from another thread gives
them back at once when the engine is idle (between a pass's stages too), else when its current
call ends. A block given back while a pass that wrote it is on the device goes only to a pass
prepared later, which the device runs after that pass and its commit: a pass never shares a
block between two sequences. When a step needs a block and none is free, the newest-admitted sequence
is *preempted*: its state is dropped and its next step answers NOT_FOUND, which the gateway
answers by prefilling the sequence's tokens again (seeded sampling keys on positions, so the
output is unchanged). A prefill that cannot get its blocks now raises :class:`KVBlocksBusy` (the
server waits for blocks and retries); RESOURCE_EXHAUSTED is for a request that could never fit.

Not thread-safe: the service calls it from one worker thread, which serialises device work.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch

from services.target.graphs import HOT_PADDING, HOT_PASSES, PREFILL_CHUNK, PassRunner, pass_row_limit
from services.worker.hosting import SequenceTable
from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, ServiceError
from splitspec.models.paged import PagedState, PassInputs, pass_layout
from splitspec.spec.acceptance import accept_path
from splitspec.spec.sampling import SamplingParams, draw_tokens, token_logprobs
from splitspec.spec.tree import tree_attention_mask, validate_tree


class TargetModel(Protocol):
    """A target family: ``DenseForCausalLM``, ``Qwen35ForCausalLM``."""

    config: Any  # vocab_size, num_layers, max_context

    def new_pool(self, num_blocks: int, block_size: int, max_sequences: int, device: torch.device, dtype: torch.dtype) -> PagedState: ...

    def forward_paged(
        self, inputs: PassInputs, state: PagedState, taps: Sequence[int] = (), logit_rows: torch.Tensor | None = None,
        chain: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class KVBlocksBusy(ResourceExhausted):
    """Not enough free KV blocks (or state slots) now; some will be freed as sequences end."""


@dataclass
class TargetLimits:
    max_sequences: int = 64
    max_kv_tokens: int = 1 << 16  # positions in the KV pool, over all sequences
    max_tree_nodes: int = 256
    prefill_chunk: int = 512
    block_size: int = 16


@dataclass
class Holding:
    """What a sequence holds in the pools: its block table (in position order) and its recurrent
    state slot (hybrid families). Given back once: when the sequence is preempted, or when its state
    is dropped (released, expired, failed), whichever comes first."""

    blocks: list[int]
    slot: int | None = None
    returned: bool = False


@dataclass(eq=False)
class SequenceState:
    holding: Holding
    capacity: int  # positions the sequence may use (its Prefill's reserve_tokens)
    length: int  # positions in the KV cache (committed)
    pending_token: int  # the root of the next verify
    sampling: SamplingParams
    taps: tuple[int, ...]
    feature_dtype: torch.dtype | None  # wire dtype of returned features (None = compute dtype)
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token (``token_logprobs``)
    admitted: int = 0  # admission order: the newest is preempted first


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
class VerifyStep:
    """One sequence's verify request: a tree (``tokens``/``parents`` as in ``DraftTree``; empty = a decode step)."""

    sequence_id: str
    tokens: Sequence[int]
    parents: Sequence[int]
    return_features: bool = False
    next_step_late: bool = False  # the sequence's next step comes after its pass's others' (VerifyRequest)


@dataclass
class VerifyResult:
    committed_tokens: list[int]  # root + accepted nodes' tokens
    accepted_nodes: list[int]  # 1-based node indices
    next_token: int
    features: torch.Tensor | None  # [len(committed_tokens), taps * hidden]
    committed_length: int
    forward_ns: int  # of the whole pass; 0 when it captured a CUDA graph or stood in until its capture (PassRunner.unmeasured)
    # When the sequence asked for logprobs: those of committed_tokens[1:] + [next_token], in order.
    logprobs: list[TokenLogprob] | None = None
    pass_rows: int = 0  # rows of every sequence in the pass
    pass_sequences: int = 0
    queue_ns: int = 0  # how long the step waited for its pass to start (set by the worker's batcher)
    queue_prompt_ns: int = 0  # of queue_ns, the engine's time in other sequences' prompts meanwhile


@dataclass
class _Work:
    """A checked step in a pass: its sequence, tree and rows."""

    index: int  # in the batch
    state: SequenceState
    step: VerifyStep
    tokens: np.ndarray  # [n] nodes
    parents: np.ndarray  # [n]
    row_tokens: list[int] = field(default_factory=list)  # [n + 1] root first
    rows: np.ndarray | None = None  # [n + 1] parent row of each row, -1 for the root
    tree: np.ndarray | None = None  # [n + 1, n + 1] ancestor-only


@dataclass(eq=False)
class VerifyPass:
    """One pass of verify steps through the engine's stages: prepared (checked, blocks taken, inputs
    written on the host), launched, settled (walked and committed), finished (each step's result)."""

    results: list  # [steps] each step's error or, once settled, its VerifyResult
    work: list[_Work]  # the checked steps that run
    started_ns: int  # perf_counter_ns when its time began: its preparation, or its launch when prepared ahead
    taps: tuple[int, ...] = ()
    layout: Any = None  # PassLayout
    staged: Any = None  # services.target.graphs.StagedPass
    unmeasured_before: int = 0  # PassRunner.unmeasured at its launch: a capture or a stopgap since is no measure of a pass
    logits: torch.Tensor | None = None  # [N, vocab], launched to settled
    features: torch.Tensor | None = None  # [N, taps * hidden]
    launched: Any = None  # torch.cuda.Event after the launch (None on a CPU)
    computing: concurrent.futures.Future | None = None  # a CPU's pass on its own thread: (logits, features)
    feature_host: torch.Tensor | None = None  # [sum AL, taps * hidden]: the asking sequences' accepted rows
    features_copied: Any = None  # torch.cuda.Event after their copy to the host
    elapsed_ns: int = 0  # launch (or preparation) to settle; 0 when unmeasured


class TargetEngine:
    def __init__(
        self, model: TargetModel, limits: TargetLimits | None = None, fixed_shapes: bool = False, capture: bool = False,
        hot_passes: int = HOT_PASSES, hot_padding: float = HOT_PADDING, cpu_pass_thread: bool = False,
    ) -> None:
        """``fixed_shapes``: pad passes to bucketed shapes (``services.target.graphs``), captured as CUDA
        graphs with ``capture`` on a GPU (``hot_passes``, ``hot_padding``: see :class:`PassRunner`); otherwise every
        pass runs eagerly at its exact shape. ``cpu_pass_thread``: on a CPU, at exact shapes, a launched
        pass computes on a thread of its own, as a GPU's pass runs on its stream, so that the engine
        thread may prepare the next one meanwhile (the staged path a GPU serves; with fixed shapes a
        pass prepared meanwhile would rewrite the inputs of its shape, which on a CPU are the pass's own)."""
        self.model = model
        self.config = model.config
        self.limits = limits or TargetLimits()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        blocks = -(-self.limits.max_kv_tokens // self.limits.block_size) + 1  # + the pad block
        self.state = model.new_pool(blocks, self.limits.block_size, self.limits.max_sequences, self.device, self.dtype)
        # A recurrent family's fixed-shape tree passes are bounded by the rows its slots reserve.
        max_rows = pass_row_limit(self.state.slots is not None, self.limits.max_sequences)
        self.runner = PassRunner(model, self.state, fixed_shapes, capture, max_rows, hot_passes, hot_padding)
        self.sequences = SequenceTable(on_drop=lambda state: self._give_back(state.holding))  # of SequenceState
        self._admissions = itertools.count(1)
        # Held by the engine thread for a whole call (reentrant: a preemption gives back inside one).
        self._busy = threading.RLock()
        self._deferred: list[Holding] = []  # given back while the engine was busy
        self._deferred_lock = threading.Lock()
        use_thread = cpu_pass_thread and self.device.type == "cpu" and not fixed_shapes
        # The pass thread sets this thread's torch thread count (--threads) itself.
        threads = torch.get_num_threads()
        self._pass_thread = ThreadPoolExecutor(1, "target-pass", initializer=torch.set_num_threads, initargs=(threads,)) if use_thread else None

    @property
    def kv(self):
        return self.state.kv

    @property
    def reserved_tokens(self) -> int:
        """KV positions held by live sequences (whole blocks)."""
        return (self.kv.usable_blocks - self.kv.free_blocks) * self.kv.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.kv.usable_blocks * self.kv.block_size

    @property
    def prompt_chunk(self) -> int:
        """The rows of a prompt's passes: ``--prefill-chunk``, at most the largest prompt bucket
        that fixed shapes pad to (``PREFILL_CHUNK``)."""
        return min(self.limits.prefill_chunk, PREFILL_CHUNK) if self.runner.fixed_shapes else self.limits.prefill_chunk

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

    # -- state ----------------------------------------------------------------------------------

    def _new_state(self, tokens: int, capacity: int) -> SequenceState:
        """A sequence's state with blocks for ``tokens + 1`` positions and its state slot; raises
        ``KVBlocksBusy`` when they are not free now."""
        blocks = self.kv.allocate(self.kv.blocks_for(tokens + 1))
        if blocks is None:
            raise KVBlocksBusy(
                f"KV cache full: {self.kv.free_blocks} of {self.kv.usable_blocks} blocks free, {self.kv.blocks_for(tokens + 1)} needed"
            )
        slot = None
        if self.state.slots is not None:
            slot = self.state.slots.allocate()
            if slot is None:
                self.kv.release(blocks)
                raise KVBlocksBusy("every recurrent state slot is taken")
        holding = Holding(blocks, slot)
        state = SequenceState(holding, capacity, 0, 0, SamplingParams(), (), None, admitted=next(self._admissions))
        # Blocks and slot go back when the state is dropped, on whichever path and thread drops it.
        weakref.finalize(state, self._give_back, holding)
        return state

    def _give_back(self, holding: Holding) -> None:
        """Return a holding's blocks and slot (once, from any thread): now if the engine is idle or
        this is its own thread, else at the end of its current call, since the call may still write
        into them and must not hand them to another sequence meanwhile."""
        if self._busy.acquire(blocking=False):
            try:
                self._return(holding)
            finally:
                self._busy.release()
        else:
            with self._deferred_lock:
                self._deferred.append(holding)

    def _return(self, holding: Holding) -> None:
        if holding.returned:
            return
        holding.returned = True
        self.kv.release(holding.blocks)
        if holding.slot is not None:
            self.state.slots.release(holding.slot)

    def _exclusive(self, call):
        """``call()`` as the engine's one call at a time; what was given back meanwhile returns after."""
        with self._busy:
            try:
                return call()
            finally:
                with self._deferred_lock:
                    deferred, self._deferred = self._deferred, []
                for holding in deferred:
                    self._return(holding)

    def _blocks_short(self, state: SequenceState, positions: int) -> int:
        """Blocks ``state`` lacks for ``positions`` positions (<= 0: none)."""
        return self.kv.blocks_for(positions) - len(state.holding.blocks)

    def _grow(self, state: SequenceState, positions: int) -> list[SequenceState]:
        """Blocks for ``positions`` positions of ``state``, preempting the newest-admitted sequences
        until they are free: ``state`` itself when it is the newest. Returns the preempted states."""
        need = self._blocks_short(state, positions)
        preempted: list[SequenceState] = []
        while need > 0:
            more = self.kv.allocate(need)
            if more is not None:
                state.holding.blocks.extend(more)
                break
            newest = max(self.sequences.items(), key=lambda entry: entry[1].admitted, default=None)
            victim = state if newest is None or newest[1].admitted < state.admitted else newest[1]
            if newest is not None and victim is newest[1]:
                self.sequences.pop(newest[0])
            self._give_back(victim.holding)
            preempted.append(victim)
            if victim is state:
                break
        return preempted

    # -- prefill --------------------------------------------------------------------------------

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
        if capacity > self.capacity_tokens:
            raise ResourceExhausted(
                f"KV cache too small: {capacity} positions asked, the whole cache holds {self.capacity_tokens} (--max-kv-tokens)"
            )
        if len(self.sequences) >= self.limits.max_sequences:
            raise ResourceExhausted(f"{len(self.sequences)} sequences are live, the limit is {self.limits.max_sequences}")
        # Opened until the sequence is live: a Release arriving meanwhile (or before) makes this
        # prefill end with ABORTED instead of leaving a sequence nobody will release.
        self.sequences.open(sequence_id)
        state = None

        def create() -> PrefillResult:
            nonlocal state
            state = self._new_state(n, capacity)
            return self._prefill(state, tokens, sampling, taps, feature_rows, feature_dtype, top_logprobs)

        try:
            result = self._exclusive(create)
            self.sequences.finish(sequence_id, state)
        except BaseException:
            self.sequences.abandon(sequence_id)
            if state is not None:
                self._give_back(state.holding)
            raise
        return result

    def _prefill(
        self,
        state: SequenceState,
        tokens: Sequence[int],
        sampling: SamplingParams,
        taps: tuple[int, ...],
        feature_rows: int,
        feature_dtype: torch.dtype | None,
        top_logprobs: int | None = None,
    ) -> PrefillResult:
        n = len(tokens)
        t0 = time.perf_counter_ns()
        rows = n if feature_rows <= 0 else min(feature_rows, n)
        # The features go to the host chunk by chunk (they leave on the wire from there), so the
        # device never holds a whole prompt's: 1.6 GiB for 16K positions of five 5120-wide taps.
        features, logits = None, None
        chunk = self.prompt_chunk
        for begin in range(0, n, chunk):
            end = min(n, begin + chunk)
            causal = np.tril(np.ones((end - begin, end - begin), dtype=bool))
            chain = np.arange(-1, end - begin - 1)
            layout = pass_layout(
                self.kv, [tokens[begin:end]], [chain], [begin], [state.holding.blocks], [causal], [state.holding.slot]
            )
            logits, chunk_features = self.runner.run(layout, taps, prompt_chunk=True)
            if chunk_features is not None and end > n - rows:
                first = max(0, n - rows - begin)  # the chunk's first row that is asked for
                if features is None:
                    width, dtype = chunk_features.shape[1], feature_dtype or self.dtype
                    features = torch.empty((rows, width), dtype=dtype, pin_memory=self.device.type == "cuda")
                at = begin + first - (n - rows)
                # Stream-ordered: the copy is read before the next replay rewrites the pass's buffers.
                features[at : at + end - begin - first].copy_(chunk_features[first:].to(features.dtype), non_blocking=True)
        next_token = int(draw_tokens(logits[-1:], torch.tensor([n], device=self.device), sampling)[0])
        if features is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the last chunks' copies
        logprob = None
        if top_logprobs is not None:
            logprob = token_logprobs(logits[-1:], [next_token], sampling, top_logprobs)[0]
        state.length, state.pending_token, state.sampling = n, next_token, sampling
        state.taps, state.feature_dtype, state.top_logprobs = taps, feature_dtype, top_logprobs
        return PrefillResult(next_token, features, time.perf_counter_ns() - t0, logprob)

    # -- verify ---------------------------------------------------------------------------------

    def verify(self, sequence_id: str, tokens: Sequence[int], parents: Sequence[int], return_features: bool = False) -> VerifyResult:
        """One sequence's step: :meth:`verify_batch` of one, raising its error."""
        result = self.verify_batch([VerifyStep(sequence_id, tokens, parents, return_features)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def verify_batch(self, steps: Sequence[VerifyStep]) -> list[VerifyResult | ServiceError]:
        """Verify the steps of several sequences in one forward pass. Each step's result, or the
        error that step alone failed with, in the order given. (:meth:`prepare_pass`,
        :meth:`launch_pass`, :meth:`settle_pass`, :meth:`finish_pass` in turn.)"""

        def whole() -> list[VerifyResult | ServiceError]:
            verify = self.prepare_pass(steps)
            self.launch_pass(verify)
            self.settle_pass(verify)
            return self.finish_pass(verify)

        return self._exclusive(whole)

    def prepare_pass(self, steps: Sequence[VerifyStep], busy: frozenset[str] = frozenset()) -> VerifyPass | None:
        """The host work of a pass over ``steps``: check each, take its blocks, lay the rows out and
        write the inputs. Nothing here waits for the device, so it may run while the pass of the
        ``busy`` sequences is still on it (launched, not settled), which its steps must not name:
        then it takes no block that would need a preemption (one could hit a sequence of that pass)
        and answers None instead, to be prepared again once that pass is settled."""
        return self._exclusive(lambda: self._prepare_pass(steps, busy))

    def _prepare_pass(self, steps: Sequence[VerifyStep], busy: frozenset[str]) -> VerifyPass | None:
        started = time.perf_counter_ns()
        results: list[VerifyResult | ServiceError | None] = [None] * len(steps)
        work: list[_Work] = []
        seen: set[str] = set()
        for i, step in enumerate(steps):
            if step.sequence_id in busy:
                raise RuntimeError(f"sequence {step.sequence_id!r} is in the pass on the device")
            try:
                if step.sequence_id in seen:
                    raise FailedPrecondition(f"sequence_id {step.sequence_id!r} has two steps in one pass")
                work.append(self._check(i, step))
                seen.add(step.sequence_id)
            except ServiceError as exc:
                results[i] = exc
        if busy and sum(self._blocks_short(w.state, w.state.length + len(w.row_tokens)) for w in work) > self.kv.free_blocks:
            return None
        work = self._reserve(work, results)
        verify = VerifyPass(results, work, started)
        if work:
            verify.taps = _union_taps([item.state.taps for item in work])
            verify.layout = pass_layout(
                self.kv, [w.row_tokens for w in work], [w.rows for w in work], [w.state.length for w in work],
                [w.state.holding.blocks for w in work], [w.tree for w in work], [w.state.holding.slot for w in work],
            )
            verify.staged = self.runner.stage(verify.layout, verify.taps)
        return verify

    def launch_pass(self, verify: VerifyPass, ahead: bool = False) -> None:
        """Start the pass on the device. ``ahead``: it was prepared while the pass before was on the
        device, so its time (``VerifyResult.forward_ns``) runs from now, not from its preparation."""
        if not verify.work:
            return
        self._exclusive(lambda: self._launch_pass(verify, ahead))

    def _launch_pass(self, verify: VerifyPass, ahead: bool) -> None:
        if ahead:
            verify.started_ns = time.perf_counter_ns()
        verify.unmeasured_before = self.runner.unmeasured  # a capture, or a stopgap until one, is no measure of a pass
        if self._pass_thread is not None:
            verify.computing = self._pass_thread.submit(self.runner.launch, verify.staged)
            return
        verify.logits, verify.features = self.runner.launch(verify.staged)
        if self.device.type == "cuda":
            verify.launched = torch.cuda.Event()
            verify.launched.record()

    def settle_pass(self, verify: VerifyPass) -> None:
        """Read the pass's tokens (waiting for the device), walk each tree and commit the accepted
        rows; the logprobs and features asked for are taken out of the runner's buffers (features
        copied to the host asynchronously), which the next pass may then rewrite: launch it after."""
        if verify.work:
            self._exclusive(lambda: self._settle_pass(verify))

    def pass_running(self, verify: VerifyPass) -> bool:
        """Whether the device (a CPU's pass thread) is still on the launched pass."""
        if verify.computing is not None:
            return not verify.computing.done()
        return verify.launched is not None and not verify.launched.query()

    def wait_pass(self, verify: VerifyPass) -> None:
        """Block until the device has run the launched pass (its settle then waits for nothing)."""
        if verify.computing is not None:
            concurrent.futures.wait([verify.computing])
        elif verify.launched is not None:
            verify.launched.synchronize()

    def finish_pass(self, verify: VerifyPass) -> list[VerifyResult | ServiceError]:
        """Each step's result (host work only, after :meth:`settle_pass`; it may overlap the next pass)."""
        if verify.work:
            self._exclusive(lambda: self._finish_pass(verify))
        return verify.results  # type: ignore[return-value]

    def _check(self, index: int, step: VerifyStep) -> _Work:
        state = self._get(step.sequence_id)
        if len(step.tokens) or len(step.parents):  # a decode step (no tree) has nothing to check
            try:
                validate_tree(
                    np.asarray(step.tokens, dtype=np.int64), np.asarray(step.parents, dtype=np.int64), self.config.vocab_size,
                    self.limits.max_tree_nodes,
                )
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
        n = len(step.tokens)
        if state.length + n + 1 > state.capacity:
            raise FailedPrecondition(
                f"tokens: a tree of {n} nodes needs {state.length + n + 1} positions, sequence reserved {state.capacity}"
            )
        return _work(index, state, step)

    def _reserve(self, work: list[_Work], results: list) -> list[_Work]:
        """Blocks for every step's rows; steps whose sequence was preempted to make room (the
        pass has not run: a step of the pass gives way too) fail NOT_FOUND."""
        dropped: set[int] = set()
        for item in work:
            if id(item.state) in dropped:
                continue
            for victim in self._grow(item.state, item.state.length + len(item.row_tokens)):
                dropped.add(id(victim))
        kept = []
        for item in work:
            if id(item.state) in dropped:
                results[item.index] = NotFound(
                    f"sequence_id {item.step.sequence_id!r} was preempted: the KV cache ran out of blocks; prefill it again"
                )
            else:
                kept.append(item)
        return kept

    def _settle_pass(self, verify: VerifyPass) -> None:
        if verify.computing is not None:  # its error, if it raised, fails the pass here
            verify.logits, verify.features = verify.computing.result()
        measured = self.runner.unmeasured == verify.unmeasured_before
        work, layout, logits = verify.work, verify.layout, verify.logits
        positions = torch.from_numpy(layout.positions)  # host: only seeded sampling reads them
        greedy = logits.argmax(dim=-1).cpu().numpy()  # [N] every greedy sequence's tokens at once
        walks = []  # (first row, accepted rows, bonus) of each sequence
        for s, item in enumerate(work):
            first, last = int(layout.offsets[s]), int(layout.offsets[s + 1])
            if item.state.sampling.greedy:
                target_tokens = greedy[first:last]
            else:
                target_tokens = draw_tokens(logits[first:last], positions[first:last], item.state.sampling).cpu().numpy()
            walks.append((first, *accept_path(item.tokens, item.parents, target_tokens)))
        # One commit for the pass: a recurrent family advances every sequence's state in a few launches.
        self._commit([(item.state, accepted, first) for item, (first, accepted, _) in zip(work, walks)])
        feature_rows: list[int] = []
        for item, (first, accepted, next_token) in zip(work, walks):
            state = item.state
            committed = [state.pending_token] + [int(item.tokens[a - 1]) for a in accepted[1:]]
            logprobs = None
            if state.top_logprobs is not None:
                # Token i of committed[1:] + [bonus] was drawn at row accepted[i] (its parent's row).
                rows = logits.index_select(0, torch.tensor([first + a for a in accepted], device=logits.device))
                logprobs = token_logprobs(rows, committed[1:] + [int(next_token)], state.sampling, state.top_logprobs)
            state.pending_token = int(next_token)
            if item.step.return_features and verify.features is not None and state.taps:
                feature_rows.extend(first + a for a in accepted)
            verify.results[item.index] = VerifyResult(committed, accepted[1:], int(next_token), None, state.length, 0, logprobs)
        if feature_rows:
            # Out of the runner's buffer before the next pass rewrites it; to the host without waiting.
            rows = verify.features.index_select(0, torch.tensor(feature_rows, device=verify.features.device))
            verify.feature_host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self.device.type == "cuda")
            verify.feature_host.copy_(rows, non_blocking=True)
            if self.device.type == "cuda":
                verify.features_copied = torch.cuda.Event()
                verify.features_copied.record()
        verify.logits = verify.features = None
        verify.elapsed_ns = time.perf_counter_ns() - verify.started_ns if measured else 0

    def _finish_pass(self, verify: VerifyPass) -> None:
        if verify.features_copied is not None:
            verify.features_copied.synchronize()
        results = [verify.results[item.index] for item in verify.work]
        self._attach_features(verify.work, results, verify.feature_host, verify.taps)
        for result in results:
            result.forward_ns, result.pass_rows, result.pass_sequences = verify.elapsed_ns, verify.layout.num_rows, len(verify.work)

    def commit(self, state: SequenceState, accepted: Sequence[int], first_row: int = 0) -> None:
        """Keep the accepted rows (``[AL]``, root first) of ``state``'s block in the last pass, whose
        rows start at ragged row ``first_row``: K/V compacted down to ``state.length ..``, and the
        recurrent state advanced to the deepest accepted row's."""
        self._commit([(state, accepted, first_row)])

    def _commit(self, commits: Sequence[tuple[SequenceState, Sequence[int], int]]) -> None:
        """:meth:`commit` of several sequences of the last pass: ``(state, accepted, first_row)``."""
        self.kv.compact([(state.holding.blocks, state.length, accepted) for state, accepted, _ in commits])
        if self.state.slots is not None:
            self.state.slots.commit_paths([(state.holding.slot, [first + int(a) for a in accepted]) for state, accepted, first in commits])
        for state, accepted, _ in commits:
            state.length += len(accepted)

    def sequence_cache(self, state: SequenceState) -> SimpleNamespace:
        """A sequence's state gathered out of the pools (tests and tools): ``k``, ``v`` ``[layers,
        H_kv, positions, D]`` over its blocks, and a recurrent family's per-sequence tensors."""
        positions = np.arange(len(state.holding.blocks) * self.kv.block_size)
        slots = torch.from_numpy(self.kv.slots(state.holding.blocks, positions)).to(self.device)
        parts = {"k": self.kv.k.index_select(2, slots), "v": self.kv.v.index_select(2, slots)}
        if self.state.slots is not None:
            parts.update(self.state.slots.read(state.holding.slot))
        return SimpleNamespace(**parts)

    def _attach_features(self, work: list[_Work], results: list[VerifyResult], host: torch.Tensor | None, taps: tuple[int, ...]) -> None:
        """Every asking sequence's features out of ``host`` ``[sum AL, union taps * hidden]``, the
        accepted rows of each in the pass's order."""
        if host is None:
            return
        hidden = host.shape[1] // len(taps)
        at = 0
        for item, result in zip(work, results):
            state = item.state
            if not (item.step.return_features and state.taps):
                continue
            count = len(result.committed_tokens)
            rows = host[at : at + count]
            at += count
            if state.taps != taps:  # this sequence's taps, in its order, out of the union
                rows = torch.cat([rows[:, taps.index(t) * hidden : (taps.index(t) + 1) * hidden] for t in state.taps], dim=1)
            result.features = rows.to(state.feature_dtype or self.dtype)

    def tree_forward(self, state: SequenceState, tokens: np.ndarray, parents: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One sequence's pass over ``[root, nodes]`` without acceptance (tests and tools): logits
        [n+1, vocab], features [n+1, taps * hidden], positions [n+1]. The rows' K/V and candidate
        states are written as a verify's are; a verify afterwards rewrites them."""
        return self._exclusive(lambda: self._tree_forward(state, tokens, parents))

    def _tree_forward(self, state: SequenceState, tokens: np.ndarray, parents: np.ndarray):
        item = _work(0, state, VerifyStep("", tokens, parents))
        self._grow(state, state.length + len(item.row_tokens))
        layout = pass_layout(
            self.kv, [item.row_tokens], [item.rows], [state.length], [state.holding.blocks], [item.tree], [state.holding.slot]
        )
        logits, features = self.runner.run(layout, state.taps)
        return logits, features, torch.from_numpy(layout.positions)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


# A decode step's block, shared by every one: the root alone (read-only, as they are shared).
_NO_NODES, _ROOT_ROWS, _ROOT_TREE = _frozen(np.zeros(0, np.int64)), _frozen(np.array([-1])), _frozen(np.ones((1, 1), bool))


def _work(index: int, state: SequenceState, step: VerifyStep) -> _Work:
    """The rows of a (checked) step: ``[root, nodes]``, their parent rows and ancestor-only visibility."""
    if not len(step.tokens) and not len(step.parents):  # a decode step; a batch of many AR users is all of them
        return _Work(index, state, step, _NO_NODES, _NO_NODES, [state.pending_token], _ROOT_ROWS, _ROOT_TREE)
    tokens = np.asarray(step.tokens, dtype=np.int64)
    parents = np.asarray(step.parents, dtype=np.int64)
    item = _Work(index, state, step, tokens, parents, [state.pending_token, *tokens.tolist()])
    item.rows = np.concatenate([[-1], parents])  # node j is row j, its parent's row is its parent node
    item.tree = tree_attention_mask(parents) if len(tokens) else np.ones((1, 1), dtype=bool)
    return item


def _union_taps(taps: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """One tap list covering every sequence's: the common one when they agree (the usual case)."""
    first = taps[0]
    if all(t == first for t in taps):
        return first
    return tuple(sorted(set().union(*taps)))
