"""Walks of a DFlash2 draft's candidate lattice (numpy only).

Terms (``splitspec.models.dflash2`` defines the scores): a proposal holds ``top_ids`` ``[L, K]``,
the candidates of depths ``1..L``, and ``pair_scores`` ``[L, K, K]``, ``S[d-1, a, b]`` the score of
candidate ``b`` of depth ``d`` after candidate ``a`` of depth ``d - 1`` (at depth 1 every row is
the anchor's). A *path* picks one candidate index per depth; the selector's distribution of a
depth's candidate after its predecessor is ``softmax_b S[d-1, a, :]`` (``edge_logprobs``).
"""

from __future__ import annotations

import numpy as np

from splitspec.spec.tree import DraftTree, check_top_ids, grow_best_first


def check_lattice(top_ids: np.ndarray, pair_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``top_ids`` and ``pair_scores`` (float64) of a proposal, checked: ValueError names what is wrong
    (a draft's answer is input too)."""
    top_ids = check_top_ids(top_ids)
    pair_scores = np.asarray(pair_scores, dtype=np.float64)
    num_depths, k = top_ids.shape
    if pair_scores.shape != (num_depths, k, k):
        raise ValueError(f"pair_scores shape {pair_scores.shape} is not [L, K, K] = {(num_depths, k, k)}")
    if not np.isfinite(pair_scores).all():
        raise ValueError("pair_scores holds a NaN or an infinity")
    if (np.diff(np.sort(top_ids, axis=1), axis=1) == 0).any():
        raise ValueError("top_ids rows must hold distinct token ids")
    return top_ids, pair_scores


def edge_logprobs(pair_scores: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis of ``pair_scores`` ``[L, K, K]`` (float64)."""
    s = np.asarray(pair_scores, dtype=np.float64)
    shifted = s - s.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def selector_path(pair_scores: np.ndarray, depth: int) -> np.ndarray:
    """The greedy walk ``[min(depth, L)]`` of candidate indices: at each depth the best candidate
    after the previous pick (the anchor at depth 1); ties go to the lower index, the candidate the
    draft ranked higher."""
    s = np.asarray(pair_scores)
    path, a = [], 0
    for d in range(min(depth, s.shape[0])):
        a = int(np.argmax(s[d, a]))
        path.append(a)
    return np.asarray(path, dtype=np.int64)


def sampled_path(pair_scores: np.ndarray, depth: int, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """A walk ``[min(depth, L)]`` drawing each depth's candidate from ``softmax(S[d-1, a] / T)``
    after the previous draw (T > 0)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample a path, got {temperature}")
    s = np.asarray(pair_scores, dtype=np.float64)
    path, a = [], 0
    for d in range(min(depth, s.shape[0])):
        p = np.exp(edge_logprobs(s[d, a] / temperature))
        a = int(rng.choice(len(p), p=p / p.sum()))
        path.append(a)
    return np.asarray(path, dtype=np.int64)


def path_chain(top_ids: np.ndarray, path: np.ndarray) -> DraftTree:
    """The chain of a path's tokens: node ``d`` is ``top_ids[d - 1, path[d - 1]]``, child of ``d - 1``."""
    n = len(path)
    return DraftTree(
        tokens=np.asarray(top_ids)[np.arange(n), path].astype(np.int32),
        parents=np.arange(n, dtype=np.int32),
        depths=np.arange(1, n + 1, dtype=np.int32),
    )


def build_lattice_tree(
    top_ids: np.ndarray,
    pair_scores: np.ndarray,
    budget: int,
    *,
    chain_seed: bool = False,
    max_depth: int | None = None,
) -> DraftTree:
    """The DDTree of at most ``budget`` nodes over a DFlash2 draft's candidate lattice.

    Args:
        top_ids: ``[L, K]`` int, the candidates of depth ``d`` in row ``d - 1``, distinct per row.
        pair_scores: ``[L, K, K]`` float, ``S[d-1, a, b]``: candidate ``b`` of depth ``d`` after
            candidate ``a`` of depth ``d - 1`` (every row ``a`` alike at depth 1, after the anchor).
        budget, chain_seed, max_depth: as :func:`build_ddtree`; the chain seed is the selector
            path (:func:`selector_path`).

    A node's path score is the sum of its edges' log-probabilities ``log_softmax_b S[d-1, a, b]``
    (the selector's distribution of a depth's candidate after its predecessor), so growth is
    :func:`build_ddtree`'s, with each node's children ranked by its own row of the lattice
    instead of one ranking per depth. :func:`build_ddtree` is the case where every row of a
    depth is the same.
    """
    top_ids, pair_scores = check_lattice(top_ids, pair_scores)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    logq = edge_logprobs(pair_scores)  # [L, K, K]
    order = np.argsort(-logq, axis=2, kind="stable")  # [L, K, K]: each row's candidates, best first
    ids = np.take_along_axis(np.broadcast_to(top_ids[:, None, :], logq.shape), order, axis=2)
    return grow_best_first(ids.tolist(), np.take_along_axis(logq, order, axis=2).tolist(), order.tolist(), budget, chain_seed, max_depth)
