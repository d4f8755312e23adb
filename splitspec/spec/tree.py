"""DDTree draft trees: construction, attention mask and validation (numpy only).

Terms
-----
root (anchor)
    The pending token from the previous step (the last step's bonus token). It is row 0 of every
    verify block, sits at depth 0 and is not stored in :class:`DraftTree`; it is always committed.
node
    A drafted token hanging below the root. Node ``j`` (1-based, ``j = i + 1``) is stored at index
    ``i`` of the ``DraftTree`` arrays, and is row ``j`` of the verify block.
depth
    Distance from the root: the root has depth 0 and a node at depth ``d`` proposes the token at
    draft block row ``d`` (``1 <= d <= L``, ``L = block_size - 1``). Siblings share a depth and
    hence a position id (``start + depth``).
budget
    The maximum number of non-root nodes in the tree.
path score
    The sum of the draft's log-probs of the ranks on the path from the root to a node (one rank per
    depth): the node's log-probability under the draft, were its depths independent.
chain seed
    The lucebox variant: the full top-1 spine (the chain DFlash would propose) is inserted first,
    then the remaining budget is spent best-first as usual.
bonus token
    The target's own token after the last accepted node; it becomes the next step's root.
accepted path
    The root plus the nodes whose tokens match the target's tokens along one root-to-node path
    (see :mod:`splitspec.spec.acceptance`).
acceptance length (AL)
    The number of tokens committed per step, root included: ``len(accepted path incl. root)``.
    Over many steps, committed tokens / steps (:mod:`splitspec.spec.acceptance_length`).

Tree construction (DDTree, best-first): for depths ``d = 1..L`` the draft gives the top-K token ids
and log-probs. The score of a path is the sum of the log-probs of its ranks, one per depth. A
max-heap pops the best frontier path; each popped node pushes its next sibling (same parent and
depth, rank + 1) and its first child (depth + 1, rank 0). Since neither push can score above the
popped node, pops come out in non-increasing score order and the tree is a prefix-closed top-budget
set of paths. The pops do not depend on the budget, so the tree of budget ``b`` is the first ``b``
nodes of any larger one (:meth:`DraftTree.prefix`): one build at the largest budget serves every
smaller one (``splitspec.spec.budget`` chooses among them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_TOP_K",
    "DraftTree",
    "check_top_ids",
    "grow_best_first",
    "build_chain",
    "build_ddtree",
    "node_depths",
    "tree_attention_mask",
    "validate_tree",
]

DEFAULT_TOP_K = 8  # candidates per depth a gateway asks of the draft unless told otherwise (its --top-k)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree without its root; node ``i + 1`` is stored at index ``i``."""

    tokens: np.ndarray  # [num_nodes] int32: token of node i+1 (the root is not stored)
    parents: np.ndarray  # [num_nodes] int32: parent of node i+1; 0 = root, j > 0 = node j; parents[i] <= i
    depths: np.ndarray  # [num_nodes] int32: depth of node i+1 (root = 0, so depths >= 1)
    # [num_nodes] float64: path score of node i+1, or None for a tree built without log-probs (a chain)
    scores: np.ndarray | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def prefix(self, num_nodes: int) -> DraftTree:
        """The first ``num_nodes`` nodes (all of them if there are fewer).

        Every node's parent comes before it (``parents[i] <= i``), so any prefix is itself a tree.
        A tree of :func:`build_ddtree` cut to ``b`` nodes is exactly the tree it builds under budget
        ``b`` from the same draft, ``max_depth`` and ``chain_seed``: pops come out in the same order
        whatever the budget, and a chain seed of ``b`` or more nodes is cut to the one of budget ``b``.
        """
        if num_nodes < 0:
            raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
        cut = slice(0, num_nodes)
        scores = None if self.scores is None else self.scores[cut]
        return DraftTree(tokens=self.tokens[cut], parents=self.parents[cut], depths=self.depths[cut], scores=scores)

    @classmethod
    def empty(cls) -> DraftTree:
        """The root-only tree."""
        none = np.zeros(0, dtype=np.int32)
        return cls(tokens=none, parents=none.copy(), depths=none.copy(), scores=np.zeros(0))


def _from_lists(tokens: list[int], parents: list[int], depths: list[int], scores: list[float]) -> DraftTree:
    return DraftTree(
        tokens=np.asarray(tokens, dtype=np.int32),
        parents=np.asarray(parents, dtype=np.int32),
        depths=np.asarray(depths, dtype=np.int32),
        scores=np.asarray(scores, dtype=np.float64),
    )


