"""The DDTree acceptance walk and the KV compaction that follows it (spec 2.4 and 2.5).

Terms
-----
rows
    The verify block is ``[root, node 1, ..., node n]``: row 0 is the root (the pending token),
    row ``j`` is node ``j`` (stored at index ``j - 1`` of the node arrays, see
    :mod:`splitspec.spec.tree`).
accepted path
    Starting at the root, repeatedly move to the child whose token equals the target's own token
    at the current row; stop when no child matches. The accepted path is the list of visited rows,
    root (row 0) included, in tree order. Its length is the step's acceptance length (AL; over
    many steps see :mod:`splitspec.spec.acceptance_length`).
bonus token
    The target's token at the last accepted row: the first token that left the tree. It is not yet
    in the KV cache and becomes the next step's root.
committed tokens
    The tokens of the accepted path's rows (root included). Their KV rows are kept, moved to the
    front of the block by :func:`compact_rows`; the rest of the block is discarded.

Because row ``cur`` was computed with exactly the accepted prefix visible, each committed token is
what the target itself would have produced (argmax or sample), so the output is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["accept_path", "compact_rows"]


def accept_path(
    tokens: Sequence[int] | np.ndarray,
    parents: Sequence[int] | np.ndarray,
    target_tokens: Sequence[int] | np.ndarray,
) -> tuple[list[int], int]:
    """Follow the target's tokens down the tree.

    Args:
        tokens: ``[n]`` node tokens (root excluded), as in ``DraftTree``.
        parents: ``[n]`` node parents (0 = root, ``j`` = node ``j``); siblings carry distinct tokens.
        target_tokens: ``[n + 1]`` the target's own token drawn at each row, row 0 = root.

    Returns:
        ``(accepted, bonus)``: the accepted rows in tree order starting with 0 (so
        ``len(accepted)`` is AL), and the bonus token (the next root).
    """
    tokens = np.asarray(tokens).tolist()
    parents = np.asarray(parents).tolist()
    target_tokens = np.asarray(target_tokens).tolist()
    if len(parents) != len(tokens) or len(target_tokens) != len(tokens) + 1:
        raise ValueError(
            f"need len(parents) == len(tokens) == len(target_tokens) - 1, got {len(tokens)} tokens, "
            f"{len(parents)} parents and {len(target_tokens)} target_tokens"
        )
    child = {(p, t): j for j, (p, t) in enumerate(zip(parents, tokens), start=1)}  # (row, token) -> child row
    cur = 0
    accepted = [0]
    nxt = target_tokens[0]
    while (cur, nxt) in child:
        cur = child[(cur, nxt)]
        accepted.append(cur)
        nxt = target_tokens[cur]
    return accepted, int(nxt)


def compact_rows(
    cache: torch.Tensor, start: int, accepted: torch.Tensor | Sequence[int], dim: int = -2
) -> None:
    """Move the accepted rows of a verify block to its front, in place.

    ``cache`` holds the block's rows at ``start .. start + n`` along ``dim`` (the sequence
    dimension; e.g. ``[batch, heads, seq, head_dim]`` with ``dim = -2``). For each ``d``, row
    ``start + d`` receives the old row ``start + accepted[d]``. Since ``accepted[d] >= d``, a
    write could clobber a row still to be read, so all rows are gathered first, then written.
    Rows past ``start + len(accepted)`` are left as they are (the caller crops them).

    Example: ``accepted = [0, 2, 5]`` copies row ``start + 2`` to ``start + 1`` and row
    ``start + 5`` to ``start + 2``; row ``start`` (the root) stays. ``accepted = [0]`` is a no-op.

    Rows already in place (a leading ``accepted[d] == d``, as on a decode step or an accepted
    first-child chain) are not touched: a host list of them costs no kernel and no copy.
    """
    if not isinstance(accepted, torch.Tensor) and np.ndim(accepted) == 1:
        moved = next((d for d, a in enumerate(accepted) if a != d), len(accepted))
        start, accepted = start + moved, [a - moved for a in accepted[moved:]]
        if not accepted:
            return
    index = torch.as_tensor(accepted, dtype=torch.long, device=cache.device)  # [AL]
    if index.ndim != 1:
        raise ValueError(f"accepted must be 1-D, got shape {tuple(index.shape)}")
    tail = cache.narrow(dim, start, cache.size(dim) - start)
    rows = tail.index_select(dim, index)  # a copy: reads happen before any write
    tail.narrow(dim, 0, len(index)).copy_(rows)
