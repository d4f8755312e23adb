"""Tests for splitspec.spec.acceptance: the acceptance walk and KV row compaction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitspec.spec.acceptance import accept_path, compact_rows

# Rows: 0 = root; chain 1 -> 2 -> 3 (tokens 10, 11, 12); node 4 (token 20) is a sibling of 1;
# node 5 (token 21) is a sibling of 2 under node 1; node 6 (token 30) hangs below node 5.
TOKENS = [10, 11, 12, 20, 21, 30]
PARENTS = [0, 1, 2, 0, 1, 5]
X = 999  # a target token at a row the walk never reads


def test_full_chain_accepted():
    target = [10, 11, 12, 77, X, X, X]
    assert accept_path(TOKENS, PARENTS, target) == ([0, 1, 2, 3], 77)


def test_rejection_at_root():
    accepted, bonus = accept_path(TOKENS, PARENTS, [55, 10, 11, 12, 20, 21, 30])
    assert accepted == [0]  # AL = 1: only the root is committed
    assert bonus == 55


def test_sibling_at_root():
    assert accept_path(TOKENS, PARENTS, [20, X, X, X, 8, X, X]) == ([0, 4], 8)


def test_deep_branch():
    target = [10, 21, X, X, X, 30, 42]
    assert accept_path(TOKENS, PARENTS, target) == ([0, 1, 5, 6], 42)


def test_partial_chain_then_miss():
    assert accept_path(TOKENS, PARENTS, [10, 11, 13, X, X, X, X]) == ([0, 1, 2], 13)


def test_root_only_tree():
    assert accept_path([], [], [7]) == ([0], 7)


def test_numpy_inputs_give_python_ints():
    accepted, bonus = accept_path(
        np.array(TOKENS, dtype=np.int32),
        np.array(PARENTS, dtype=np.int32),
        np.array([10, 21, X, X, X, 30, 42], dtype=np.int64),
    )
    assert accepted == [0, 1, 5, 6]
    assert type(bonus) is int and all(type(a) is int for a in accepted)


@pytest.mark.parametrize(
    ("tokens", "parents", "target"),
    [([1, 2], [0, 0], [1, 2]), ([1, 2], [0], [1, 2, 3]), ([1], [0], [1, 2, 3])],
)
def test_accept_path_rejects_bad_lengths(tokens, parents, target):
    with pytest.raises(ValueError, match="len"):
        accept_path(tokens, parents, target)


def make_cache(seq: int = 9) -> torch.Tensor:
    """``[2, 3, seq, 4]`` with value 1000 * b + 100 * h + 10 * t + c, so every row is recognisable."""
    b, h, t, c = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(seq), torch.arange(4), indexing="ij")
    return (1000 * b + 100 * h + 10 * t + c).float()


def expected_cache(sources: list[int]) -> torch.Tensor:
    """``make_cache`` with row ``t`` holding the old row ``sources[t]``."""
    return make_cache()[:, :, sources, :]


@pytest.mark.parametrize(
    ("start", "accepted", "sources"),
    [
        # accepted [0, 2, 5]: start+2 -> start+1, start+5 -> start+2; the root row and the rest stay.
        (2, [0, 2, 5], [0, 1, 2, 4, 7, 5, 6, 7, 8]),
        (0, [0], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        (3, [0], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        (1, [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        (1, [0, 2, 4, 6], [0, 1, 3, 5, 7, 5, 6, 7, 8]),
        (0, [0, 1, 4, 5, 8], [0, 1, 4, 5, 8, 5, 6, 7, 8]),
        (4, [0, 3], [0, 1, 2, 3, 4, 7, 6, 7, 8]),
    ],
)
@pytest.mark.parametrize("as_tensor", [False, True])  # a host list skips the rows already in place
def test_compact_rows(start, accepted, sources, as_tensor):
    cache = make_cache()
    compact_rows(cache, start, torch.tensor(accepted) if as_tensor else accepted)
    assert torch.equal(cache, expected_cache(sources))


def test_compact_rows_literal_values():
    cache = torch.arange(8.0).view(1, 1, 8, 1)
    compact_rows(cache, 1, torch.tensor([0, 2, 3, 6]))
    assert cache.flatten().tolist() == [0.0, 1.0, 3.0, 4.0, 7.0, 5.0, 6.0, 7.0]


def test_compact_rows_other_dim_and_dtype():
    cache = torch.arange(6 * 2, dtype=torch.bfloat16).view(6, 2)  # sequence on dim 0
    compact_rows(cache, 1, [0, 3], dim=0)
    assert cache.tolist() == [[0, 1], [2, 3], [8, 9], [6, 7], [8, 9], [10, 11]]
    cache = make_cache().permute(0, 2, 1, 3).contiguous()  # [2, seq, 3, 4], sequence on dim 1
    compact_rows(cache, 2, np.array([0, 2, 5]), dim=1)
    assert torch.equal(cache, expected_cache([0, 1, 2, 4, 7, 5, 6, 7, 8]).permute(0, 2, 1, 3))


def test_compact_rows_rejects_2d_accepted():
    with pytest.raises(ValueError, match="1-D"):
        compact_rows(make_cache(), 0, [[0, 1]])