def check_top_ids(top_ids: np.ndarray) -> np.ndarray:
    top_ids = np.asarray(top_ids)
    if top_ids.ndim != 2 or top_ids.shape[0] < 1 or top_ids.shape[1] < 1:
        raise ValueError(f"top_ids must have shape [L, K] with L, K >= 1, got {top_ids.shape}")
    if not np.issubdtype(top_ids.dtype, np.integer):
        raise ValueError(f"top_ids must be integers, got dtype {top_ids.dtype}")
    return top_ids


def build_ddtree(
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    budget: int,
    *,
    chain_seed: bool = False,
    max_depth: int | None = None,
) -> DraftTree:
    """Build the DDTree of at most ``budget`` nodes (reference ``build_ddtree_tree``, spec 2.2).

    Args:
        top_ids: ``[L, K]`` int, row ``d - 1`` holds the top-K token ids at depth ``d``, best first;
            ids within a row must be distinct.
        top_logprobs: ``[L, K]`` float, the matching log-probs, sorted descending per row.
        budget: maximum number of non-root nodes (0 gives the root-only tree).
        chain_seed: insert the top-1 spine of depth ``min(L, budget, max_depth)`` first (nodes
            ``1..D``), pushing the rank-1 sibling of each spine node, then continue best-first.
        max_depth: deepest depth allowed (near ``max_tokens`` or the context end); default ``L``.

    Node order is insertion order: pop order, preceded by the spine when ``chain_seed``. Ties in
    score pop in push order, so the result is deterministic. A pushed score is the parent's path
    score plus one log-prob (the same value as DDTree's sibling update, arXiv 2604.12989, without its rounding
    drift), so equal paths tie exactly. The tree carries each node's path score (``DraftTree.scores``:
    non-increasing in node order, the spine aside).
    """
    top_ids = check_top_ids(top_ids)
    top_logprobs = np.asarray(top_logprobs)
    if top_logprobs.shape != top_ids.shape:
        raise ValueError(f"top_logprobs shape {top_logprobs.shape} != top_ids shape {top_ids.shape}")
    if np.isnan(top_logprobs).any():
        raise ValueError("top_logprobs contains NaN")
    if (np.diff(top_logprobs, axis=1) > 0).any():
        raise ValueError("top_logprobs rows must be sorted in descending order")
    if (np.diff(np.sort(top_ids, axis=1), axis=1) == 0).any():
        raise ValueError("top_ids rows must hold distinct token ids")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    return grow_best_first(top_ids.tolist(), top_logprobs.astype(np.float64).tolist(), None, budget, chain_seed, max_depth)


