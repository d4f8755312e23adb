"""The DFlash2 lattice: the tree builder against brute-force enumeration of every path, and the walks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from splitspec.spec.lattice import build_lattice_tree, edge_logprobs, path_chain, sampled_path, selector_path
from splitspec.spec.tree import build_ddtree, validate_tree


def lattice(rng, depths: int, k: int, vocab: int = 50):
    top_ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(depths)])
    scores = rng.normal(0, 2, (depths, k, k))
    scores[0] = scores[0, 0]  # depth 1: one predecessor, the anchor
    return top_ids, scores


def brute_force(scores: np.ndarray, max_depth: int) -> dict[tuple[int, ...], float]:
    """Every path of 1..max_depth candidate indices and its score, by the definition."""
    logq = edge_logprobs(scores)
    k = scores.shape[1]
    out = {}
    for d in range(1, max_depth + 1):
        for path in itertools.product(range(k), repeat=d):
            prev, total = 0, 0.0
            for t, b in enumerate(path):
                total += logq[t, prev, b]
                prev = b
            out[path] = total
    return out


def tree_paths(tree, top_ids) -> dict[tuple[int, ...], float]:
    """Each node's path of candidate indices (recovered from its tokens) and its score."""
    paths: dict[int, tuple[int, ...]] = {0: ()}
    out = {}
    for i in range(tree.num_nodes):
        d = int(tree.depths[i])
        index = int(np.flatnonzero(top_ids[d - 1] == tree.tokens[i])[0])
        paths[i + 1] = paths[int(tree.parents[i])] + (index,)
        out[paths[i + 1]] = float(tree.scores[i])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_depth", [None, 2])
def test_the_tree_is_the_best_paths_by_brute_force(seed, max_depth):
    rng = np.random.default_rng(seed)
    depths, k = 4, 3
    top_ids, scores = lattice(rng, depths, k)
    everything = brute_force(scores, max_depth or depths)
    ranked = sorted(everything, key=everything.get, reverse=True)
    for budget in (1, 2, 5, 11, 40, len(everything) + 3):
        tree = build_lattice_tree(top_ids, scores, budget, max_depth=max_depth)
        got = tree_paths(tree, top_ids)
        assert set(got) == set(ranked[:budget])  # continuous scores: no ties
        assert all(abs(got[p] - everything[p]) < 1e-9 for p in got)
        assert np.all(np.diff(tree.scores) <= 1e-12)  # pops come out best first
        validate_tree(tree.tokens, tree.parents, 50, budget)
        smaller = build_lattice_tree(top_ids, scores, min(budget, 5), max_depth=max_depth)
        assert np.array_equal(tree.prefix(min(budget, 5)).tokens, smaller.tokens)  # one build serves every smaller budget


def test_the_chain_seed_is_the_selector_path():
    rng = np.random.default_rng(7)
    top_ids, scores = lattice(rng, 5, 4)
    path = selector_path(scores, 5)
    tree = build_lattice_tree(top_ids, scores, 9, chain_seed=True)
    spine = path_chain(top_ids, path)
    assert np.array_equal(tree.tokens[:5], spine.tokens) and np.array_equal(tree.parents[:5], np.arange(5))
    # Without the seed the selector path need not be among the first nodes, and with it the rest is best-first.
    assert np.all(np.diff(tree.scores[5:]) <= 1e-12)


def test_identical_rows_grow_the_ddtree_of_the_renormalised_log_probs():
    rng = np.random.default_rng(8)
    top_ids, _ = lattice(rng, 5, 4)
    unary = np.sort(rng.normal(0, 2, (5, 4)), axis=1)[:, ::-1]
    scores = np.broadcast_to(unary[:, None, :], (5, 4, 4))
    renormalised = edge_logprobs(unary)
    for budget, seed in itertools.product((1, 6, 30), (False, True)):
        a = build_lattice_tree(top_ids, scores, budget, chain_seed=seed)
        b = build_ddtree(top_ids, renormalised, budget, chain_seed=seed)
        for field in ("tokens", "parents", "depths"):
            assert np.array_equal(getattr(a, field), getattr(b, field))
        assert np.allclose(a.scores, b.scores)


def test_the_selector_path_is_the_greedy_walk():
    scores = np.zeros((3, 3, 3))
    scores[0, :, 2] = 1.0  # depth 1: candidate 2
    scores[1, 2] = [0.0, 5.0, 5.0]  # after candidate 2: a tie between 1 and 2 goes to 1
    scores[1, 0] = [9.0, 0.0, 0.0]  # a row the walk never reads
    scores[2, 1] = [0.0, 0.0, 3.0]
    assert selector_path(scores, 3).tolist() == [2, 1, 2]
    assert selector_path(scores, 2).tolist() == [2, 1]
    chain = path_chain(np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]]), selector_path(scores, 3))
    assert chain.tokens.tolist() == [12, 21, 32] and chain.parents.tolist() == [0, 1, 2]


def test_a_sampled_path_follows_the_selector_distribution():
    scores = np.zeros((2, 3, 3))
    scores[0, :] = np.log([0.6, 0.3, 0.1])
    scores[1, 0] = np.log([0.1, 0.1, 0.8])
    scores[1, 1] = np.log([0.5, 0.25, 0.25])
    scores[1, 2] = np.log([1 / 3] * 3)
    rng = np.random.default_rng(0)
    draws = [tuple(sampled_path(scores, 2, 1.0, rng)) for _ in range(20000)]
    for path, p in [((0, 2), 0.6 * 0.8), ((1, 0), 0.3 * 0.5), ((2, 1), 0.1 / 3)]:
        assert abs(draws.count(path) / len(draws) - p) < 0.015
    cold = {tuple(sampled_path(scores, 2, 0.05, rng)) for _ in range(50)}
    assert cold == {(0, 2)}  # a low temperature approaches the greedy walk
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampled_path(scores, 2, 0.0, rng)


@pytest.mark.parametrize("bad, message", [
    (lambda ids, s: (ids, s[:, :2]), "is not \\[L, K, K\\]"),
    (lambda ids, s: (ids, np.where(s > 1, np.nan, s)), "NaN or an infinity"),
    (lambda ids, s: (np.repeat(ids[:, :1], 3, axis=1), s), "distinct token ids"),
])
def test_malformed_lattices_are_refused(bad, message):
    ids, s = lattice(np.random.default_rng(1), 3, 3)
    with pytest.raises(ValueError, match=message):
        build_lattice_tree(*bad(ids, s), 4)
