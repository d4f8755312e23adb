"""Tree-aware conv gather and delta rule against sequential processing of each root-to-row path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from splitspec.models.delta_rule import (
    ancestor_table,
    batch_parents,
    chain_parents,
    committed_history,
    conv_silu_reference,
    conv_windows,
    depth_levels,
    gated_delta_chunked,
    gated_delta_tree,
    l2_normalize,
)

H, DK, DV, K, C = 3, 8, 5, 4, 6
F64 = torch.float64


def random_parents(rng: np.random.Generator, n: int) -> torch.Tensor:
    """A random tree block: row 0 continues the committed state, row t hangs below a row < t."""
    return torch.tensor([-1] + [int(rng.integers(0, t)) for t in range(1, n)])


def path_to(parents: torch.Tensor, row: int) -> list[int]:
    """Rows from the block start down to ``row``."""
    path = []
    while row >= 0:
        path.append(row)
        row = int(parents[row])
    return path[::-1]


def batch_blocks(rng: np.random.Generator) -> list[torch.Tensor]:
    """One-sequence parents of the blocks of a batched verify: a chain, a bushy tree, decode steps
    (one row) and a 30-row tree beside them, and a tree with rows restarting from the committed state."""
    return [
        chain_parents(5),
        torch.tensor([-1, 0, 0, 0, 1, 1, 2, 3]),
        chain_parents(1),
        random_parents(rng, 30),
        chain_parents(1),
        torch.tensor([-1, 0, -1, 2, 1, -1]),
    ]


def random_delta_inputs(gen: torch.Generator, n: int):
    q = l2_normalize(torch.randn(n, H, DK, generator=gen, dtype=F64)) * DK**-0.5
    k = l2_normalize(torch.randn(n, H, DK, generator=gen, dtype=F64))
    v = torch.randn(n, H, DV, generator=gen, dtype=F64)
    g = -3 * torch.rand(n, H, generator=gen, dtype=F64)
    beta = torch.rand(n, H, generator=gen, dtype=F64)
    return q, k, v, g, beta


def test_ancestor_table_worked_example():
    table = ancestor_table(torch.tensor([-1, 0, 0, 2]), 4)
    assert table.tolist() == [[-3, -2, -1, 0], [-2, -1, 0, 1], [-2, -1, 0, 2], [-1, 0, 2, 3]]


def test_ancestor_table_two_sequences_worked_example():
    """Sequence 1's virtual rows are -(1 * 3 + i): its own history, whatever sequence 0 holds."""
    table = ancestor_table(torch.tensor([-1, -2, 1]), 4)
    assert table.tolist() == [[-3, -2, -1, 0], [-6, -5, -4, 1], [-5, -4, 1, 2]]


def test_batch_parents_concatenates_blocks():
    parents, offsets = batch_parents([torch.tensor([-1, 0]), torch.tensor([-1]), torch.tensor([-1, 0, -1, 1])])
    assert parents.tolist() == [-1, 0, -2, -3, 3, -3, 4]
    assert offsets.tolist() == [0, 2, 3, 7]


