"""The benchmark-only OracleDrafter: its proposals follow the recorded continuation, corrupted as
the module docstring defines, exactly as the per-depth form below (how it was first written)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitspec.bench.oracle_drafter import OracleDrafter, OracleTable


def per_depth_ids(truth: list[int], anchor_position: int, anchor_token: int, vocab: int, corruption: float, top_k: int, depth: int):
    rng = np.random.default_rng([anchor_position, len(truth), anchor_token])
    ids = np.empty((depth, top_k), dtype=np.int32)
    for d in range(depth):
        true = truth[d] if d < len(truth) else int(rng.integers(vocab))
        ranked = [true]
        if rng.random() < corruption:
            wrong = (true + 1 + int(rng.integers(vocab - 1))) % vocab
            ranked = [wrong, true] if rng.random() < 0.5 else [wrong]
        others = (true + 1 + np.arange(top_k + 2)) % vocab
        ranked += [int(t) for t in others if t not in ranked][: top_k - len(ranked)]
        ids[d] = ranked[:top_k]
    return ids


@pytest.mark.parametrize("corruption", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize(("vocab", "top_k"), [(260, 8), (40, 39)])  # 39: every other token ranked, ranks wrap the vocabulary
def test_proposals_match_the_per_depth_definition(tmp_path, corruption, vocab, top_k):
    rng = np.random.default_rng(1)
    recorded = rng.integers(0, vocab, 60).tolist()
    path = tmp_path / "table.jsonl"
    path.write_text(json.dumps({"tokens": recorded}) + "\n")
    drafter = OracleDrafter(OracleTable(path), vocab, corruption=corruption)
    history: list[int] = []
    for position in (10, 11, 30, 52):  # the last runs past the recording: random fill rows
        new, history = recorded[len(history) : position], recorded[:position]
        proposal = drafter.propose("s", recorded[position], position, None, top_k, tokens=new)
        truth = recorded[position + 1 : position + 16]
        expected = per_depth_ids(truth, position, recorded[position], vocab, corruption, top_k, 15)
        assert np.array_equal(proposal.top_ids.numpy(), expected)
        assert all(len(set(row)) == top_k for row in proposal.top_ids.tolist())