def grow_best_first(ids: list, lps: list, cands: list | None, budget: int, chain_seed: bool, max_depth: int | None) -> DraftTree:
    """Best-first growth (module docstring) over per-parent rankings.

    ``lps[d-1][a][r]`` is the log-prob of the rank-``r`` child at depth ``d`` of a parent whose
    candidate index at depth ``d - 1`` is ``a`` (the root: ``a = 0``); ``cands[d-1][a][r]`` that
    child's candidate index, ``ids`` its token (``[d-1][r]`` when ``cands`` is None: one ranking per
    depth for every parent, the candidate index then being the rank)."""
    num_depths = len(lps)
    max_depth = num_depths if max_depth is None else min(max_depth, num_depths)
    if budget == 0 or max_depth == 0:
        return DraftTree.empty()
    k = len(ids[0]) if cands is None else len(ids[0][0])
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    rows = [0]  # [1 + num_nodes] each row's candidate index at its depth (the root's: 0)
    scores = [0.0]  # [1 + num_nodes] path score of each row, root first
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, push counter, parent, depth, rank)
    counter = 0

    def edge(parent: int, depth: int, rank: int) -> float:
        return lps[depth - 1][rank] if cands is None else lps[depth - 1][rows[parent]][rank]

    def push(parent: int, depth: int, rank: int) -> None:
        nonlocal counter
        heapq.heappush(heap, (-(scores[parent] + edge(parent, depth, rank)), counter, parent, depth, rank))
        counter += 1

    def insert(parent: int, depth: int, rank: int, score: float) -> int:
        """Append a node and push its next sibling; return its node index."""
        if cands is None:
            tokens.append(ids[depth - 1][rank])
            rows.append(rank)
        else:
            tokens.append(ids[depth - 1][rows[parent]][rank])
            rows.append(cands[depth - 1][rows[parent]][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        if rank + 1 < k:
            push(parent, depth, rank + 1)
        return len(tokens)

    if chain_seed:
        # Spine node d is row d (depth d). Its first child is the next spine node, so only siblings are
        # pushed; the last spine node is either at max_depth or has used up the whole budget.
        node = 0
        for depth in range(1, min(budget, max_depth) + 1):
            node = insert(node, depth, 0, scores[node] + edge(node, depth, 0))
    else:
        push(0, 1, 0)

    while heap and len(tokens) < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(heap)
        node = insert(parent, depth, rank, -neg_score)
        if depth < max_depth:
            push(node, depth + 1, 0)
    return _from_lists(tokens, parents, depths, scores[1:])


def build_chain(top_ids: np.ndarray, depth: int) -> DraftTree:
    """The top-1 spine of ``min(depth, L)`` nodes: node ``d`` is ``top_ids[d - 1, 0]``, child of ``d - 1``.

    ``top_ids`` is ``[L, K]`` as for :func:`build_ddtree`.
    """
    top_ids = check_top_ids(top_ids)
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    n = min(depth, top_ids.shape[0])
    return DraftTree(
        tokens=top_ids[:n, 0].astype(np.int32),
        parents=np.arange(n, dtype=np.int32),
        depths=np.arange(1, n + 1, dtype=np.int32),
    )


def _check_parents(parents: np.ndarray) -> np.ndarray:
    """Return ``parents`` as a 1-D int array; raise unless ``0 <= parents[i] <= i`` for all i."""
    parents = np.asarray(parents)
    if parents.ndim != 1:
        raise ValueError(f"parents must be 1-D, got shape {parents.shape}")
    if parents.size == 0:
        return parents.astype(np.int64)
    if not np.issubdtype(parents.dtype, np.integer):
        raise ValueError(f"parents must be integers, got dtype {parents.dtype}")
    bad = np.flatnonzero((parents < 0) | (parents > np.arange(len(parents))))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parents[{i}] = {int(parents[i])} is not in [0, {i}]")
    return parents


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depths ``[n]`` (int32, >= 1) of the nodes described by ``parents`` ``[n]``."""
    parents = _check_parents(parents).tolist()
    depths = [0]  # [1 + n] root first
    for p in parents:
        depths.append(depths[p] + 1)
    return np.asarray(depths[1:], dtype=np.int32)


def tree_attention_mask(parents: np.ndarray) -> np.ndarray:
    """Ancestor-or-self visibility ``[n + 1, n + 1]`` bool, root at row/column 0.

    ``mask[i, j]`` is True iff row ``j`` is row ``i`` or one of its ancestors; the root sees only
    itself. ``parents`` is ``[n]`` as in :class:`DraftTree`.
    """
    parents = _check_parents(parents).tolist()
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)  # [n + 1, n + 1]
    mask[0, 0] = True
    for i, p in enumerate(parents, start=1):
        mask[i] = mask[p]
        mask[i, i] = True
    return mask


def validate_tree(tokens: np.ndarray, parents: np.ndarray, vocab_size: int, max_nodes: int) -> None:
    """Check an untrusted tree; raise ValueError naming the field and offending index/value.

    ``tokens`` and ``parents`` are ``[n]`` as in :class:`DraftTree`. Requires equal lengths,
    ``n <= max_nodes``, tokens in ``[0, vocab_size)``, ``0 <= parents[i] <= i``, and distinct tokens
    among the children of each parent (the acceptance walk needs an unambiguous child).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if np.ndim(parents) != 1 or len(parents) != len(tokens):
        raise ValueError(f"tokens has {len(tokens)} entries but parents has shape {np.shape(parents)}")
    if len(tokens) > max_nodes:
        raise ValueError(f"tokens has {len(tokens)} nodes, more than max_nodes = {max_nodes}")
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"tokens[{i}] = {int(tokens[i])} is not in [0, {vocab_size})")
    parents = _check_parents(parents)
    seen: dict[tuple[int, int], int] = {}  # (parent, token) -> index of the first such node
    for i, key in enumerate(zip(parents.tolist(), tokens.tolist())):
        first = seen.setdefault(key, i)
        if first != i:
            raise ValueError(
                f"tokens[{first}] and tokens[{i}] (nodes {first + 1} and {i + 1}) are both children "
                f"of parent {key[0]} with token {key[1]}"
            )
