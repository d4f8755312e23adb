"""Training a DFlash2 draft's candidate selector, and the acceptance of its walk.

Terms (``splitspec.models.dflash2`` defines the scores; ``splitspec.train.draft`` the blocks):

- *candidates* of a block row: the top-K tokens of the draft's logits there, chosen without
  gradient. In training the row's gold token (its label) joins them when it is missing, in place
  of the last one, so every row with weight teaches the selector (public trainers differ here:
  some drop such rows instead; docs/dflash2.md).
- *selector loss*: cross-entropy over a row's K candidates of ``S(gold_{t-1}, .)`` against the
  gold token's index, the predecessor teacher-forced (the previous row's label; the anchor at row
  1), each row weighted as in the draft's loss: ``Σ w·CE / Σ w``. The unary term keeps its gradient.
- *walk acceptance*: the acceptance estimate of ``splitspec.train.draft`` with the drafted chain
  being the selector's greedy walk over each row's candidates, from the anchor.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from splitspec.models.dflash2 import DFlash2Draft

LOGIT_ELEMENTS = 1 << 27  # candidates are chosen from at most this many logits at once


@torch.no_grad()
def top_candidates(hidden: torch.Tensor, head: torch.Tensor, k: int) -> torch.Tensor:
    """[..., K] int64: the top-K token ids of ``hidden`` [..., H] @ ``head``ᵀ, best first (in chunks)."""
    flat = hidden.flatten(0, -2)
    rows = max(1, LOGIT_ELEMENTS // head.shape[0])
    out = torch.cat([F.linear(flat[s : s + rows], head).topk(k, dim=-1).indices for s in range(0, len(flat), rows)])
    return out.view(*hidden.shape[:-1], k)


def with_gold(candidates: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``candidates`` [R, K] with ``gold`` [R] put in the last place where missing, and its index [R]."""
    hit = candidates == gold[:, None]  # [R, K]
    missing = ~hit.any(-1)
    candidates = candidates.clone()
    candidates[missing, -1] = gold[missing]
    index = torch.where(missing, candidates.shape[1] - 1, hit.float().argmax(-1))
    return candidates, index


def selector_loss_sum(
    draft: DFlash2Draft,
    hidden: torch.Tensor,  # [N, Q, H] the draft's normed block rows (Q = A blocks of B rows)
    head: torch.Tensor,  # [V, H] the target's LM head
    labels: torch.Tensor,  # [N, Q] each row's gold token
    weights: torch.Tensor,  # [N, Q] loss weights, 0 for row 0 and past the sequence end
    inputs: torch.Tensor,  # [N, Q] the blocks' inputs: the anchor token at row 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·CE, Σ w) of the selector loss (module docstring) over the rows of positive weight."""
    c = draft.config
    b = c.block_size
    previous = torch.roll(labels.unflatten(1, (-1, b)), 1, dims=2)  # [N, A, B]: row k's label at row k + 1
    previous[..., 1] = inputs.unflatten(1, (-1, b))[..., 0]  # row 1 follows the anchor itself
    previous = previous.flatten(1)
    keep = weights > 0  # never row 0, so the roll's wrap-around is never read
    rows, gold, before, w = hidden[keep], labels[keep], previous[keep], weights[keep]  # [R, H], [R], [R], [R]
    candidates, index = with_gold(top_candidates(rows, head, c.selector_top_k), gold)  # [R, K], [R]
    unary = draft.draft_logits((rows[:, None, :] * head[candidates]).sum(-1))  # [R, K] with gradient
    scores = draft.candidate_selector.scores_after(rows, unary, candidates, before)  # [R, K]
    return (F.cross_entropy(scores, index, reduction="none") * w).sum(), w.sum()


@torch.no_grad()
def walked_tokens(draft: DFlash2Draft, hidden: torch.Tensor, head: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The selector's greedy walk of each block after its anchor token (``anchors`` [N, A]):
    ``hidden`` [N, A, B, H] -> drafted tokens [N, A, B] (row 0 is not drafted: it holds the top-1
    of its logits, never read)."""
    c = draft.config
    candidates = top_candidates(hidden, head, c.selector_top_k)  # [N, A, B, K]
    unary = draft.draft_logits((hidden[..., None, :] * head[candidates]).sum(-1))  # [N, A, B, K]
    pairs = draft.candidate_selector.pair_scores(hidden[..., 1:, :], unary[..., 1:, :], candidates[..., 1:, :], anchors)  # [N, A, L, K, K]
    drafted = candidates[..., 0].clone()  # [N, A, B]
    index = torch.zeros(pairs.shape[:2], dtype=torch.long, device=hidden.device)  # [N, A]: the anchor's row
    for t in range(pairs.shape[2]):
        row = pairs[:, :, t].gather(2, index[..., None, None].expand(-1, -1, 1, pairs.shape[-1])).squeeze(2)  # [N, A, K]
        index = row.argmax(-1)
        drafted[..., t + 1] = candidates[..., t + 1, :].gather(-1, index[..., None]).squeeze(-1)
    return drafted
