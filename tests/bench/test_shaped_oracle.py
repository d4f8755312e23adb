"""The benchmark-only ShapedOracleDrafter: the random DFlash draft's pass runs for every step (its
contexts grow as a real draft's do), the answers are the OracleDrafter's, timed as the draft's
pass; a step the draft refuses gets the draft's error; and a sequence the draft no longer holds
leaves no oracle history behind."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from services.draft.engine import DraftEngine, Proposal, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.bench.oracle_drafter import OracleDrafter, OracleTable
from splitspec.bench.random_weights import random_draft, random_target_config, random_target_head
from splitspec.bench.shaped_oracle import ShapedOracleDrafter
from splitspec.errors import InvalidArgument


@pytest.fixture(params=[False, True], ids=["eager", "slots"])
def pair(tmp_path, request):
    """A ShapedOracleDrafter over the tiny random draft (its passes eager, or in the fixed-shape
    slots a GPU captures as graphs: the oracle then answers on its helper thread), a plain
    OracleDrafter of the same table, the recorded sequence and the features' width."""
    config = random_target_config("random:tiny")
    recorded = np.random.default_rng(3).integers(0, config.vocab_size, 80).tolist()
    path = tmp_path / "table.jsonl"
    path.write_text(json.dumps({"tokens": recorded}) + "\n")
    model, draft_config = random_draft("random:tiny-dflash")
    embed, head, _ = random_target_head("random:tiny")
    graphs = BlockGraphs(model, embed, head, 128, 4, capture=False) if request.param else None
    engine = DraftEngine(model, embed, head, max_sequences=4, graphs=graphs)
    oracle = lambda: OracleDrafter(OracleTable(path), config.vocab_size, block_size=engine.block_size, corruption=0.3)  # noqa: E731
    return ShapedOracleDrafter(engine, oracle()), oracle(), recorded, draft_config.num_taps * draft_config.hidden_size


def steps_at(recorded: list[int], position: int, synced: int, width: int, sequence_id: str = "s", context: int = 1) -> ProposeStep:
    """A step whose anchor is ``recorded[position]``, sending the tokens and (random) features of the
    positions since ``synced``."""
    features = torch.randn(position - synced, width, generator=torch.Generator().manual_seed(position))
    return ProposeStep(sequence_id, recorded[position], position, features, 4, 0, recorded[synced:position], context, 0)


def test_answers_are_the_oracles_timed_as_the_drafts_pass(pair):
    shaped, oracle, recorded, width = pair
    threads = []
    answer = shaped.oracle.propose_batch
    shaped.oracle.propose_batch = lambda steps: threads.append(threading.current_thread().name) or answer(steps)
    synced = 0
    for position in (12, 17, 25):
        [got] = shaped.propose_batch([steps_at(recorded, position, synced, width)])
        [want] = oracle.propose_batch([steps_at(recorded, position, synced, width)])
        assert isinstance(got, Proposal) and torch.equal(got.top_ids, want.top_ids)
        assert torch.equal(got.top_logprobs, want.top_logprobs)
        assert got.forward_ns > 0 and got.pass_sequences == 1
        synced = position
    # The draft ran every pass: its context holds every position sent.
    assert shaped.engine.sequences.get("s").ctx_end == 25 and shaped.target_layer_ids == shaped.engine.target_layer_ids
    # In slots the oracle answered on its helper thread, once the pass was launched; eager, after it.
    slots = shaped.engine.graphs is not None
    assert all(name.startswith("oracle") == slots for name in threads) and len(threads) == 3


def test_a_step_the_draft_refuses_gets_the_drafts_error_and_the_others_go_on(pair):
    shaped, _, recorded, width = pair
    bad = steps_at(recorded, 10, 0, width, "bad")
    bad.top_k = 0  # the draft refuses it (InvalidArgument) before the oracle would
    good = steps_at(recorded, 10, 0, width, "good")
    refused, answered = shaped.propose_batch([bad, good])
    assert isinstance(refused, InvalidArgument) and "top_k" in str(refused)
    assert isinstance(answered, Proposal) and answered.pass_sequences == 1


def test_a_sequence_the_draft_released_leaves_no_oracle_history(pair):
    shaped, _, recorded, width = pair
    shaped.propose_batch([steps_at(recorded, 10, 0, width, "a"), steps_at(recorded, 12, 0, width, "b")])
    assert {k for k, _ in shaped.oracle.sequences.items()} == {"a", "b"}
    assert shaped.engine.sequences.pop("a", 1)  # as the worker's Release does: the engine's table
    shaped.propose_batch([steps_at(recorded, 15, 12, width, "b")])
    assert {k for k, _ in shaped.oracle.sequences.items()} == {"b"}
    # The draft takes the features of positions 15..19, the oracle refuses the tokens (one short):
    # its error is the step's.
    with pytest.raises(InvalidArgument, match="history has 19 positions"):
        shaped.propose("b", recorded[20], 20, torch.randn(5, width), 4, tokens=recorded[16:20], context=1)