def test_chain_conv_equals_causal_conv1d_over_history():
    gen = torch.Generator().manual_seed(0)
    history, x = torch.randn(K - 1, C, generator=gen, dtype=F64), torch.randn(9, C, generator=gen, dtype=F64)
    weight = torch.randn(C, K, generator=gen, dtype=F64)
    windows = conv_windows(history, x, ancestor_table(chain_parents(9), K))  # [T, K, C]
    ours = (windows * weight.T).sum(1)
    reference = F.conv1d(torch.cat([history, x]).T[None], weight[:, None], groups=C)[0].T  # valid conv over [history | x]
    assert torch.allclose(ours, reference, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_tree_conv_window_is_the_window_of_the_path(seed):
    rng = np.random.default_rng(seed)
    parents = random_parents(rng, 12)
    history, x = torch.randn(K - 1, C, dtype=F64), torch.randn(12, C, dtype=F64)
    windows = conv_windows(history, x, ancestor_table(parents, K))
    for row in range(12):
        sequential = torch.cat([history, x[path_to(parents, row)]])  # inputs along the path, oldest first
        assert torch.equal(windows[row], sequential[-K:])


@pytest.mark.parametrize("width", [2, 4])
def test_batched_conv_windows_equal_each_sequences_own(width):
    """Several sequences in one block: every row's window, conv output and committed history are
    those of the one-sequence call on its own rows and history."""
    rng, gen = np.random.default_rng(width), torch.Generator().manual_seed(width)
    blocks = batch_blocks(rng)
    parents, offsets = batch_parents(blocks)
    histories = torch.randn(len(blocks), width - 1, C, generator=gen, dtype=F64)  # [S, K-1, C]
    x = torch.randn(len(parents), C, generator=gen, dtype=F64)
    weight = torch.randn(C, width, generator=gen, dtype=F64)
    ancestors = ancestor_table(parents, width)
    windows = conv_windows(histories, x, ancestors)  # [T, K, C]
    conv = conv_silu_reference(histories, x, ancestors, weight)  # [T, C]
    for s, block in enumerate(blocks):
        first, rows = int(offsets[s]), slice(offsets[s], offsets[s + 1])
        own = ancestor_table(block, width)
        assert torch.equal(windows[rows], conv_windows(histories[s], x[rows], own))
        assert torch.equal(windows[rows], conv_windows(histories[s : s + 1], x[rows], own))  # [1, K-1, C] = [K-1, C]
        torch.testing.assert_close(conv[rows], conv_silu_reference(histories[s], x[rows], own, weight), atol=1e-12, rtol=0)
        for row in range(len(block)):
            expected = conv_windows(histories[s], x[rows], own[row : row + 1])[0, 1:]
            assert torch.equal(committed_history(histories[s], x, ancestors, first + row), expected)
    # Every sequence's new history at once, from the deepest (here: last) row of each.
    last = offsets[1:] - 1
    each = torch.stack([committed_history(histories[s], x, ancestors, int(last[s])) for s in range(len(blocks))])
    assert torch.equal(conv_windows(histories, x, ancestors[last])[:, 1:], each)


def test_depth_levels_group_rows_by_depth():
    levels = depth_levels(torch.tensor([-1, 0, 0, 1, -1, 4]))
    assert [lv.tolist() for lv in levels] == [[0, 4], [1, 2, 5], [3]]


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_equal_sequential_decoding_of_their_paths(seed):
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    n = 14
    parents = random_parents(rng, n)
    q, k, v, g, beta = random_delta_inputs(gen, n)
    state = torch.randn(H, DK, DV, generator=gen, dtype=F64)
    out, states = gated_delta_tree(q, k, v, g, beta, state, parents, F64)
    for row in range(n):
        s = state
        for r in path_to(parents, row):  # one token at a time, the recurrence written out
            s = s * g[r].exp()[:, None, None]
            s = s + k[r][:, :, None] * ((v[r] - torch.einsum("hk,hkv->hv", k[r], s)) * beta[r][:, None])[:, None, :]
        assert torch.allclose(states[row], s, atol=1e-12)
        assert torch.allclose(out[row], torch.einsum("hk,hkv->hv", q[row], s), atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_batched_tree_rows_equal_per_sequence_calls(dtype):
    """Rows of several sequences in one call start from their own sequence's state: outputs and
    every row's state equal the one-sequence calls, which the test above checks against decoding."""
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    blocks = batch_blocks(rng)
    parents, offsets = batch_parents(blocks)
    q, k, v, g, beta = (x.to(dtype) for x in random_delta_inputs(gen, len(parents)))
    state = torch.randn(len(blocks), H, DK, DV, generator=gen, dtype=F64).to(dtype)  # [S, H, Dk, Dv]
    out, states = gated_delta_tree(q, k, v, g, beta, state, parents, dtype)
    tol = 1e-12 if dtype == F64 else 1e-5
    for s, block in enumerate(blocks):
        rows = slice(offsets[s], offsets[s + 1])
        own_out, own_states = gated_delta_tree(q[rows], k[rows], v[rows], g[rows], beta[rows], state[s], block, dtype)
        torch.testing.assert_close(out[rows], own_out, atol=tol, rtol=tol)
        torch.testing.assert_close(states[rows], own_states, atol=tol, rtol=tol)
    # One sequence as [1, H, Dk, Dv] is the [H, Dk, Dv] call.
    one = gated_delta_tree(q[:5], k[:5], v[:5], g[:5], beta[:5], state[:1], blocks[0], dtype)
    for ours, theirs in zip(one, gated_delta_tree(q[:5], k[:5], v[:5], g[:5], beta[:5], state[0], blocks[0], dtype)):
        assert torch.equal(ours, theirs)


def test_stored_state_dtype_rounds_between_tokens_like_sequential_steps():
    """With bfloat16 storage a tree row reads its parent's rounded state, as a decode step would."""
    rng, gen = np.random.default_rng(7), torch.Generator().manual_seed(7)
    n = 10
    parents = random_parents(rng, n)
    q, k, v, g, beta = (x.float() for x in random_delta_inputs(gen, n))
    state = torch.randn(H, DK, DV, generator=gen).to(torch.bfloat16)
    out, states = gated_delta_tree(q, k, v, g, beta, state, parents, torch.bfloat16)
    assert states.dtype == torch.bfloat16
    for row in range(n):
        s = state
        for r in path_to(parents, row):
            step_out, step_states = gated_delta_tree(q[r : r + 1], k[r : r + 1], v[r : r + 1], g[r : r + 1], beta[r : r + 1], s, chain_parents(1), torch.bfloat16)
            s = step_states[0]
        assert torch.equal(states[row], s)
        assert torch.allclose(out[row], step_out[0], atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, 100])
def test_chunked_form_equals_recurrent_form(chunk):
    gen = torch.Generator().manual_seed(chunk)
    n = 70
    q, k, v, g, beta = random_delta_inputs(gen, n)
    state = torch.randn(H, DK, DV, generator=gen, dtype=F64)
    out, states = gated_delta_tree(q, k, v, g, beta, state, chain_parents(n), F64)
    chunked, final = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    assert torch.allclose(chunked, out, atol=1e-12)
    assert torch.allclose(final, states[-1], atol=1e-12)


def test_recurrent_form_matches_transformers_reference():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(11)
    n = 9
    q, k, v, g, beta = random_delta_inputs(gen, n)
    state = torch.randn(H, DK, DV, generator=gen, dtype=F64)
    out, states = gated_delta_tree(q, k, v, g, beta, state, chain_parents(n), F64)
    # The reference normalises and scales q itself, and runs in float32.
    ref_out, ref_state = modeling.torch_recurrent_gated_delta_rule(
        l2_normalize(q)[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True
    )
    assert torch.allclose(out, ref_out[0].double(), atol=1e-5)
    assert torch.allclose(states[-1], ref_state[0].double(), atol=1e-5)
