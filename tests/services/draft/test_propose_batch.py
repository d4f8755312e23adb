"""Batched Propose: several sequences' steps in one block pass give, per sequence, what ``propose``
gives that sequence alone, and a bad step fails alone."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from native import paged_attention
from services.draft import graphs as graphs_module
from services.draft.engine import DraftEngine, Proposal, ProposeStep, host_groups
from services.draft.graphs import BlockGraphs, padded_batch
from splitspec.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from splitspec.models.loader import load_dflash_draft, load_target_head
from tests.services.graph_capture import CaptureOnCpu

# Per sequence: prompt length, window, top_k, then the new rows of each later step. The contexts
# differ in length; "b" and "d" attend to windows (and compact their caches); "a" and "c" share a
# top_k, so one top-K call serves both while "b" and "d" get their own.
SEQUENCES = {
    "a": (5, 0, 5, [1, 4, 2]),
    "b": (23, 8, 3, [2, 20, 1]),  # 20 new rows: more than a block (16)
    "c": (40, 0, 5, [7, 1, 5]),
    "d": (12, 16, 8, [3, 9, 20]),
}
# Who steps in each round: everyone, then three of them, then one (a pass of one sequence) and all
# again; each sequence steps once more than it has row counts (its first step is its prompt).
ROUNDS = ["abcd", "abcd", "abd", "c", "abcd"]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def drafts(tiny_pair):
    """The tiny pair's draft, embedding and LM head, loaded in each dtype (the loader fuses the
    projections in the dtype it loads)."""
    loaded = {}
    for dtype in TOLERANCE:
        model, cfg = load_dflash_draft(tiny_pair.draft, dtype=dtype)
        embed, head, _ = load_target_head(tiny_pair.target, dtype=dtype)
        loaded[dtype] = model, cfg, embed, head
    return loaded


@pytest.fixture(scope="module")
def draft(drafts):
    return drafts[torch.float32]


def make_engine(model, embed, head, fixed_shapes: bool, **kwargs) -> DraftEngine:
    # Two context slots for four sequences: the others grow their own caches, as they would in a worker.
    graphs = BlockGraphs(model, embed, head, context=96, sequences=2, capture=False) if fixed_shapes else None
    return DraftEngine(model, embed, head, graphs=graphs, **kwargs)


class Script:
    """Each sequence's steps: random tap features and anchors, and where its context ends."""

    def __init__(self, cfg, dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        width = cfg.num_taps * cfg.hidden_size
        self.features = {sid: torch.randn(100, width, generator=g, dtype=torch.float64).to(dtype) for sid in SEQUENCES}
        self.anchors = {sid: torch.randint(0, 200, (len(ROUNDS),), generator=g).tolist() for sid in SEQUENCES}
        self.ends = {sid: 0 for sid in SEQUENCES}
        self.steps_taken = {sid: 0 for sid in SEQUENCES}

    def step(self, sid: str) -> ProposeStep:
        prompt, window, top_k, rows = SEQUENCES[sid]
        n = self.steps_taken[sid]
        start = self.ends[sid]
        end = prompt if n == 0 else start + rows[n - 1]
        self.ends[sid], self.steps_taken[sid] = end, n + 1
        return ProposeStep(sid, self.anchors[sid][n], end, self.features[sid][start:end], top_k, window)


def propose_alone(engine: DraftEngine, step: ProposeStep) -> Proposal:
    return engine.propose(step.sequence_id, step.anchor_token, step.anchor_position, step.features, step.top_k, step.window)


def assert_same(batched: Proposal, alone: Proposal, dtype: torch.dtype) -> None:
    assert torch.equal(batched.top_ids, alone.top_ids)
    torch.testing.assert_close(batched.top_logprobs, alone.top_logprobs, rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("dtype", "fixed_shapes", "native"),
    [
        (torch.float64, False, "0"), (torch.float64, True, "0"), (torch.float32, False, "0"), (torch.float32, True, "0"),
        (torch.float32, False, "1"),  # the kernels on the batch's shapes (Triton's interpreter: slow, one round)
    ],
    ids=["float64-eager", "float64-fixed-shapes", "float32-eager", "float32-fixed-shapes", "float32-eager-kernels"],
)
def test_batch_matches_each_sequence_alone(drafts, dtype, fixed_shapes, native, monkeypatch):
    """Over consecutive steps (features appended between them, windows compacting), every
    sequence of a batch gets the top ids and log-probs ``propose`` gives it in an engine of its own
    (with fixed shapes, the fixed-shape pass of one sequence)."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
    model, cfg, embed, head = drafts[dtype]
    batch_engine = make_engine(model, embed, head, fixed_shapes)
    alone_engine = make_engine(model, embed, head, fixed_shapes)
    script = Script(cfg, dtype)
    rounds = ROUNDS[:1] if native == "1" else ROUNDS
    for members in rounds:
        steps = [script.step(sid) for sid in members]
        results = batch_engine.propose_batch(steps)
        assert all(isinstance(r, Proposal) for r in results), results
        # With fixed shapes "a" and "b" hold the two slots: they run one batched pass, "c" and "d" another.
        slotted = [batch_engine.sequences.get(step.sequence_id).cache.slot is not None for step in steps]
        for step, result, in_slot in zip(steps, results, slotted):
            assert_same(result, propose_alone(alone_engine, step), dtype)
            assert result.top_ids.shape == (cfg.block_size - 1, step.top_k)
            assert result.pass_sequences == slotted.count(in_slot)
        for group in (True, False):  # one pass per group, timed once
            times = {r.forward_ns for r, in_slot in zip(results, slotted) if in_slot == group}
            assert len(times) <= 1 and all(t > 0 for t in times)
        assert set(slotted) == ({True, False} if fixed_shapes and len(steps) > 1 else {False})
        # The sequences' proposals differ: a pass that mixed up their contexts could not match.
        best = [r.top_logprobs[:, 0] for r in results]  # [B-1] each
        assert all((x - y).abs().max() > 1e-3 for i, x in enumerate(best) for y in best[:i])
    for sid, (prompt, window, _, rows) in SEQUENCES.items():
        seq = batch_engine.sequences.get(sid)
        assert seq.ctx_end == prompt + sum(rows[: sum(sid in members for members in rounds) - 1])
        if window:  # compacted to the window once past twice it
            assert seq.cache.size <= 2 * window


def test_new_rows_of_several_steps_go_in_chunks_and_match_each_alone(drafts, monkeypatch):
    """The steps' new rows are projected in chunks of at most ``APPEND_CHUNK`` rows (16 here),
    a prompt's split across chunks and several steps' short runs joined in one: every chunk fits,
    every row is projected once, and each sequence still gets what it gets alone."""
    monkeypatch.setattr("services.draft.engine.APPEND_CHUNK", 16)
    model, cfg, embed, head = drafts[torch.float64]
    batch_engine = make_engine(model, embed, head, False)
    alone_engine = make_engine(model, embed, head, False)
    chunks = []  # a spy: the real method runs
    context_kv = model.context_kv
    monkeypatch.setattr(model, "context_kv", lambda f, p: chunks.append((len(f), p.tolist())) or context_kv(f, p))
    script = Script(cfg, torch.float64)
    for members in ROUNDS[:2]:
        steps = [script.step(sid) for sid in members]
        chunks.clear()
        results = batch_engine.propose_batch(steps)
        sizes = [n for n, _ in chunks]
        assert max(sizes) <= 16 and sum(sizes) == sum(step.rows for step in steps)
        # Positions run through each step's rows in order, chunk after chunk.
        positions = [q for _, p in chunks for q in p]
        assert positions == [q for step in steps for q in range(step.anchor_position - step.rows, step.anchor_position)]
        calls = len(chunks)
        for step, result in zip(steps, results):
            assert_same(result, propose_alone(alone_engine, step), torch.float64)
    assert calls == 1  # the second round's short runs (1, 2, 7 and 3 rows) shared one chunk


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_depths_are_the_first_rows_of_every_depth(drafts, dtype, fixed_shapes):
    """A step that asks for depths 1..D gets the first D rows of what it gets asking for every
    depth (0, or more than the block has: B-1), in a batch of steps asking for different depths
    and alone, over consecutive steps."""
    model, cfg, embed, head = drafts[dtype]
    cut_engine, full_engine = (make_engine(model, embed, head, fixed_shapes) for _ in range(2))
    cut_script, full_script = Script(cfg, dtype), Script(cfg, dtype)
    depths = {"a": 1, "b": 3, "c": 0, "d": 40}
    for members in ROUNDS:
        steps = [replace(cut_script.step(sid), depths=depths[sid]) for sid in members]
        full = full_engine.propose_batch([full_script.step(sid) for sid in members])
        for step, got, want in zip(steps, cut_engine.propose_batch(steps), full):
            d = min(depths[step.sequence_id] or cfg.block_size - 1, cfg.block_size - 1)
            assert got.top_ids.shape == got.top_logprobs.shape == (d, step.top_k)
            assert torch.equal(got.top_ids, want.top_ids[:d])
            torch.testing.assert_close(got.top_logprobs, want.top_logprobs[:d], rtol=0, atol=TOLERANCE[dtype])


def test_ties_break_as_alone(drafts):
    """A vocabulary of tokens in tied groups of four (LM head rows repeated): every top-K cuts
    through ties, and with different top_k in one batch each sequence's ids still come out in the
    order ``propose`` gives them alone (torch.topk orders ties differently for different K)."""
    model, cfg, embed, head = drafts[torch.float64]
    tied = head[torch.arange(head.shape[0]) // 4 * 4]  # [vocab, hidden]: token t scores as token t - t % 4
    batch_engine = make_engine(model, embed, tied, fixed_shapes=False)
    alone_engine = make_engine(model, embed, tied, fixed_shapes=False)
    features = torch.randn(30, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    steps = [ProposeStep(f"s{k}", 7, 30, features, k) for k in (2, 3, 5, 6, 7, 10, 13)]  # one context, many K
    results = batch_engine.propose_batch(steps)
    for step, result in zip(steps, results):
        alone = propose_alone(alone_engine, step)
        assert torch.equal(result.top_ids, alone.top_ids)
        assert torch.equal(result.top_logprobs, alone.top_logprobs)
        assert result.pass_sequences == len(steps)
    ties = results[-1].top_logprobs  # [B-1, 13]: groups of four equal log-probs
    assert (ties[:, 1:] == ties[:, :-1]).sum() >= ties.shape[0] * 9


def test_bad_steps_fail_alone(draft):
    """Each bad step gets its own precise error and leaves its sequence as it was; the good steps
    of the same batch run in one pass of their own and match ``propose`` alone."""
    model, cfg, embed, head = draft
    width = cfg.num_taps * cfg.hidden_size
    engine = make_engine(model, embed, head, fixed_shapes=False, max_sequences=6)
    alone_engine = make_engine(model, embed, head, fixed_shapes=False)
    g = torch.Generator().manual_seed(5)
    features = {sid: torch.randn(40, width, generator=g) for sid in "abcdex"}
    prompts = {"a": 10, "b": 6, "c": 8, "d": 9, "e": 8}
    for sid, end in prompts.items():
        for e in (engine, alone_engine):
            propose_alone(e, ProposeStep(sid, 1, end, features[sid][:end], 3))
    engine.sequences.pop("gone", context=2)

    def live(sid: str) -> tuple[int, int]:
        return engine.sequences.get(sid).ctx_end, engine.sequences.get(sid).cache.size

    before = {sid: live(sid) for sid in "cde"}
    steps = [
        ProposeStep("a", 11, 12, features["a"][10:12], 4),
        ProposeStep("new", 3, 5, None, 4),  # unknown, and no features to start it with
        ProposeStep("c", 3, 9, features["c"][8:9], 0),  # top_k 0
        ProposeStep("b", 12, 9, features["b"][6:9], 2, window=4),
        ProposeStep("d", 3, 10, torch.zeros(1, width + 1), 4),  # a feature row of the wrong width
        ProposeStep("a", 3, 13, features["a"][12:13], 4),  # a's second step in the batch
        ProposeStep("e", 3, 12, features["e"][9:12], 4),  # starts at 9, e's context ends at 8
        ProposeStep("gone", 3, 4, features["x"][:4], 4, context=2),  # context 2 was released
        ProposeStep("x", 3, 4, features["x"][:4], 4),  # a sixth live context: at the limit
        ProposeStep("y", 3, 4, features["x"][:4], 4),  # a seventh: over it
        ProposeStep("", 3, 4, features["x"][:4], 4),  # no sequence_id
        ProposeStep("f", 10**6, 4, features["x"][:4], 4),  # anchor outside the vocabulary
        ProposeStep("g", 3, 4, features["x"][:4], 4, window=-1),
        ProposeStep("h", 3, 4, features["x"][:4], 4, depths=-1),
    ]
    expected = [
        None,
        (FailedPrecondition, "'new' is new to the draft worker and carries no features"),
        (InvalidArgument, r"top_k: 0 is outside \[1, "),
        None,
        (InvalidArgument, rf"features: shape \(1, {width + 1}\) is not \[rows, {width}\]"),
        (FailedPrecondition, "sequence_id 'a' has more than one step in this batch"),
        (FailedPrecondition, "the draft context ends at position 8 but 3 rows before anchor_position 12 start at 9"),
        (Aborted, "context 2 of sequence 'gone' was released"),
        None,
        (ResourceExhausted, "6 draft contexts are live, the limit is 6"),
        (InvalidArgument, "sequence_id must not be empty"),
        (InvalidArgument, r"anchor_token: 1000000 is outside \[0, "),
        (InvalidArgument, "window: -1 must be >= 0"),
        (InvalidArgument, "depths: -1 must be >= 0"),
    ]
    results = engine.propose_batch(steps)
    assert len(results) == len(expected)
    for step, result, want in zip(steps, results, expected):
        if want is None:
            assert isinstance(result, Proposal), (step.sequence_id, result)
            assert_same(result, propose_alone(alone_engine, step), torch.float32)
            assert result.pass_sequences == 3  # a, b and x: the refused steps ran nothing
        else:
            kind, message = want
            assert type(result) is kind, (step.sequence_id, result)
            with pytest.raises(kind, match=message):
                raise result
    # The refused steps left nothing behind: no new contexts, the live ones as they were, and
    # those take their next steps.
    assert not any(sid in engine.sequences for sid in ("new", "y", "gone", "f", "g"))
    assert {sid: live(sid) for sid in "cde"} == before
    assert engine.sequences.get("a").ctx_end == 12  # the second step appended nothing
    retry = [ProposeStep(sid, 3, prompts[sid] + 1, features[sid][prompts[sid] : prompts[sid] + 1], 4) for sid in "cde"]
    for step, result in zip(retry, engine.propose_batch(retry)):
        assert_same(result, propose_alone(alone_engine, step), torch.float32)


def test_propose_raises_its_steps_error(draft):
    """``propose`` is the batch of one: its step's error is raised, not returned."""
    model, cfg, embed, head = draft
    engine = make_engine(model, embed, head, fixed_shapes=False)
    with pytest.raises(InvalidArgument, match="top_k"):
        engine.propose("s", 1, 4, torch.zeros(4, cfg.num_taps * cfg.hidden_size), top_k=0)
    assert "s" not in engine.sequences
    proposal = engine.propose("s", 1, 4, torch.zeros(4, cfg.num_taps * cfg.hidden_size), top_k=2)
    assert proposal.pass_sequences == 1 and proposal.top_ids.shape == (cfg.block_size - 1, 2)


# The batched fixed-shape pass (BlockGraphs.run_batch): per round, each member's new rows (its
# prompt first). Five of six sequences hold slots; "f" never does. Rounds pad 5 sequences to 8
# and 3 to 4, mix in-pass appends (up to a block), larger ones appended eagerly first and steps
# with no new rows, cross span 256 ("c" passes 240 positions), run a block-only pass, run one
# sequence alone ("c"), and "c" finally fills its slot (no room for a block) and joins "f" in the
# eager pass.
BATCHED = {  # sid: (window, top_k)
    "a": (0, 5), "b": (8, 3), "c": (0, 5), "d": (16, 8), "e": (0, 5), "f": (0, 5),
}
BATCHED_ROUNDS = [
    dict(a=5, b=23, c=200, d=12, e=40, f=30),
    dict(a=1, b=2, c=16, d=3, e=7, f=1),
    dict(a=4, c=30, e=0),
    dict(b=20, d=9),
    dict(a=0, c=0, e=0),
    dict(c=1),
    dict(a=16, b=1, c=260, d=20, e=3, f=2),
]
# (padded sequences, span, top-K values, appending) of each batched pass above.
BATCHED_SHAPES = {
    (8, 256, (3, 5, 8), True),  # rounds 1 and 2
    (4, 512, (5,), True),
    (2, 256, (3, 8), True),
    (4, 512, (5,), False),
    (4, 256, (3, 5, 8), True),  # round 7: "c" is out
    (1, 512, (5,), True),  # round 6: "c" alone
}
# Through the kernels (Triton's interpreter: slow): 3 sequences padded to 4, span 512, an in-pass
# append and eager ones, then in-pass appends with "b"'s window hiding the first 3 of its 11
# positions (the kernel read the whole prefix until the window's start was passed to it).
KERNEL_ROUNDS = [dict(a=5, b=23, c=250), dict(a=1, b=3, c=2)]


@pytest.mark.parametrize(
    ("dtype", "native"),
    [(torch.float64, "0"), (torch.float32, "1")],  # the kernels (paged attention, qkv_rope) on the batch's shapes
    ids=["float64", "float32-kernels"],
)
def test_batched_fixed_shapes_match_each_sequence_alone(drafts, dtype, native, monkeypatch):
    """The batched graph path's fixed shapes, run eagerly (CPU): every sequence gets what
    ``propose`` gives it in an engine of its own (the fixed-shape pass of one sequence), through
    padded batch sizes, padded appends, several spans and top-K values, and a sequence leaving
    its slot; the pad sequences' writes touch no slot."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
    paged = []  # a spy on the paged attention kernel: the real one runs
    kernel = paged_attention.paged_tree_attention
    monkeypatch.setattr(paged_attention, "paged_tree_attention", lambda *a, **kw: paged.append(a[0].shape) or kernel(*a, **kw))
    model, cfg, embed, head = drafts[dtype]
    context = 512
    graphs = BlockGraphs(model, embed, head, context=context, sequences=5, capture=False)
    batch_engine = DraftEngine(model, embed, head, graphs=graphs)
    alone_engine = DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, context=context, sequences=6, capture=False))
    g = torch.Generator().manual_seed(11)
    width = cfg.num_taps * cfg.hidden_size
    features = {sid: torch.randn(520, width, generator=g, dtype=torch.float64).to(dtype) for sid in BATCHED}
    ends = dict.fromkeys(BATCHED, 0)
    rounds = KERNEL_ROUNDS if native == "1" else BATCHED_ROUNDS
    for number, members in enumerate(rounds):
        steps = []
        for sid, rows in members.items():
            start, ends[sid] = ends[sid], ends[sid] + rows
            window, top_k = BATCHED[sid]
            steps.append(ProposeStep(sid, 3 * number + ord(sid), ends[sid], features[sid][start : ends[sid]], top_k, window))
        # Which pass each step runs in: new sequences take the free slots ("f" finds none).
        live = batch_engine.sequences
        in_slot = {s.sequence_id: graphs.fits(live.get(s.sequence_id).cache, s.rows) if s.sequence_id in live else s.sequence_id != "f"
                   for s in steps}
        results = batch_engine.propose_batch(steps)
        for step, result in zip(steps, results):
            assert isinstance(result, Proposal), result
            assert_same(result, propose_alone(alone_engine, step), dtype)
            assert result.pass_sequences == sum(in_slot[s.sequence_id] == in_slot[step.sequence_id] for s in steps)
        best = [r.top_logprobs[:, 0] for r in results]  # the proposals differ: no mixed-up contexts
        assert all((x - y).abs().max() > 1e-3 for i, x in enumerate(best) for y in best[:i])
    assert graphs.batch_shapes == (BATCHED_SHAPES if native == "0" else {(4, 512, (3, 5), True)})
    # With the kernels every layer of the batched pass read the pool through them: [S, H, B, D]
    # queries (the engine alone's passes are of one sequence).
    batched = [shape for shape in paged if shape[0] != 1]
    assert batched == ([(4, cfg.num_heads, cfg.block_size, cfg.head_dim)] * cfg.num_layers * len(rounds) if native == "1" else [])
    for sid, seq in batch_engine.sequences.items():  # slotted contexts never regrew
        assert (seq.cache.k[0].shape[1] == context) == (sid != "f")
    if native == "0":
        assert not graphs.fits(batch_engine.sequences.get("c").cache, 0)  # no room for a block: eager from round 7
    # The scratch region took the pad sequences' keys; it is the pool's last block of positions.
    assert graphs.pool[0][0].shape[1] == 5 * context + cfg.block_size
    assert graphs.pool[0][0][:, -cfg.block_size :].abs().sum() > 0


def test_padded_batch_sizes():
    # Powers of two up to 8 (one alone), then multiples of 4 up to 32, then of 16: never fewer than asked.
    assert [padded_batch(n) for n in (1, 2, 3, 5, 8, 9, 12, 13, 18, 21, 32, 33, 48, 49)] == [1, 2, 4, 8, 8, 12, 12, 16, 20, 24, 32, 48, 48, 64]
    assert all(n <= padded_batch(n) < n + 16 for n in range(1, 300))


def test_batch_of_nine_pads_to_twelve_after_warm_up(drafts):
    """The warm-up runs two passes (appending and not) per padded batch size (1, 2, 4, 8, 12 for
    nine slots) at the slots' span; then nine sequences in slots run as one pass of 12 (three pad sequences) whose shape the
    warm-up ran, each getting what it gets alone, in a first step (its prompt) and a second (a few
    new rows, appended in the pass): what the warm-up wrote into the slots is never read."""
    model, cfg, embed, head = drafts[torch.float64]
    graphs = BlockGraphs(model, embed, head, context=128, sequences=9, capture=False)
    assert graphs.warm_up(5) == 10
    warmed = {(s, 128, (5,), append) for s in (1, 2, 4, 8, 12) for append in (True, False)}
    assert graphs.batch_shapes == warmed
    batch_engine = DraftEngine(model, embed, head, graphs=graphs)
    alone_engine = DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, context=128, sequences=9, capture=False))
    g = torch.Generator().manual_seed(3)
    width = cfg.num_taps * cfg.hidden_size
    sids = [f"s{i}" for i in range(9)]
    features = {sid: torch.randn(40, width, generator=g, dtype=torch.float64) for sid in sids}
    for number, (first, last) in enumerate([(0, 20), (20, 23)]):
        steps = [ProposeStep(sid, 7 * i + number, last + i, features[sid][first + (i if number else 0) : last + i], 5, 0)
                 for i, sid in enumerate(sids)]
        results = batch_engine.propose_batch(steps)
        for step, result in zip(steps, results):
            assert isinstance(result, Proposal), result
            assert result.pass_sequences == 9
            assert_same(result, propose_alone(alone_engine, step), torch.float64)
    assert graphs.batch_shapes == warmed
    with pytest.raises(RuntimeError, match="slots are taken"):
        graphs.warm_up(5)  # the nine sequences hold their slots


def test_a_sequence_without_a_slot_is_seated_when_one_frees(drafts, caplog):
    """A sequence that found both slots taken runs eagerly until one frees, then is seated (its
    keys and values copied in) and joins the batched pass; one that outgrows its slot gives it
    back at once, and the next new sequence takes it. Every step gets what ``propose`` gives it
    in an engine of its own."""
    caplog.set_level(logging.INFO, logger="services.draft.engine")
    model, cfg, embed, head = drafts[torch.float64]
    graphs = BlockGraphs(model, embed, head, context=128, sequences=2, capture=False)
    batch_engine = DraftEngine(model, embed, head, graphs=graphs)
    alone_engine = DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, context=128, sequences=4, capture=False))
    g = torch.Generator().manual_seed(5)
    width = cfg.num_taps * cfg.hidden_size
    features = {sid: torch.randn(200, width, generator=g, dtype=torch.float64) for sid in "abcd"}
    ends = dict.fromkeys("abcd", 0)
    live = batch_engine.sequences

    def run(**rows: int) -> list[Proposal]:
        steps = []
        for sid, m in rows.items():
            start, ends[sid] = ends[sid], ends[sid] + m
            steps.append(ProposeStep(sid, ord(sid) + ends[sid], ends[sid], features[sid][start : ends[sid]], 5, 0))
        results = batch_engine.propose_batch(steps)
        for step, result in zip(steps, results):
            assert isinstance(result, Proposal), result
            assert_same(result, propose_alone(alone_engine, step), torch.float64)
        return results

    run(a=20, b=20, c=20)
    assert [live.get(sid).cache.slot is not None for sid in "abc"] == [True, True, False] and graphs.seated == 2
    slot_a = live.get("a").cache.slot
    live.pop("a")
    assert graphs.seated == 1  # back at once: the cache is garbage
    assert [r.pass_sequences for r in run(b=3, c=2)] == [2, 2]  # c seated in a's slot: one batched pass
    assert live.get("c").cache.slot == slot_a and live.get("c").cache.k[0].shape[1] == 128
    assert f"sequence c seated in slot {slot_a} with 20 context positions" in caplog.text
    assert [r.pass_sequences for r in run(b=1, c=4)] == [2, 2]
    run(b=2, c=110)  # c: 136 rows outgrow the slot's 128 positions: eager, and the slot goes back
    assert live.get("c").cache.slot is None and live.get("c").cache.k[0].shape[1] > 128 and graphs.seated == 1
    caplog.clear()
    run(b=1, c=1, d=30)  # d takes the slot c gave back (new: nothing logged)
    assert "seated" not in caplog.text
    assert live.get("d").cache.slot == slot_a and graphs.seated == 2
    for sid in "bcd":
        live.pop(sid)
    assert graphs.seated == 0


def test_host_groups_join_short_runs_and_keep_a_prompt_alone():
    """Steps' short runs (at most a block) between prompts share a group, joined on the host for
    one copy; a prompt's rows are a group of their own, copied as they came."""
    rows = [1, 7, 16, 40, 3, 2, 17, 5]
    groups = host_groups([torch.zeros(r, 2) for r in rows], 16)
    assert [[len(f) for f in g] for g in groups] == [[1, 7, 16], [40], [3, 2], [17], [5]]


def test_warm_up_runs_the_span_of_a_slot_capped_below_a_power_of_two(drafts):
    """A slot of 300 positions caps a pass's span at 300 (not 512): the warm-up runs that span too,
    so a sequence whose context ends past 256 - B positions meets a warmed shape (on a GPU: no
    capture while serving)."""
    model, cfg, embed, head = drafts[torch.float64]
    graphs = BlockGraphs(model, embed, head, context=300, sequences=2, capture=False)
    graphs.warm_up(5)
    warmed = {(s, span, (5,), append) for s in (1, 2) for span in (256, 300) for append in (True, False)}
    assert graphs.batch_shapes == warmed
    engine = DraftEngine(model, embed, head, graphs=graphs)
    width = cfg.num_taps * cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    for number, (first, last) in enumerate([(0, 270), (270, 273)]):  # a prompt past 256 - B, then a step
        steps = [ProposeStep(sid, 3 + i, last + i, torch.randn(last - first + (0 if number else i), width, generator=g, dtype=torch.float64), 5)
                 for i, sid in enumerate("ab")]
        assert all(isinstance(r, Proposal) and r.pass_sequences == 2 for r in engine.propose_batch(steps))
    assert graphs.batch_shapes == warmed


def test_a_failed_capture_runs_its_shape_eagerly_and_the_others_keep_their_graphs(drafts, monkeypatch, caplog):
    """The first batched shape met fails to capture (as when another thread's CUDA call invalidated
    it): its passes run eagerly from then on, never captured again, while the next shape is
    captured and replayed; every proposal equals the sequence's alone (float64)."""
    model, cfg, embed, head = drafts[torch.float64]
    stub = CaptureOnCpu(fail=(1,))
    monkeypatch.setattr(graphs_module, "capture", stub)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    graphs = BlockGraphs(model, embed, head, context=96, sequences=2, capture=True)
    engine = DraftEngine(model, embed, head, graphs=graphs)
    alone = DraftEngine(model, embed, head)
    width = cfg.num_taps * cfg.hidden_size
    g = torch.Generator().manual_seed(11)
    features = {sid: torch.randn(30, width, generator=g, dtype=torch.float64) for sid in "ab"}
    ends = {"a": 10, "b": 12}
    for number, top_k in enumerate((5, 5, 3, 3)):  # two passes of the shape that fails, two of another
        steps = []
        for i, sid in enumerate("ab"):
            first = 0 if number == 0 else ends[sid]
            ends[sid] += 0 if number == 0 else 1 + i
            steps.append(ProposeStep(sid, 5 + number + i, ends[sid], features[sid][first : ends[sid]], top_k))
        for step, result in zip(steps, engine.propose_batch(steps)):
            assert isinstance(result, Proposal) and result.pass_sequences == 2, result
            assert_same(result, propose_alone(alone, step), torch.float64)
    assert graphs.uncaptured == {(2, 96, (5,), True)}
    assert "failed; passes of that shape run eagerly (1 shapes so far)" in caplog.text
    assert stub.calls == 2  # the failed shape once, the other shape once (replayed after)
