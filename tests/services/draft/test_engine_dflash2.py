"""The draft engine serving a DFlash2 draft: incremental proposals (its sliding window crossed)
against the equations written out in tests/models/test_dflash2.py, and batched steps equal to
steps alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from services.draft.engine import DraftEngine, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models.loader import load_dflash_draft, load_target_head
from tests.models.test_dflash2 import reference_block, reference_pair_scores


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    target, path = make_tiny(tmp_path_factory.mktemp("tiny-dflash2"), TinySpec(seed=3, draft_arch="dflash2"))
    model, cfg = load_dflash_draft(path, dtype=torch.float64)
    embed, head, _ = load_target_head(target, dtype=torch.float64)
    weights = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    return model, cfg, embed, head, weights


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["eager", "fixed-shapes"])
def test_incremental_proposals_match_the_equations(draft, fixed_shapes):
    """The eager pass and the graph path's fixed shapes (its per-row window masks, appends inside the pass)."""
    model, cfg, embed, head, w = draft
    assert cfg.sliding_window == 32 and cfg.selector_top_k == 8
    graphs = BlockGraphs(model, embed, head, context=96, sequences=1, capture=False) if fixed_shapes else None
    engine = DraftEngine(model, embed, head, graphs=graphs)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(80, cfg.num_taps * cfg.hidden_size, generator=g, dtype=torch.float64)
    # A prompt of 9, then steps: the context passes the window (31 rows for the anchor's row) at 32.
    for end, anchor in [(9, 17), (14, 200), (30, 64), (47, 5), (49, 9)]:
        prev = max((s.ctx_end for s in engine.sequences.values()), default=0)
        proposal = engine.propose("s", anchor, end, features[prev:end], top_k=6)
        first = max(0, end - (cfg.sliding_window - 1))  # older rows are out of every row's window
        hidden = torch.stack(reference_block(w, cfg, list(features[first:end]), embed[anchor], embed[cfg.mask_token_id], end))
        logprobs = torch.log_softmax(hidden[1:] @ head.T, -1)
        top = torch.topk(logprobs, 6, dim=-1)
        assert torch.equal(proposal.top_ids.long(), top.indices)
        assert torch.allclose(proposal.top_logprobs.double(), top.values, atol=1e-5)
        pairs = reference_pair_scores(w, hidden[1:], top.values, top.indices, anchor)
        assert torch.allclose(proposal.pair_scores.double(), pairs, atol=1e-4)
    if fixed_shapes:  # the preallocated context never grew: the fixed-shape pass served every step
        assert engine.sequences.get("s").cache.k[0].shape[1] == 96


def batched_and_alone(draft, fixed_shapes: bool, steps: list[tuple[str, int, int, int, int]]):
    """Steps ``(name, anchor, rows, top_k, depths)`` of fresh contexts proposed in one batch, each
    with what an engine of its own gives it asking for every depth: ``(step, batched, alone)``."""
    model, cfg, embed, head, _ = draft
    g = torch.Generator().manual_seed(1)
    steps = [ProposeStep(name, anchor, n, torch.randn(n, cfg.num_taps * cfg.hidden_size, generator=g, dtype=torch.float64), k, depths=d)
             for name, anchor, n, k, d in steps]
    graphs = BlockGraphs(model, embed, head, context=96, sequences=4, capture=False) if fixed_shapes else None
    together = DraftEngine(model, embed, head, graphs=graphs).propose_batch(steps)
    alone = DraftEngine(model, embed, head)
    for step, got in zip(steps, together):
        yield step, got, alone.propose(step.sequence_id, step.anchor_token, step.anchor_position, step.features, step.top_k)


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["eager", "fixed-shapes"])
def test_batched_steps_equal_steps_alone(draft, fixed_shapes):
    cfg = draft[1]
    for step, got, want in batched_and_alone(draft, fixed_shapes, [("a", 3, 10, 8, 0), ("b", 7, 50, 8, 0), ("c", 11, 33, 5, 0)]):
        assert got.pass_sequences == 3 and torch.equal(got.top_ids, want.top_ids)
        assert torch.allclose(got.pair_scores, want.pair_scores, atol=1e-5) and got.pair_scores.shape == (cfg.block_size - 1, step.top_k, step.top_k)


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["eager", "fixed-shapes"])
def test_fewer_depths_are_the_first_rows(draft, fixed_shapes):
    """Steps asking for depths 1..D (3 and 1 beside one asking for all) get the first D rows of
    the candidates, log-probs and pair scores they get alone asking for every depth."""
    cfg = draft[1]
    for step, got, want in batched_and_alone(draft, fixed_shapes, [("a", 3, 10, 8, 3), ("b", 7, 50, 8, 0), ("c", 11, 33, 8, 1)]):
        d = step.depths or cfg.block_size - 1
        assert got.top_ids.shape == (d, 8) and got.pair_scores.shape == (d, 8, 8)
        assert torch.equal(got.top_ids, want.top_ids[:d]) and torch.allclose(got.top_logprobs, want.top_logprobs[:d], atol=1e-9)
        assert torch.allclose(got.pair_scores, want.pair_scores[:d], atol=1e-5)


def test_native_kernels_match_the_reference_path(tmp_path, monkeypatch):
    """float32 proposals with the native kernels (Triton's interpreter: the convolutions, their
    fused add and norm) equal the plain-torch path's, through the fixed-shape pass."""
    target, path = make_tiny(tmp_path, TinySpec(seed=3, draft_arch="dflash2"))
    model, cfg = load_dflash_draft(path)
    embed, head, _ = load_target_head(target)
    features = torch.randn(40, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    runs = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        engine = DraftEngine(model, embed, head, graphs=BlockGraphs(model, embed, head, context=64, sequences=1, capture=False))
        runs.append([engine.propose("s", anchor, end, features[start:end], top_k=8)
                     for start, end, anchor in [(0, 9, 17), (9, 14, 200), (14, 40, 64)]])
    for got, want in zip(*runs):
        assert torch.equal(got.top_ids, want.top_ids)
        assert torch.allclose(got.top_logprobs, want.top_logprobs, atol=1e-4)
        assert torch.allclose(got.pair_scores, want.pair_scores, atol=1e-3)
