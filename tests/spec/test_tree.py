"""Tests for splitspec.spec.tree: DDTree construction against brute force, masks, validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.spec.tree import (
    DraftTree,
    build_chain,
    build_ddtree,
    node_depths,
    tree_attention_mask,
    validate_tree,
)

# A hand-made tree: node 1 and 2 under the root, 3 and 4 under node 1, 5 under node 3.
HAND_PARENTS = np.array([0, 0, 1, 1, 3], dtype=np.int32)


def make_draft(rng: np.random.Generator, num_depths: int, k: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """Random ``[L, K]`` top ids (distinct per row) and descending log-probs.

    With ``ties`` the log-probs are multiples of 0.25, so equal path scores are exact ties.
    """
    top_ids = np.stack([rng.choice(1000, size=k, replace=False) for _ in range(num_depths)])
    if ties:
        lps = -0.25 * rng.integers(0, 8, size=(num_depths, k))
    else:
        lps = np.log(rng.dirichlet(np.ones(k + 2), size=num_depths))[:, :k]
    return top_ids.astype(np.int64), -np.sort(-lps, axis=1)


def all_paths(num_depths: int, k: int) -> list[tuple[int, ...]]:
    """Every rank tuple of length 1..num_depths."""
    return [p for d in range(1, num_depths + 1) for p in itertools.product(range(k), repeat=d)]


def path_score(lps: list[list[float]], path: tuple[int, ...]) -> float:
    score = 0.0
    for d, r in enumerate(path):
        score += lps[d][r]
    return score


def rank_paths(tree: DraftTree, top_ids: np.ndarray) -> list[tuple[int, ...]]:
    """The rank tuple of every node, in node order."""
    ids = top_ids.tolist()
    paths: list[tuple[int, ...]] = [()]  # row 0 = root
    for tok, parent, depth in zip(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()):
        paths.append(paths[parent] + (ids[depth - 1].index(tok),))
    return paths[1:]


def check_structure(tree: DraftTree, budget: int, max_depth: int) -> None:
    n = tree.num_nodes
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (n,)
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == np.int32
    assert n <= budget
    assert np.all(tree.parents <= np.arange(n))
    assert np.all(tree.parents >= 0)
    parent_depths = np.concatenate([[0], tree.depths])[tree.parents]
    assert np.array_equal(tree.depths, parent_depths + 1)
    assert np.all(tree.depths <= max_depth)
    siblings = set(zip(tree.parents.tolist(), tree.tokens.tolist()))
    assert len(siblings) == n, "two siblings share a token"


def check_top_set(chosen: list[tuple[int, ...]], candidates: list[tuple[int, ...]], lps, size: int) -> None:
    """``chosen`` is a top-``size`` subset of ``candidates`` by score (ties allowed at the boundary)."""
    assert len(chosen) == len(set(chosen)) == size
    rest = set(candidates) - set(chosen)
    assert set(chosen) <= set(candidates)
    if chosen and rest:
        assert min(path_score(lps, p) for p in chosen) >= max(path_score(lps, p) for p in rest)
    ordered = sorted(candidates, key=lambda p: -path_score(lps, p))
    if 0 < size < len(ordered) and path_score(lps, ordered[size - 1]) > path_score(lps, ordered[size]):
        assert set(chosen) == set(ordered[:size]), "no tie at the boundary: the top set is unique"


def check_against_brute_force(top_ids, top_lps, budget, max_depth, chain_seed) -> None:
    num_depths, k = top_ids.shape
    tree = build_ddtree(top_ids, top_lps, budget, chain_seed=chain_seed, max_depth=max_depth)
    depth_cap = num_depths if max_depth is None else min(max_depth, num_depths)
    check_structure(tree, budget, depth_cap)
    paths = rank_paths(tree, top_ids)
    chosen = set(paths)
    assert all(len(p) == 1 or p[:-1] in chosen for p in paths), "not prefix-closed"
    lps = top_lps.tolist()
    candidates = all_paths(depth_cap, k)
    size = min(budget, len(candidates))
    assert tree.num_nodes == size
    if chain_seed:
        spine_len = min(budget, depth_cap)
        spine = [(0,) * d for d in range(1, spine_len + 1)]
        assert paths[:spine_len] == spine
        rest = [p for p in candidates if p not in set(spine)]
        check_top_set(paths[spine_len:], rest, lps, size - spine_len)
    else:
        check_top_set(paths, candidates, lps, size)
        scores = [path_score(lps, p) for p in paths]
        assert all(a >= b for a, b in zip(scores, scores[1:])), "pop order is not best-first"


@settings(max_examples=400, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_depths=st.integers(1, 4),
    k=st.integers(1, 4),
    ties=st.booleans(),
    chain_seed=st.booleans(),
    budget_frac=st.floats(0.0, 1.1),
    max_depth=st.one_of(st.none(), st.integers(0, 5)),
)
def test_build_ddtree_matches_brute_force(seed, num_depths, k, ties, chain_seed, budget_frac, max_depth):
    top_ids, top_lps = make_draft(np.random.default_rng(seed), num_depths, k, ties)
    budget = int(round(budget_frac * len(all_paths(num_depths, k))))
    check_against_brute_force(top_ids, top_lps, budget, max_depth, chain_seed)


@pytest.mark.parametrize("chain_seed", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_build_ddtree_every_budget(chain_seed, ties):
    rng = np.random.default_rng(1234 + ties)
    for num_depths, k in [(1, 1), (1, 4), (3, 1), (2, 3), (3, 3), (4, 2)]:
        top_ids, top_lps = make_draft(rng, num_depths, k, ties)
        for budget in range(len(all_paths(num_depths, k)) + 2):
            check_against_brute_force(top_ids, top_lps, budget, None, chain_seed)


def test_build_ddtree_reference_order():
    # Depth 1: a (-0.1), b (-0.5); depth 2: c (-0.2), d (-1.0).
    top_ids = np.array([[1, 2], [3, 4]])
    top_lps = np.array([[-0.1, -0.5], [-0.2, -1.0]])
    tree = build_ddtree(top_ids, top_lps, budget=6)
    # Pops: a(-0.1), a.c(-0.3), b(-0.5), b.c(-0.7), a.d(-1.1), b.d(-1.5).
    assert tree.tokens.tolist() == [1, 3, 2, 3, 4, 4]
    assert tree.parents.tolist() == [0, 1, 0, 3, 1, 3]
    assert tree.depths.tolist() == [1, 2, 1, 2, 2, 2]


def test_build_ddtree_ties_are_deterministic():
    top_ids = np.array([[5, 6, 7], [8, 9, 10]])
    top_lps = np.full((2, 3), -1.0)
    first = build_ddtree(top_ids, top_lps, budget=7)
    for _ in range(3):
        again = build_ddtree(top_ids, top_lps, budget=7)
        assert np.array_equal(first.tokens, again.tokens)
        assert np.array_equal(first.parents, again.parents)


def test_chain_seed_forces_spine_that_best_first_drops():
    # Flat depth 1 (8 near-equal candidates), confident-but-low deeper depths: pure best-first
    # spends a small budget on depth-1/2 siblings and never reaches depth 15.
    num_depths, k, budget = 15, 8, 24
    top_ids = np.arange(num_depths * k).reshape(num_depths, k)
    top_lps = np.full((num_depths, k), -8.0)
    top_lps[0] = np.log(1 / 8) - 0.001 * np.arange(k)
    top_lps[1:, 0] = -1.5
    pure = build_ddtree(top_ids, top_lps, budget)
    assert pure.num_nodes == budget
    assert pure.depths.max() < num_depths

    seeded = build_ddtree(top_ids, top_lps, budget, chain_seed=True)
    assert seeded.num_nodes == budget
    assert seeded.tokens[:num_depths].tolist() == top_ids[:, 0].tolist()
    assert seeded.parents[:num_depths].tolist() == list(range(num_depths))
    assert seeded.depths[:num_depths].tolist() == list(range(1, num_depths + 1))
    # The rest of the budget goes best-first: the depth-1 siblings come next, in rank order.
    assert seeded.tokens[num_depths : num_depths + k - 1].tolist() == top_ids[0, 1:].tolist()
    check_against_brute_force(top_ids[:4], top_lps[:4], 30, None, chain_seed=True)


def test_chain_seed_truncated_by_budget_and_max_depth():
    top_ids, top_lps = make_draft(np.random.default_rng(0), 15, 4, ties=False)
    tree = build_ddtree(top_ids, top_lps, budget=5, chain_seed=True)
    assert tree.tokens.tolist() == top_ids[:5, 0].tolist()
    assert tree.parents.tolist() == [0, 1, 2, 3, 4]
    tree = build_ddtree(top_ids, top_lps, budget=40, chain_seed=True, max_depth=3)
    assert tree.num_nodes == 40
    assert tree.depths.max() == 3
    assert tree.tokens[:3].tolist() == top_ids[:3, 0].tolist()


@pytest.mark.parametrize("chain_seed", [False, True])
def test_max_depth(chain_seed):
    top_ids, top_lps = make_draft(np.random.default_rng(7), 15, 8, ties=False)
    for max_depth in [0, 1, 2, 5, 15, 30]:
        tree = build_ddtree(top_ids, top_lps, 200, chain_seed=chain_seed, max_depth=max_depth)
        check_structure(tree, 200, min(max_depth, 15))
        assert tree.num_nodes == min(200, sum(8**d for d in range(1, min(max_depth, 15) + 1)))


def test_k_one_is_a_chain():
    top_ids = np.array([[4], [5], [6]])
    top_lps = np.array([[-0.1], [-0.2], [-0.3]])
    for chain_seed in [False, True]:
        tree = build_ddtree(top_ids, top_lps, 10, chain_seed=chain_seed)
        assert tree.tokens.tolist() == [4, 5, 6]
        assert tree.parents.tolist() == [0, 1, 2]


def test_budget_zero_and_empty():
    top_ids, top_lps = make_draft(np.random.default_rng(1), 3, 2, ties=False)
    for chain_seed in [False, True]:
        assert build_ddtree(top_ids, top_lps, 0, chain_seed=chain_seed).num_nodes == 0
    empty = DraftTree.empty()
    assert empty.num_nodes == 0
    assert empty.tokens.dtype == np.int32 and empty.parents.shape == empty.depths.shape == (0,)


def test_large_build_is_fast_and_valid():
    top_ids, top_lps = make_draft(np.random.default_rng(2), 15, 64, ties=False)
    for chain_seed in [False, True]:
        tree = build_ddtree(top_ids.astype(np.int32), top_lps.astype(np.float32), 512, chain_seed=chain_seed)
        check_structure(tree, 512, 15)
        assert tree.num_nodes == 512
        validate_tree(tree.tokens, tree.parents, vocab_size=1000, max_nodes=512)


@pytest.mark.parametrize(
    ("top_ids", "top_lps", "budget", "kwargs", "match"),
    [
        (np.zeros(3, dtype=int), np.zeros(3), 4, {}, "top_ids must have shape"),
        (np.zeros((0, 2), dtype=int), np.zeros((0, 2)), 4, {}, "top_ids must have shape"),
        (np.zeros((2, 0), dtype=int), np.zeros((2, 0)), 4, {}, "top_ids must have shape"),
        (np.zeros((2, 2)), np.zeros((2, 2)), 4, {}, "top_ids must be integers"),
        (np.array([[1, 2]]), np.zeros((1, 3)), 4, {}, "top_logprobs shape"),
        (np.array([[1, 2]]), np.array([[-1.0, -0.5]]), 4, {}, "descending"),
        (np.array([[1, 2]]), np.array([[-1.0, np.nan]]), 4, {}, "NaN"),
        (np.array([[1, 1]]), np.array([[-1.0, -2.0]]), 4, {}, "distinct"),
        (np.array([[1, 2]]), np.array([[-1.0, -2.0]]), -1, {}, "budget"),
        (np.array([[1, 2]]), np.array([[-1.0, -2.0]]), 4, {"max_depth": -1}, "max_depth"),
    ],
)
def test_build_ddtree_rejects_bad_input(top_ids, top_lps, budget, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_ddtree(top_ids, top_lps, budget, **kwargs)


def test_build_chain():
    top_ids = np.array([[7, 1], [8, 2], [9, 3]])
    tree = build_chain(top_ids, 2)
    assert tree.tokens.tolist() == [7, 8]
    assert tree.parents.tolist() == [0, 1]
    assert tree.depths.tolist() == [1, 2]
    assert tree.tokens.dtype == np.int32
    assert build_chain(top_ids, 10).tokens.tolist() == [7, 8, 9]
    assert build_chain(top_ids, 0).num_nodes == 0
    with pytest.raises(ValueError, match="depth"):
        build_chain(top_ids, -1)


def test_tree_attention_mask_hand_made():
    expected = np.array(
        [
            # root n1 n2 n3 n4 n5
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # node 1
            [1, 0, 1, 0, 0, 0],  # node 2
            [1, 1, 0, 1, 0, 0],  # node 3 (under 1)
            [1, 1, 0, 0, 1, 0],  # node 4 (under 1)
            [1, 1, 0, 1, 0, 1],  # node 5 (under 3)
        ],
        dtype=bool,
    )
    mask = tree_attention_mask(HAND_PARENTS)
    assert mask.dtype == bool
    assert np.array_equal(mask, expected)
    assert np.array_equal(tree_attention_mask(np.zeros(0, dtype=np.int32)), [[True]])


def test_node_depths():
    assert node_depths(HAND_PARENTS).tolist() == [1, 1, 2, 2, 3]
    assert node_depths(np.zeros(0, dtype=np.int32)).tolist() == []
    top_ids, top_lps = make_draft(np.random.default_rng(3), 6, 3, ties=False)
    tree = build_ddtree(top_ids, top_lps, 60)
    assert np.array_equal(node_depths(tree.parents), tree.depths)
    with pytest.raises(ValueError, match=r"parents\[1\] = 2"):
        node_depths(np.array([0, 2]))


def test_validate_tree_accepts_valid():
    validate_tree(np.array([5, 6, 5, 7, 8]), HAND_PARENTS, vocab_size=10, max_nodes=5)
    validate_tree([], [], vocab_size=10, max_nodes=0)


@pytest.mark.parametrize(
    ("tokens", "parents", "match"),
    [
        ([1, 2, 3], [0, 0], r"tokens has 3 entries but parents"),
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0], r"tokens has 6 nodes, more than max_nodes = 5"),
        ([1, -1, 3], [0, 0, 0], r"tokens\[1\] = -1 is not in \[0, 10\)"),
        ([1, 2, 10], [0, 0, 0], r"tokens\[2\] = 10 is not in \[0, 10\)"),
        ([1.0, 2.0], [0, 0], r"tokens must be integers"),
        ([1, 2, 3], [0, 2, 0], r"parents\[1\] = 2 is not in \[0, 1\]"),
        ([1, 2, 3], [0, 0, -1], r"parents\[2\] = -1 is not in \[0, 2\]"),
        ([1, 2], [0, 0.5], r"parents must be integers"),
        ([1, 2, 1], [0, 1, 0], r"tokens\[0\] and tokens\[2\] \(nodes 1 and 3\) .* parent 0 with token 1"),
        ([1, 2, 3, 2], [0, 1, 1, 1], r"tokens\[1\] and tokens\[3\] \(nodes 2 and 4\) .* parent 1 with token 2"),
    ],
)
def test_validate_tree_rejects(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        validate_tree(np.asarray(tokens), np.asarray(parents), vocab_size=10, max_nodes=5)
