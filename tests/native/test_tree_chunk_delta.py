"""The chunked tree delta rule (native.tree_chunk_delta) against the row walk's torch reference
(splitspec.models.delta_rule.gated_delta_tree) under Triton's interpreter, and the dispatch of a
tree pass's outputs (delta_rule.tree_outputs) between it and the walk (the chunked form only with
SPLITSPEC_NATIVE_ON=tree_chunk_delta)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitspec.models import delta_rule
from splitspec.models.delta_rule import batch_parents, chain_parents, gated_delta_tree, l2_normalize, reloaded_rows

pytest.importorskip("triton", reason="triton is not installed")

from native import tree_chunk_delta as chunk  # noqa: E402
from native import tree_delta_rule as walk  # noqa: E402

HEADS, KEY_HEADS, DK, DV = 4, 2, 6, 12  # value heads read key head h // 2; DK, DV not powers of two


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")


def parents_of(kind: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    """``[n]`` row parents: a chain, a root with n - 1 children, a tree whose rows mostly continue
    the previous one, or random rows (some starting again from the state before the block)."""
    if kind == "chain":
        return chain_parents(n)
    if kind == "wide":
        return torch.tensor([-1] + [0] * (n - 1))
    if kind == "deep":
        return torch.tensor([-1] + [t - 1 if rng.random() < 0.7 else int(rng.integers(0, t)) for t in range(1, n)])
    return torch.tensor([-1] + [int(rng.integers(-1, t)) for t in range(1, n)])


def inputs(gen: torch.Generator, n: int, dtype=torch.float32):
    """q, k in key heads (normalised, q scaled), v with rows apart (sliced as from the conv
    output), g <= 0, beta in (0, 1)."""
    q = l2_normalize(torch.randn(n, KEY_HEADS, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(n, KEY_HEADS, DK, generator=gen))
    v = torch.randn(n, 3 + HEADS * DV, generator=gen)[:, 3:].view(n, HEADS, DV)
    g = -2 * torch.rand(n, HEADS, generator=gen)
    beta = torch.rand(n, HEADS, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def reference(q, k, v, g, beta, state, parents, state_index=None):
    """The row walk in torch (value heads repeat their key heads)."""
    group = HEADS // KEY_HEADS
    out, _ = gated_delta_tree(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta, state, parents,
                              state.dtype, state_index)
    return out


@pytest.mark.parametrize("kind", ["chain", "wide", "deep", "random"])
@pytest.mark.parametrize("rows, max_rows", [(2, 2), (9, 9), (23, 23), (17, 40), (64, 64)])
def test_one_sequence_matches_the_walk(kind, rows, max_rows):
    seed = 10 * ["chain", "wide", "deep", "random"].index(kind) + rows
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    parents = parents_of(kind, rows, rng)
    q, k, v, g, beta = inputs(gen, rows)
    state = torch.randn(HEADS, DK, DV, generator=gen)
    out = chunk.tree_chunk_delta(q, k, v, g, beta, state, parents, max_rows, block_v=16 if rows % 2 else None)
    assert out.dtype == torch.float32 and out.shape == (rows, HEADS, DV)
    torch.testing.assert_close(out, reference(q, k, v, g, beta, state, parents), atol=2e-6, rtol=2e-5)


def test_batched_sequences_read_their_slots_and_padding_stays_zero():
    """Sequences of 4, 1, 0, 23 and 7 rows from slots of a state table, then padding rows of no
    sequence: each sequence's rows as alone, the padding rows 0."""
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    blocks = [parents_of("chain", 4, rng), chain_parents(1), torch.zeros(0, dtype=torch.long),
              parents_of("deep", 23, rng), parents_of("random", 7, rng)]
    parents, offsets = batch_parents(blocks)
    pad = 5
    parents = torch.cat([parents, torch.full((pad,), -1)])
    n = parents.shape[0]
    q, k, v, g, beta = inputs(gen, n)
    table = torch.randn(9, HEADS, DK, DV, generator=gen)
    slots = torch.tensor([6, 0, 2, 8, 3])
    out = chunk.tree_chunk_delta(q, k, v, g, beta, table, parents, 23, offsets, state_index=slots)
    for s, (begin, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if begin == end:
            continue
        rows = slice(begin, end)
        alone = reference(q[rows], k[rows], v[rows], g[rows], beta[rows], table[slots[s]], blocks[s])
        torch.testing.assert_close(out[rows], alone, atol=2e-6, rtol=2e-5)
    assert (out[n - pad :] == 0).all()


def test_offsets_derived_from_parents_when_not_given():
    rng, gen = np.random.default_rng(4), torch.Generator().manual_seed(4)
    parents, offsets = batch_parents([parents_of("wide", 5, rng), parents_of("deep", 11, rng)])
    q, k, v, g, beta = inputs(gen, parents.shape[0])
    states = torch.randn(2, HEADS, DK, DV, generator=gen)
    given = chunk.tree_chunk_delta(q, k, v, g, beta, states, parents, 11, offsets)
    derived = chunk.tree_chunk_delta(q, k, v, g, beta, states, parents, 11)
    assert torch.equal(given, derived)


def test_repeated_keys_stay_as_accurate_as_float32_allows():
    """A chain of one key repeated, beta near 1, almost no decay: (I + L)^{-1} as a power series of
    L would add and cancel terms up to C(31, 15) ~ 3e8; block doubling stays within float32 noise of
    the float64 walk."""
    n = 32
    k = l2_normalize(torch.ones(n, KEY_HEADS, DK))
    q = k * DK**-0.5
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(n, HEADS, DV, generator=gen)
    g, beta = torch.full((n, HEADS), -1e-3), torch.full((n, HEADS), 0.99)
    state = torch.randn(HEADS, DK, DV, generator=gen)
    parents = chain_parents(n)
    exact = reference(*(x.double() for x in (q, k, v, g, beta, state)), parents)
    out = chunk.tree_chunk_delta(q, k, v, g, beta, state, parents, n)
    assert (out.double() - exact).abs().max().item() < 1e-5 * exact.abs().max().item()


def test_max_rows_out_of_range_is_refused():
    gen = torch.Generator().manual_seed(6)
    q, k, v, g, beta = inputs(gen, 3)
    state = torch.zeros(HEADS, DK, DV)
    with pytest.raises(ValueError, match="max_rows 65 is outside 1..64"):
        chunk.tree_chunk_delta(q, k, v, g, beta, state, chain_parents(3), 65)


def _counting(monkeypatch) -> dict:
    calls = {"chunk": 0, "walk": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(chunk, "tree_chunk_delta", counted("chunk", chunk.tree_chunk_delta))
    monkeypatch.setattr(walk, "tree_gated_delta", counted("walk", walk.tree_gated_delta))
    return calls


ON = "tree_chunk_delta"


@pytest.mark.parametrize(
    "store_dtype, max_rows, on, off, expected",
    [
        (torch.float32, 9, ON, "", "chunk"),
        (torch.float32, 9, "", "", "walk"),  # off unless asked for
        (torch.bfloat16, 9, ON, "", "walk"),  # the walk rounds each row's state to the storage dtype
        (torch.float32, 1, ON, "", "walk"),  # a decode step: one row
        (torch.float32, 65, ON, "", "walk"),  # past MAX_ROWS
        (torch.float32, 9, ON, ON, "walk"),  # SPLITSPEC_NATIVE_OFF wins
    ],
)
def test_tree_outputs_dispatch(monkeypatch, store_dtype, max_rows, on, off, expected):
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", on)
    monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", off)
    calls = _counting(monkeypatch)
    rng, gen = np.random.default_rng(7), torch.Generator().manual_seed(7)
    parents = parents_of("deep", 9, rng)
    q, k, v, g, beta = inputs(gen, 9)
    state = torch.randn(1, HEADS, DK, DV, generator=gen).to(store_dtype)
    offsets = torch.tensor([0, 9])
    out = delta_rule.tree_outputs(q, k, v, g, beta, state, parents, store_dtype, offsets, max_rows=max_rows,
                                  state_index=torch.tensor([0]), keep=reloaded_rows(parents))
    assert calls == {"chunk": int(expected == "chunk"), "walk": int(expected == "walk")}
    ref = reference(q, k, v, g, beta, state[0].float(), parents)
    tolerance = 1e-3 if store_dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kind", ["deep", "random"])
def test_bfloat16_inputs_take_exact_products(kind):
    """bf16 q, k and v (as a served pass hands them over) and a float32 state: the bf16 dots and
    the state's three bf16 parts give the float64 walk's outputs to float32 accuracy."""
    rng, gen = np.random.default_rng(8), torch.Generator().manual_seed(8)
    parents = parents_of(kind, 23, rng)
    q, k, v, g, beta = inputs(gen, 23)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    state = torch.randn(HEADS, DK, DV, generator=gen)
    exact = reference(*(x.double() for x in (q, k, v, g, beta, state)), parents)
    out = chunk.tree_chunk_delta(q, k, v, g, beta, state, parents, 23)
    assert (out.double() - exact).abs().max().item() < 2e-6 * exact.abs().max().item()
