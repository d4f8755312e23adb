"""The adaptive tree budget: how many draft nodes a step should verify, given the load (numpy only).

Terms
-----
budget ``b``
    Draft nodes verified by one step, root excluded (:mod:`splitspec.spec.tree`); ``b = 0`` is a
    target-only step. A tree of ``b`` nodes is ``b + 1`` rows of the verify pass.
pass
    One forward pass of the target. A target that batches runs the verify steps of all its ready
    sequences as one pass: its *rows* are those of every sequence's tree, its *concurrency* ``n``
    the number of sequences in it.
E[AL](b)
    The expected tokens a step commits (its acceptance length, bonus included) when its tree is the
    first ``b`` nodes of a best-first DDTree. Nodes of one depth are exclusive events (the accepted
    path holds at most one node per depth), so the expected accepted nodes are the sum of the nodes'
    acceptance probabilities. Were the target to draw what the draft predicts, node ``i`` would be
    accepted with probability ``exp(score_i)`` (its path score); ``c(d)`` corrects that per depth::

        E[AL](b) = 1 + sum_{i < b} c(depth_i) * exp(score_i)

    DDTree pops nodes in non-increasing score order and the tree of budget ``b`` is its first ``b``
    pops (:meth:`DraftTree.prefix`), so one tree of the largest budget gives E[AL] of every budget
    as prefix sums.
calibration ``c(d)``
    Observed over predicted acceptance at depth ``d``: the share of steps whose accepted path reached
    depth ``d``, over the probability mass their trees put at depth ``d`` (:func:`depth_mass`).
    1.0 until observed.
cost ``t(rows)``
    Seconds of a verify pass of ``rows`` rows. On a large model it stays near one token's time while
    rows are few (memory-bound) and grows with rows under load (compute-bound). Learned from
    observed passes: a point per row bucket (:func:`row_bucket`), joined by :func:`verify_cost`.
``t_other``
    Seconds of a step outside the verify pass: the draft's proposal, the wire, the gateway's work.

Choice: every sequence in a pass is assumed to choose alike, so a pass of ``n`` sequences at budget
``b`` has ``n * (b + 1)`` rows, and each sequence commits ``E[AL](b)`` tokens per round of
``t_other + t(n * (b + 1))`` seconds; :func:`choose_budget` maximizes that rate. The sequences
live are the same whatever the budget, so the most tokens per second of each is the most of all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "ADAPTIVE_BUDGETS", "budget_rates", "choose_budget", "depth_mass", "expected_acceptance", "prefix_depth_mass", "row_bucket",
    "verify_cost",
]

BUCKETS_PER_OCTAVE = 2  # row buckets per doubling of rows: points ~1.41x apart
# The budgets an adaptive step chooses among: those whose trees (b + 1 rows) fill a row bucket of
# the target's fixed-shape passes (``services.target.graphs.ROW_BUCKETS``). Each block size is a
# CUDA graph shape; any budget would make tens of them, captured one by one while serving (on an
# H200, 56 captures of 50-1500 ms in a two-minute adaptive run).
ADAPTIVE_BUDGETS = (0, 1, 3, 7, 15, 23, 31, 47, 63)


def expected_acceptance(scores: np.ndarray, depths: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    """E[AL](b) for ``b = 0 .. n`` of a tree's prefixes.

    Args:
        scores: ``[n]`` float, path scores of the nodes in node order (``DraftTree.scores``).
        depths: ``[n]`` int, their depths (``DraftTree.depths``, >= 1).
        calibration: ``[D + 1]`` float, ``c(d)`` at index ``d`` for ``d = 0 .. D``, ``D >= max(depths)``
            (index 0, the root's, is unused).

    Returns:
        ``[n + 1]`` float64: ``1 + `` the prefix sums of ``c(depth_i) * exp(score_i)``.
    """
    scores, depths = np.asarray(scores, dtype=np.float64), np.asarray(depths)
    accept = np.asarray(calibration, dtype=np.float64)[depths] * np.exp(scores)  # [n]
    return 1.0 + np.concatenate(([0.0], np.cumsum(accept)))  # [n + 1]


def depth_mass(scores: np.ndarray, depths: np.ndarray, max_depth: int) -> np.ndarray:
    """The draft's probability that the accepted path reaches each depth: ``[max_depth + 1]`` float64,
    index ``d`` the sum of ``exp(score)`` over the nodes at depth ``d`` (index 0, the root, is 0).

    ``scores`` and ``depths`` are ``[n]`` as for :func:`expected_acceptance`, ``depths <= max_depth``.
    """
    weights = np.exp(np.asarray(scores, dtype=np.float64))  # [n]
    return np.bincount(np.asarray(depths), weights=weights, minlength=max_depth + 1)


def prefix_depth_mass(scores: np.ndarray, depths: np.ndarray, budgets: int) -> np.ndarray:
    """:func:`depth_mass` of every prefix of a tree: ``[budgets + 1, budgets + 1]`` float64, row ``b``
    that of the tree's first ``b`` nodes (the tree of budget ``b``), column ``d`` a depth.

    ``scores`` and ``depths`` are ``[n]`` as for :func:`expected_acceptance`, ``depths <= budgets``.
    A tree of fewer than ``budgets`` nodes repeats its whole tree's row below its last: cut to any
    larger budget it stays itself. ``E[AL](b) = 1 + row_b . c`` (``c``: the calibration)."""
    n = min(len(scores), budgets)
    weights = np.exp(np.asarray(scores[:n], dtype=np.float64))  # [n]
    per_node = np.zeros((budgets + 1, budgets + 1))  # [node + 1, depth]
    per_node[np.arange(1, n + 1), np.asarray(depths[:n])] = weights
    return np.cumsum(per_node, axis=0)  # [budgets + 1, depth]


def row_bucket(rows: int) -> int:
    """The cost model's bucket of a pass of ``rows`` (>= 1) rows: ``floor(2 * log2(rows))``, so the
    points of the cost curve are dense where the curve bends (few rows) and sparse where it is linear."""
    return int(np.floor(BUCKETS_PER_OCTAVE * np.log2(max(rows, 1))))


def verify_cost(rows: np.ndarray, known_rows: np.ndarray, known_seconds: np.ndarray) -> np.ndarray:
    """``t(rows)``: seconds of a verify pass, from observed points.

    Args:
        rows: ``[m]`` float, row counts to price.
        known_rows: ``[k]`` float, ``k >= 1``, distinct row counts observed (a bucket's mean rows).
        known_seconds: ``[k]`` float, the pass time at each.

    Returns:
        ``[m]`` float64. Points are made non-decreasing in rows (a pass with more rows never costs
        less) by lowering a point to the cheapest one of more rows: a pass only runs slower than its
        shape's cost by accident (a kernel compiled, a busier moment), so the low points are the
        ones to trust. (Raising the later points to the dearest earlier one instead let one stale
        point flatten the curve: on an H200, the 27B's first passes of 1 and 4 rows timed at
        262-320 ms lifted every larger pass to 320 ms, and 64-node trees at 32 users looked as
        cheap as 3-node ones, BENCHMARKS.md [J4].) Points are joined linearly. Below the fewest
        rows the first segment continues, no cheaper per row than there; above the most rows the
        last segment continues, rising at least as fast as the line from the first point to the last (two
        equal points at the top say little of what a larger pass costs); with one point the curve
        is flat. Both ends are optimistic guesses where the curve bends (flat, then linear), so
        that a pass of an unseen size gets tried, and so measured, rather than ruled out unseen.
    """
    rows = np.asarray(rows, dtype=np.float64)
    order = np.argsort(known_rows)
    x = np.asarray(known_rows, dtype=np.float64)[order]  # [k]
    y = np.minimum.accumulate(np.asarray(known_seconds, dtype=np.float64)[order][::-1])[::-1]  # [k]
    t = np.interp(rows, x, y)  # [m], flat outside [x[0], x[-1]]
    if len(x) >= 2:
        first = (y[1] - y[0]) / (x[1] - x[0])
        last = max((y[-1] - y[-2]) / (x[-1] - x[-2]), (y[-1] - y[0]) / (x[-1] - x[0]))
        below = np.maximum(y[0] - first * (x[0] - rows), y[0] * rows / x[0])
        t = np.where(rows < x[0], below, np.where(rows > x[-1], y[-1] + last * (rows - x[-1]), t))
    return t


def choose_budget(
    expected_al: np.ndarray,
    cost: Callable[[np.ndarray], np.ndarray],
    t_other: float,
    concurrency: float,
    candidates: Sequence[int] | None = None,
) -> int:
    """The budget that maximizes each sequence's committed tokens per second.

    Args:
        expected_al: ``[B + 1]`` float, E[AL](b) for ``b = 0 .. B`` (:func:`expected_acceptance`).
        cost: ``t(rows)``, vectorized: ``[m]`` rows -> ``[m]`` seconds (:func:`verify_cost`).
        t_other: seconds of a step outside the verify pass.
        concurrency: sequences per pass ``n`` (> 0; a mean, so not necessarily whole).
        candidates: budgets to consider, each in ``[0, B]`` (default: all of ``0 .. B``).

    Returns:
        ``argmax_b E[AL](b) / (t_other + t(n * (b + 1)))``; among equal rates, the smallest ``b``.
    """
    b = np.arange(len(expected_al)) if candidates is None else np.asarray(candidates, dtype=np.int64)  # [m]
    return int(b[np.argmax(budget_rates(expected_al, cost, t_other, concurrency, b))])


def budget_rates(
    expected_al: np.ndarray, cost: Callable[[np.ndarray], np.ndarray], t_other: float | np.ndarray, concurrency: float | np.ndarray,
    budgets: np.ndarray,
) -> np.ndarray:
    """``[m]`` committed tokens per second of a sequence at each of ``budgets`` (``[m]`` int): the
    rate :func:`choose_budget` maximizes, with its arguments. ``t_other`` and ``concurrency`` may
    be ``[m]``, one per budget, where a budget changes them (a target-only step asks no draft, and
    its sequences meet in fewer, larger passes: ``services.gateway.budget``)."""
    expected_al = np.asarray(expected_al, dtype=np.float64)
    return expected_al[budgets] / (t_other + cost(concurrency * (budgets + 1)))  # [m]
