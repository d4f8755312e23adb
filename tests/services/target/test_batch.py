"""Verify of many sequences in one pass (continuous batching) and the paged KV cache's policy.

Each sequence's output in a batch must equal its output alone, for the dense and the hybrid
target, greedy and seeded sampling; a bad step fails alone; when blocks run out the newest sequence
is preempted (NOT_FOUND, so the gateway prefills it again) and a prefill waits (KVBlocksBusy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.target.engine import KVBlocksBusy, TargetEngine, TargetLimits, VerifyStep
from splitspec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from splitspec.models.paged import KVBlockPool, PassInputs, _tree_layout, pass_layout
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def random_tree(rng, vocab: int, budget: int):
    ids = np.stack([rng.choice(vocab, 3, replace=False) for _ in range(6)])
    return build_ddtree(ids, -np.sort(rng.random((6, 3)) * 3, axis=1), budget)


def test_pass_layout_places_rows_of_each_sequence():
    pool = KVBlockPool(1, 1, 2, num_blocks=6, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    # Sequence 0: 5 committed positions, a tree root -> {1, 2}, 2 -> 3; sequence 1: 2 positions, one decode row.
    layout = pass_layout(
        pool, [[10, 11, 12, 13], [20]], [np.array([-1, 0, 0, 2]), np.array([-1])], [5, 2], [[3, 1, 2], [4]],
        [np.ones((4, 4), dtype=bool), np.ones((1, 1), dtype=bool)], [7, 9],
    )
    assert layout.positions.tolist() == [5, 6, 6, 7, 2]  # start + depth: siblings share a position
    assert layout.write_slots.tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]  # positions 5..8, 2
    assert layout.parents.tolist() == [-1, 0, 0, 2, -2]
    assert layout.offsets.tolist() == [0, 4, 5] and layout.max_rows == 4 and layout.max_keys == 9
    assert layout.state_slots.tolist() == [7, 9]


def test_a_batch_of_decode_steps_has_the_layout_of_the_general_path():
    """Blocks of one row each (many AR users) take a vectorised path; it must lay them out exactly
    as the general one does."""
    pool = KVBlockPool(1, 1, 2, num_blocks=64, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    rng = np.random.default_rng(3)
    starts = rng.integers(0, 20, 9).tolist()
    tables = [rng.permutation(np.arange(1, 64))[:6].tolist() for _ in starts]
    tokens = [[int(t)] for t in rng.integers(0, 100, 9)]
    args = (tokens, [np.array([-1])] * 9, starts, tables, [np.ones((1, 1), dtype=bool)] * 9, [None, 3, *range(5, 12)])
    fast, general = pass_layout(pool, *args), _tree_layout(pool, *args)
    for field in ("tokens", "positions", "write_slots", "parents", "offsets", "starts", "state_slots"):
        a, b = getattr(fast, field), getattr(general, field)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    assert [t.tolist() for t in fast.tables] == [t.tolist() for t in general.tables]
    assert [t.tolist() for t in fast.trees] == [t.tolist() for t in general.trees]


def test_compaction_of_a_pass_moves_each_sequences_accepted_rows_in_its_own_blocks():
    """One compaction for every sequence of a pass: row ``start + d`` of each gets its old row
    ``start + accepted[d]``, other slots (other sequences' rows, the pad block) keep their values."""
    pool = KVBlockPool(2, 1, 3, num_blocks=12, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape))
    before_k, before_v = pool.k.clone(), pool.v.clone()
    # (blocks, start, accepted): a tree's path, a decode step (in place), a path across a block edge.
    moves = [([3, 7, 1], 2, [0, 2, 5, 6]), ([5, 2], 6, [0]), ([9, 4, 10], 3, [0, 1, 4, 7])]
    pool.compact(moves)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for blocks, start, accepted in moves:
        src = pool.slots(blocks, start + np.asarray(accepted))
        dst = pool.slots(blocks, start + np.arange(len(accepted)))
        expect_k[:, :, dst], expect_v[:, :, dst] = before_k[:, :, src], before_v[:, :, src]
    assert torch.equal(pool.k, expect_k) and torch.equal(pool.v, expect_v)
    assert not torch.equal(pool.k, before_k)  # rows did move
    pool.compact([([5, 2], 6, [0, 1])])  # nothing moved: nothing written
    assert torch.equal(pool.k, expect_k)


