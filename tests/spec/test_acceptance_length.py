"""Tests for splitspec.spec.acceptance_length: the one definition of acceptance length (AL), and
the gateway's usage and metrics following it on a scripted sequence (fake workers, no processes)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.gateway.speculation import DraftShape, Mode, SpeculationOptions, SpeculativeSequence
from services.gateway.workers import Prefilled, Proposed, Verified
from services.metrics import GatewayMetrics
from splitspec.spec.acceptance import accept_path
from splitspec.spec.acceptance_length import acceptance_length, committed_tokens, pooled_acceptance_length
from splitspec.v1 import common_pb2, gateway_pb2


def test_the_definition():
    assert acceptance_length(40, 40) == 1.0  # target-only: every step commits one token
    assert acceptance_length(11, 4) == 2.75
    assert acceptance_length(0, 0) == 0.0  # no verify step (max_tokens 1): no AL, reported as 0
    with pytest.raises(ValueError):
        acceptance_length(-1, 2)


def test_usage_round_trips_and_requests_pool_by_steps_not_by_mean():
    # mean_acceptance_length travels as a float32: committed tokens still come back exact.
    sent = [(2917, 1000), (127, 127), (10, 3)]
    usages = [gateway_pb2.Usage.FromString(gateway_pb2.Usage(steps=s, mean_acceptance_length=c / s).SerializeToString()) for c, s in sent]
    assert [committed_tokens(u) for u in usages] == [c for c, _ in sent]
    assert pooled_acceptance_length(usages) == (2917 + 127 + 10) / (1000 + 127 + 3)
    assert pooled_acceptance_length(usages[1:]) != (1.0 + 10 / 3) / 2


PROMPT = [1, 2, 3]
TRUTH = list(range(100, 160))  # the target's (greedy) continuation of PROMPT
WRONG = (7, 8)  # tokens the target never produces


class ScriptedTarget:
    """Prefill and verify as a greedy target whose continuation of PROMPT is TRUTH: each row's
    token is the next true token if the path to the row matches TRUTH, else a wrong one."""

    def __init__(self) -> None:
        self.generated = 0  # tokens produced so far; the pending root is TRUTH[generated - 1]

    async def prefill(self, request, timeout=None) -> Prefilled:
        assert list(request.tokens) == PROMPT
        self.generated = 1
        return Prefilled(next_token=TRUTH[0], features=None)

    async def verify(self, sequence_id, tokens, parents, return_features, timeout=None, vote=None) -> Verified:
        tokens, parents = np.asarray(tokens).tolist(), np.asarray(parents).tolist()
        n = self.generated
        paths = [[]]  # node tokens from the root to each row
        for token, parent in zip(tokens, parents):
            paths.append(paths[parent] + [token])
        target = [TRUTH[n + len(p)] if p == TRUTH[n : n + len(p)] else 0 for p in paths]
        rows, bonus = accept_path(tokens, parents, target)
        self.generated += len(rows)
        return Verified([TRUTH[n - 1]] + [tokens[r - 1] for r in rows[1:]], bonus, 0, None, 0)

    async def decode(self, sequence_id, steps, timeout, return_features=False, late_last=False, vote=None):
        """Target-only steps, as ``TargetClient.decode`` answers them."""
        for _ in range(steps):
            yield await self.verify(sequence_id, np.zeros(0, np.int64), np.zeros(0, np.int64), return_features)

    async def release(self, sequence_id) -> None:
        pass


class ScriptedDraft:
    """Per step, per depth: the rank of the true token in the proposal, or None when it is missing."""

    def __init__(self, script: list[list[int | None]]) -> None:
        self.script = script
        self.calls = 0

    async def propose(self, sequence_id, anchor, start, history, features, top_k, window, timeout=None, context=0, depths=0):
        ranks = self.script[self.calls]
        self.calls += 1
        generated = start - len(PROMPT) + 1
        assert anchor == TRUTH[generated - 1]
        rows = []
        for depth, rank in enumerate(ranks, start=1):
            row = list(WRONG)
            if rank is not None:
                row.insert(rank, TRUTH[generated - 1 + depth])
            rows.append(row[:2])
        return Proposed(np.array(rows, dtype=np.int64), np.log(np.array([[0.6, 0.4]] * len(rows))))

    async def release(self, sequence_id, context=0) -> None:
        pass


def _run(mode: Mode, script: list[list[int | None]], max_new_tokens: int, budget: int):
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.model = "m"
    seq = SpeculativeSequence(
        "s", ScriptedTarget(), ScriptedDraft(script), DraftShape(block_size=5, taps=()),
        SpeculationOptions(mode=mode, budget=budget, top_k=2), PROMPT, common_pb2.Sampling(),
        max_new_tokens=max_new_tokens, max_context=256, on_step=metrics.step_observer(mode.value),
    )

    async def collect() -> list[int]:
        out = []
        async for new in seq.run():
            out += new
        return out

    tokens = asyncio.run(collect())
    assert tokens == TRUTH[:max_new_tokens]  # lossless, whatever the drafts
    histogram = {
        s: metrics.registry.get_sample_value(f"splitspec_spec_decode_acceptance_length_tokens_{s}", {"model": "m", "mode": mode.value})
        for s in ("sum", "count")
    }
    return seq.stats, tokens, histogram


def test_target_only_is_exactly_one():
    stats, tokens, histogram = _run(Mode.OFF, [], max_new_tokens=12, budget=4)
    # 12 tokens: the first from the prefill, 11 from 11 verify steps of one token each.
    assert (stats.steps, stats.committed) == (11, 11)
    assert stats.mean_acceptance_length == 1.0  # completion_tokens / steps would say 12 / 11 = 1.09
    assert histogram == {"sum": 11, "count": 11}


def test_a_known_tree_case():
    """DDTree (budget 22, top-2 over 4 depths) with the true token at scripted ranks:

    - step 1: true at rank 0 at every depth: 4 accepted, commits 5 (generated 1 -> 6);
    - step 2: true at rank 1, then rank 0, then missing: the tree's rank-1 branch accepts 2, commits 3 (-> 9);
    - step 3: missing at depth 1: commits the bonus only (-> 10);
    - step 4: 2 tokens still wanted, so the tree is cut to depth 1: accepts 1, commits 2 (-> 12).

    AL = (5 + 3 + 1 + 2) / 4 = 2.75 (generated tokens / steps would say 3.0).
    """
    script = [[0, 0, 0, 0], [1, 0, None, None], [None, 0, 0, 0], [0, 0, 0, 0]]
    stats, tokens, histogram = _run(Mode.DDTREE, script, max_new_tokens=12, budget=22)
    assert (stats.steps, stats.committed, stats.fallbacks) == (4, 11, 0)
    assert stats.mean_acceptance_length == 2.75 == acceptance_length(len(tokens) - 1, stats.steps)
    assert histogram["sum"] / histogram["count"] == stats.mean_acceptance_length
    assert not math.isclose(len(tokens) / stats.steps, stats.mean_acceptance_length)


def test_the_model_card_states_the_definition_and_refuses_figures_measured_otherwise():
    from splitspec.train.card import AL_DEFINITION, _measurements_section

    row = {"prompt_set": "HumanEval", "budget": 0, "tokens_per_s": 90.0, "device": "cpu"}
    section = "\n".join(_measurements_section([{**row, "mode": "off", "acceptance_length": 1.0}]))
    assert "| HumanEval | off | 0 | none | 1.00 | 90.0 | cpu |" in section and AL_DEFINITION in section
    with pytest.raises(ValueError, match="generated tokens / steps"):
        _measurements_section([{**row, "mode": "off", "acceptance_length": 1.008}])  # 128 tokens / 127 steps
