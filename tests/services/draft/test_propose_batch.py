"""Batched Propose: several sequences' steps in one block pass give, per sequence, what ``propose``
gives that sequence alone, and a bad step fails alone."""

from __future__ import annotations

import pytest
import torch

from services.draft.engine import DraftEngine, Proposal, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from splitspec.models.loader import load_dflash_draft, load_target_head

# Per sequence: prompt length, window, top_k, then the new rows of each later step. The contexts
# differ in length; "b" and "d" attend to windows (and compact their caches); "a" and "c" share a
# top_k, so one top-K call serves both while "b" and "d" get their own.
SEQUENCES = {
    "a": (5, 0, 5, [1, 4, 2]),
    "b": (23, 8, 3, [2, 20, 1]),  # 20 new rows: more than a block (16)
    "c": (40, 0, 5, [7, 1, 5]),
    "d": (12, 16, 8, [3, 9, 20]),
}
# Who steps in each round: everyone, then three of them, then one (the single-sequence pass) and all
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
    (which, with fixed shapes, runs the single-sequence graph path)."""
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
        for step, result in zip(steps, results):
            assert_same(result, propose_alone(alone_engine, step), dtype)
            assert result.top_ids.shape == (cfg.block_size - 1, step.top_k)
            assert result.pass_sequences == len(steps)
        assert len({r.forward_ns for r in results}) == 1 and results[0].forward_ns > 0  # one pass, timed once
        # The sequences' proposals differ: a pass that mixed up their contexts could not match.
        best = [r.top_logprobs[:, 0] for r in results]  # [B-1] each
        assert all((x - y).abs().max() > 1e-3 for i, x in enumerate(best) for y in best[:i])
    for sid, (prompt, window, _, rows) in SEQUENCES.items():
        seq = batch_engine.sequences.get(sid)
        assert seq.ctx_end == prompt + sum(rows[: sum(sid in members for members in rounds) - 1])
        if window:  # compacted to the window once past twice it
            assert seq.cache.size <= 2 * window


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