def test_fill_pads_rows_tables_and_trees():
    pool = KVBlockPool(1, 1, 2, num_blocks=6, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    layout = pass_layout(
        pool, [[10, 11, 12, 13], [20], [30]], [np.array([-1, 0, 0, 2]), np.array([-1]), np.array([-1])], [5, 2, 3],
        [[3, 1, 2], [4], [5]], [tree, np.ones((1, 1), dtype=bool), np.ones((1, 1), dtype=bool)], [7, 9, 0],
    )
    shape = (8, 4, 5, 16, 4)  # rows, sequences, block rows, keys, block size: padded past the layout's
    host = np.zeros(PassInputs.nbytes(*shape), dtype=np.uint8)
    inputs = PassInputs.on(torch.from_numpy(host), *shape)
    inputs.fill(layout, host)
    assert inputs.row_index.tolist() == [[0, 1, 2, 3, 8], [4, 8, 8, 8, 8], [5, 8, 8, 8, 8], [8] * 5]
    assert inputs.out_index.tolist() == [0, 1, 2, 3, 5, 10, 0, 0]
    assert inputs.starts.tolist() == [5, 2, 3, 1] and inputs.offsets.tolist() == [0, 4, 5, 6, 6]
    assert inputs.tables.tolist() == [[3, 1, 2, 0], [4, 0, 0, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    trees = inputs.trees.numpy()
    assert (trees[0, :4, :4] == tree).all() and (trees[0, 4] == np.eye(5, dtype=bool)[4]).all()
    assert all((trees[s] == np.eye(5, dtype=bool)).all() for s in (1, 2, 3))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_sequence_of_a_batch_gets_its_single_stream_output(model, sampling):
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    prompts = {f"s{i}": rng.integers(0, vocab, n).tolist() for i, n in enumerate((4, 11, 29, 6, 17))}
    trees = {sid: [random_tree(rng, vocab, int(rng.choice([0, 3, 12]))) for _ in range(5)] for sid in prompts}
    # Which sequences step together changes from pass to pass.
    schedule = [[sid for sid in prompts if rng.random() < 0.6] or ["s0"] for _ in range(5)]

    def generate(batched: bool) -> dict[str, list]:
        engine = TargetEngine(model)
        out = {sid: [engine.prefill(sid, p, sampling, taps=(0, 2), reserve_tokens=120).next_token] for sid, p in prompts.items()}
        done = {sid: 0 for sid in prompts}
        for members in schedule:
            steps = []
            for sid in members:
                tree = trees[sid][done[sid]]
                done[sid] += 1
                steps.append(VerifyStep(sid, tree.tokens.tolist(), tree.parents.tolist(), return_features=True))
            results = engine.verify_batch(steps) if batched else [engine.verify_batch([s])[0] for s in steps]
            for step, r in zip(steps, results, strict=True):
                out[step.sequence_id].append((r.committed_tokens, r.next_token, r.committed_length, r.features))
        return out

    alone, together = generate(False), generate(True)
    for sid in prompts:
        assert alone[sid][0] == together[sid][0]
        for a, b in zip(alone[sid][1:], together[sid][1:], strict=True):
            assert a[:3] == b[:3], sid
            assert torch.allclose(a[3], b[3], atol=1e-10)


def test_a_bad_step_fails_alone(model):
    engine = TargetEngine(model, TargetLimits(max_tree_nodes=4))
    engine.prefill("a", [1, 2, 3], GREEDY, reserve_tokens=32)
    engine.prefill("b", [4, 5], GREEDY, reserve_tokens=32)
    engine.prefill("short", [6], GREEDY, reserve_tokens=3)
    results = engine.verify_batch([
        VerifyStep("a", [7], [0]),
        VerifyStep("nope", [], []),
        VerifyStep("b", [1, 2], [0, 2]),  # a parent after its node
        VerifyStep("a", [], []),  # a second step of "a" in the pass
        VerifyStep("short", [1, 2, 3], [0, 1, 2]),  # more positions than it reserved
        VerifyStep("b", [1, 2, 3, 4, 5], [0, 1, 2, 3, 4]),  # more nodes than max_tree_nodes
    ])
    assert results[0].committed_length >= 4 and results[0].pass_sequences == 1
    assert isinstance(results[1], NotFound)
    assert isinstance(results[2], InvalidArgument) and "parents" in str(results[2])
    assert isinstance(results[3], FailedPrecondition) and "two steps" in str(results[3])
    assert isinstance(results[4], FailedPrecondition) and "reserved 3" in str(results[4])
    assert isinstance(results[5], InvalidArgument)
    assert engine.sequences.get("b").length == 2  # its failed steps changed nothing


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_prefills_wait(model):
    engine = TargetEngine(model, TargetLimits(max_kv_tokens=6 * 8, block_size=8))  # 6 blocks of 8
    engine.prefill("old", list(range(1, 15)), GREEDY, reserve_tokens=40)  # 15 positions: 2 blocks
    engine.prefill("mid", list(range(1, 15)), GREEDY, reserve_tokens=40)  # 2 blocks
    engine.prefill("new", list(range(1, 7)), GREEDY, reserve_tokens=40)  # 1 block
    with pytest.raises(KVBlocksBusy):  # 2 blocks needed, 1 free: the prefill waits (the server retries)
        engine.prefill("late", list(range(1, 15)), GREEDY, reserve_tokens=40)
    assert "late" not in engine.sequences
    with pytest.raises(ResourceExhausted, match="whole cache holds"):  # could never fit: refused
        engine.prefill("huge", [1, 2], GREEDY, reserve_tokens=49)
    # "old" grows by a 7-node chain (15 + 8 positions: a third block); the one free block goes, then
    # "mid" needs one too: "new", admitted last, gives way.
    results = engine.verify_batch([VerifyStep("old", list(range(3, 10)), list(range(7))), VerifyStep("mid", list(range(3, 10)), list(range(7)))])
    assert not any(isinstance(r, Exception) for r in results)
    assert "new" not in engine.sequences
    with pytest.raises(NotFound, match="not live"):
        engine.verify("new", [], [])
    # Both grow again: "mid" is now the newest and gives way to "old" in the same pass.
    results = engine.verify_batch([VerifyStep("old", list(range(3, 12)), list(range(9))), VerifyStep("mid", list(range(3, 12)), list(range(9)))])
    assert not isinstance(results[0], Exception)
    assert isinstance(results[1], NotFound) and "preempted" in str(results[1])
    assert list(engine.sequences.items())[0][0] == "old" and len(engine.sequences) == 1
    engine.sequences.pop("old")
    assert engine.kv.free_blocks == engine.kv.usable_blocks  # every block came back
