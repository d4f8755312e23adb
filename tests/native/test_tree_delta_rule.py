"""The Triton tree conv and tree delta rule (native.tree_delta_rule) against their torch
references in splitspec.models.delta_rule, run on the CPU by Triton's interpreter; and a tiny
Qwen3.5 target verifying a tree with the kernels against the same target on the torch path.

Triton picks the interpreter when a kernel is *defined*, so Triton and the kernel module are
imported with ``TRITON_INTERPRET=1`` set and the variable is restored right after; an autouse
fixture sets it again around each test here. Other test modules keep the torch path.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

from splitspec.models import delta_rule
from splitspec.models.delta_rule import (
    ancestor_table,
    batch_parents,
    chain_parents,
    conv_silu_reference,
    gated_delta_tree,
    l2_normalize,
)
from splitspec.models.loader import load_target
from splitspec.spec.tree import node_depths, tree_attention_mask


def _import_interpreted_kernels():
    """Import Triton and the kernels with the interpreter on, then restore ``TRITON_INTERPRET``.
    Triton's own helpers (``tl.sum``, ``tl.sigmoid``) are kernels too, so Triton itself must be
    first imported here (or under ``TRITON_INTERPRET=1``)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
        module = importlib.import_module("native.tree_delta_rule")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    from triton.runtime.interpreter import InterpretedFunction

    if not all(isinstance(fn, InterpretedFunction) for fn in (triton.language.sum, module._tree_delta_kernel)):
        pytest.skip("Triton was imported for a GPU before this module; run it with TRITON_INTERPRET=1", allow_module_level=True)
    return module


native = _import_interpreted_kernels()


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """Triton also consults the variable while running a kernel, so it is on during every test here,
    and the kernels run on the CPU (native.use_triton)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")


H, DK, DV = 2, 6, 12  # DK, DV not powers of two and BLOCK_V = 8 < DV: the masks and the Dv tiles are exercised
BLOCK_V = 8


def tree_parents(kind: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    """``[n]`` parents of a block: a chain, a root with n-1 children, a deep tree whose rows mostly
    continue the previous row, or random rows (some restarting from the committed state)."""
    if kind == "chain":
        return chain_parents(n)
    if kind == "wide":
        return torch.tensor([-1] + [0] * (n - 1))
    if kind == "deep":
        return torch.tensor([-1] + [t - 1 if rng.random() < 0.7 else int(rng.integers(0, t)) for t in range(1, n)])
    return torch.tensor([-1] + [int(rng.integers(-1, t)) for t in range(1, n)])


def batch_blocks(rng: np.random.Generator) -> list[torch.Tensor]:
    """One-sequence parents of a batched verify: a chain, a bushy tree, single-row decode steps, a
    30-row tree beside a 1-row one, and random rows restarting from the committed state."""
    return [
        tree_parents("chain", 4, rng),
        tree_parents("wide", 6, rng),
        chain_parents(1),
        tree_parents("deep", 30, rng),
        chain_parents(1),
        tree_parents("random", 7, rng),
    ]


def assert_delta_close(out, states, ref_out, ref_states, store_dtype):
    """The kernel's outputs and stored states against torch's, for the state's storage dtype."""
    if store_dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    else:
        # Rows continue from the *rounded* state, as in torch: nearly every stored element has the
        # same bits (a float32 rounding difference may flip one); without that rounding most differ.
        assert (states == ref_states).float().mean().item() > 0.99
        torch.testing.assert_close(states.float(), ref_states.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out, ref_out, atol=1e-3, rtol=1e-3)


def delta_inputs(gen: torch.Generator, n: int):
    """Inputs as GatedDeltaNet hands them over: q, k normalised (q scaled), g <= 0, beta in (0, 1)."""
    q = l2_normalize(torch.randn(n, H, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(n, H, DK, generator=gen))
    v = torch.randn(n, 3 + H * DV, generator=gen)[:, 3:].view(n, H, DV)  # rows apart, as v sliced from the conv output
    g = -2 * torch.rand(n, H, generator=gen)
    beta = torch.rand(n, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("store_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("committed", [True, False], ids=["committed", "zero-state"])
@pytest.mark.parametrize("kind", ["chain", "wide", "deep", "random"])
def test_tree_delta_rule_matches_torch(kind, committed, store_dtype):
    seed = ["chain", "wide", "deep", "random"].index(kind)
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    n = 9
    parents = tree_parents(kind, n, rng)
    q, k, v, g, beta = delta_inputs(gen, n)
    state = (torch.randn(H, DK, DV, generator=gen) if committed else torch.zeros(H, DK, DV)).to(store_dtype)
    out, states = native.tree_gated_delta(q, k, v, g, beta, state, parents, store_dtype, block_v=BLOCK_V)
    ref_out, ref_states = gated_delta_tree(q, k, v, g, beta, state, parents, store_dtype)
    assert out.dtype == torch.float32 and states.dtype == store_dtype
    assert out.shape == ref_out.shape and states.shape == ref_states.shape
    assert_delta_close(out, states, ref_out, ref_states, store_dtype)


def test_key_heads_are_read_by_their_value_heads():
    """q and k in key heads (GatedDeltaNet's layout, value head h reading key head h // group): the
    kernel equals itself on the repeated heads, and the dispatch's torch path repeats them."""
    rng, gen = np.random.default_rng(5), torch.Generator().manual_seed(5)
    n, group = 9, 3
    parents = tree_parents("random", n, rng)
    q, k, _, _, _ = delta_inputs(gen, n)  # H key heads
    v = torch.randn(n, H * group, DV, generator=gen)
    g, beta = -2 * torch.rand(n, H * group, generator=gen), torch.rand(n, H * group, generator=gen)
    state = torch.randn(H * group, DK, DV, generator=gen)
    grouped = native.tree_gated_delta(q, k, v, g, beta, state, parents, torch.float32, block_v=BLOCK_V)
    repeated = native.tree_gated_delta(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta, state, parents,
                                       torch.float32, block_v=BLOCK_V)
    assert all(torch.equal(a, b) for a, b in zip(grouped, repeated))
    reference = delta_rule.gated_delta(q, k, v, g, beta, state, parents, torch.float32)  # SPLITSPEC_NATIVE_CPU=1: the kernel
    assert all(torch.equal(a, b) for a, b in zip(grouped, reference))
    torch_path = gated_delta_tree(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta, state, parents, torch.float32)
    assert_delta_close(*grouped, *torch_path, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        native.tree_gated_delta(q, k, v[:, :5], g[:, :5], beta[:, :5], state[:5], parents, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("kind", ["chain", "wide", "random"])
def test_tree_conv_silu_matches_torch(kind, width, dtype):
    rng, gen = np.random.default_rng(width), torch.Generator().manual_seed(width)
    n, channels = 7, 20  # block_c 8: three channel blocks, the last one masked
    ancestors = ancestor_table(tree_parents(kind, n, rng), width)
    history = torch.randn(width - 1, channels, generator=gen).to(dtype)
    inputs = torch.randn(n, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    out = native.tree_conv_silu(history, inputs, ancestors, weight, block_c=8)
    ref = conv_silu_reference(history, inputs, ancestors, weight)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # torch rounds the bfloat16 products, the kernel adds in float32
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("given_offsets", "store_dtype"),
    [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)],
    ids=["offsets-f32-state", "offsets-bf16-state", "derived-offsets-f32-state"],
)
def test_batched_tree_delta_rule_equals_per_sequence_calls(given_offsets, store_dtype):
    """One launch over six sequences (a program per sequence, head and tile) gives every row what
    the one-sequence launch on its own rows and state gives, and what the torch path gives."""
    rng, gen = np.random.default_rng(10), torch.Generator().manual_seed(10)
    blocks = batch_blocks(rng)
    parents, offsets = batch_parents(blocks)
    q, k, v, g, beta = delta_inputs(gen, len(parents))
    state = torch.randn(len(blocks), H, DK, DV, generator=gen).to(store_dtype)  # [S, H, Dk, Dv]
    out, states = native.tree_gated_delta(
        q, k, v, g, beta, state, parents, store_dtype, offsets if given_offsets else None, block_v=BLOCK_V
    )
    assert_delta_close(out, states, *gated_delta_tree(q, k, v, g, beta, state, parents, store_dtype), store_dtype)
    for s, block in enumerate(blocks):
        rows = slice(offsets[s], offsets[s + 1])
        own = native.tree_gated_delta(q[rows], k[rows], v[rows], g[rows], beta[rows], state[s], block, store_dtype, block_v=BLOCK_V)
        assert_delta_close(out[rows], states[rows], *own, store_dtype)


def test_one_sequence_through_offsets_equals_the_plain_launch():
    """``[1, H, Dk, Dv]`` with offsets ``[0, T]`` (the ragged walk) is the ``[H, Dk, Dv]`` launch."""
    rng, gen = np.random.default_rng(11), torch.Generator().manual_seed(11)
    parents = tree_parents("random", 9, rng)
    q, k, v, g, beta = delta_inputs(gen, 9)
    state = torch.randn(H, DK, DV, generator=gen)
    plain = native.tree_gated_delta(q, k, v, g, beta, state, parents, torch.float32, block_v=BLOCK_V)
    ragged = native.tree_gated_delta(q, k, v, g, beta, state[None], parents, torch.float32, torch.tensor([0, 9]), block_v=BLOCK_V)
    for ours, theirs in zip(ragged, plain):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("given_offsets", [True, False], ids=["offsets", "derived-offsets"])
def test_a_sequence_without_rows_runs_nothing(given_offsets):
    rng, gen = np.random.default_rng(12), torch.Generator().manual_seed(12)
    blocks = [tree_parents("deep", 5, rng), torch.zeros(0, dtype=torch.int64), tree_parents("wide", 4, rng)]
    parents, offsets = batch_parents(blocks)
    assert offsets.tolist() == [0, 5, 5, 9]
    q, k, v, g, beta = delta_inputs(gen, 9)
    state = torch.randn(3, H, DK, DV, generator=gen)
    out, states = native.tree_gated_delta(q, k, v, g, beta, state, parents, torch.float32, offsets if given_offsets else None, block_v=BLOCK_V)
    assert_delta_close(out, states, *gated_delta_tree(q, k, v, g, beta, state, parents, torch.float32), torch.float32)


@pytest.mark.parametrize(
    ("width", "dtype"), [(2, torch.float32), (4, torch.float32), (4, torch.bfloat16)], ids=["2-f32", "4-f32", "4-bf16"]
)
def test_batched_tree_conv_silu_equals_per_sequence_calls(width, dtype):
    """Each row's window runs through its own sequence's history in ``[S, K-1, C]``."""
    rng, gen = np.random.default_rng(width), torch.Generator().manual_seed(width)
    blocks = batch_blocks(rng)
    parents, offsets = batch_parents(blocks)
    channels = 20
    ancestors = ancestor_table(parents, width)
    history = torch.randn(len(blocks), width - 1, channels, generator=gen).to(dtype)  # [S, K-1, C]
    inputs = torch.randn(len(parents), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    out = native.tree_conv_silu(history, inputs, ancestors, weight, block_c=8)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # as test_tree_conv_silu_matches_torch
    torch.testing.assert_close(out.float(), conv_silu_reference(history, inputs, ancestors, weight).float(), atol=tol, rtol=tol)
    for s, block in enumerate(blocks):
        rows = slice(offsets[s], offsets[s + 1])
        own = native.tree_conv_silu(history[s], inputs[rows], ancestor_table(block, width), weight, block_c=8)
        torch.testing.assert_close(out[rows], own, atol=tol, rtol=tol)


@pytest.mark.parametrize("dispatch", ["kernel", "torch"])
def test_tree_conv_keeps_inputs_and_values_from_strided_rows(dispatch, monkeypatch):
    """Inputs sliced from a wider projection output (rows apart), as a tree pass hands them over:
    the same output as from a packed copy, and ``keep`` gets the inputs and the output's last
    channels (the values), on the kernel and on the torch path alike."""
    if dispatch == "torch":
        monkeypatch.delenv("SPLITSPEC_NATIVE_CPU")
    gen = torch.Generator().manual_seed(21)
    parents, _ = batch_parents([tree_parents("deep", 7, np.random.default_rng(2)), chain_parents(3)])
    channels, width, values = 20, 4, 8
    projected = torch.randn(len(parents), channels + 5, generator=gen)  # [T, C + 5]: inputs are its first C columns
    inputs = projected[:, :channels]
    history = torch.randn(2, width - 1, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    ancestors = ancestor_table(parents, width)
    keep = (torch.full((len(parents), channels), float("nan")), torch.full((len(parents), values), float("nan")))
    out = delta_rule.conv_silu(history, inputs, ancestors, weight, keep)
    ref = conv_silu_reference(history, inputs.contiguous(), ancestors, weight)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(keep[0], inputs)
    assert torch.equal(keep[1], out[:, channels - values:])


@pytest.mark.parametrize("dispatch", ["kernel", "torch"])
@pytest.mark.parametrize("sequences", [1, 3], ids=["one-sequence", "three-sequences"])
def test_tree_conv_reads_histories_in_place(sequences, dispatch, monkeypatch):
    """``history_index`` picks each sequence's history out of a table (a layer's state slots), as
    the tree pass hands them over: the same output as from the gathered histories, bit for bit."""
    if dispatch == "torch":
        monkeypatch.delenv("SPLITSPEC_NATIVE_CPU")
    rng, gen = np.random.default_rng(31), torch.Generator().manual_seed(31)
    blocks = [tree_parents("deep", 6, rng), chain_parents(1), tree_parents("random", 5, rng)][:sequences]
    parents, _ = batch_parents(blocks)
    channels, width = 20, 4
    ancestors = ancestor_table(parents, width)
    table = torch.randn(5, width - 1, channels, generator=gen)  # [slots, K-1, C]
    index = torch.tensor([3, 0, 4][:sequences])
    inputs = torch.randn(len(parents), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    in_place = delta_rule.conv_silu(table, inputs, ancestors, weight, history_index=index)
    gathered = delta_rule.conv_silu(table[index] if sequences > 1 else table[index[0]], inputs, ancestors, weight)
    assert torch.equal(in_place, gathered)
    torch.testing.assert_close(in_place, conv_silu_reference(table[index], inputs, ancestors, weight), atol=1e-5, rtol=1e-5)


def test_tree_delta_rule_writes_zeros_to_rows_of_no_sequence(monkeypatch):
    """Rows past ``offsets[S]`` (a fixed-shape pass's padding) feed the rest of the pass: the kernel
    writes them zeros itself (the output it is given is not cleared: poisoned here)."""
    real_empty = torch.empty
    monkeypatch.setattr(native.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    rng, gen = np.random.default_rng(32), torch.Generator().manual_seed(32)
    blocks = [tree_parents("deep", 5, rng), tree_parents("wide", 4, rng)]
    parents, offsets = batch_parents(blocks)
    padded = torch.cat([parents, torch.tensor([-1, 0, -1])])  # three pad rows, as a pad row reads sequence 0
    q, k, v, g, beta = delta_inputs(gen, len(padded))
    state = torch.randn(2, H, DK, DV, generator=gen)
    out, _ = native.tree_gated_delta(q, k, v, g, beta, state, padded, torch.float32, offsets, block_v=BLOCK_V)
    n = len(parents)
    assert torch.equal(out[n:], torch.zeros(3, H, DV))
    ref_out, _ = gated_delta_tree(q[:n], k[:n], v[:n], g[:n], beta[:n], state, parents, torch.float32)
    torch.testing.assert_close(out[:n], ref_out, atol=1e-5, rtol=1e-5)


def test_tree_conv_refuses_keep_buffers_that_do_not_fit():
    inputs = torch.randn(3, 12)
    with pytest.raises(ValueError, match="keep"):
        native.tree_conv_silu(torch.zeros(3, 12), inputs, ancestor_table(chain_parents(3), 4), torch.randn(12, 4),
                              keep=(torch.empty(3, 12), torch.empty(3, 13)))


def test_dispatch_runs_batches_on_the_kernels(monkeypatch):
    """delta_rule.conv_silu and gated_delta hand ``[S, ...]`` histories, states and offsets to the kernels."""
    rng, gen = np.random.default_rng(13), torch.Generator().manual_seed(13)
    blocks = batch_blocks(rng)
    parents, offsets = batch_parents(blocks)
    calls = []

    def counted(name):
        kernel = getattr(native, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)
        return wrapper

    for name in ("tree_conv_silu", "tree_gated_delta"):
        monkeypatch.setattr(native, name, counted(name))
    channels, width = 9, 4
    ancestors = ancestor_table(parents, width)
    history = torch.randn(len(blocks), width - 1, channels, generator=gen)
    inputs, weight = torch.randn(len(parents), channels, generator=gen), torch.randn(channels, width, generator=gen)
    conv = delta_rule.conv_silu(history, inputs, ancestors, weight)
    torch.testing.assert_close(conv, conv_silu_reference(history, inputs, ancestors, weight), atol=1e-5, rtol=1e-5)
    q, k, v, g, beta = delta_inputs(gen, len(parents))
    state = torch.randn(len(blocks), H, DK, DV, generator=gen)
    ours = delta_rule.gated_delta(q, k, v, g, beta, state, parents, torch.float32, offsets)
    assert_delta_close(*ours, *gated_delta_tree(q, k, v, g, beta, state, parents, torch.float32), torch.float32)
    assert calls == ["tree_conv_silu", "tree_gated_delta"]


def test_shape_mismatch_names_the_tensor():
    q, k, v, g, beta = delta_inputs(torch.Generator().manual_seed(0), 3)
    with pytest.raises(ValueError, match="beta has shape"):
        native.tree_gated_delta(q, k, v, g, beta[:2], torch.zeros(H, DK, DV), chain_parents(3), torch.float32)
    with pytest.raises(ValueError, match="offsets has shape"):
        native.tree_gated_delta(q, k, v, g, beta, torch.zeros(2, H, DK, DV), chain_parents(3), torch.float32, torch.tensor([0, 3]))


def test_dispatch_uses_the_kernels_on_cuda_or_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("SPLITSPEC_NATIVE_CPU")
    assert not delta_rule.native_kernels_for(torch.zeros(1))
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    assert delta_rule.native_kernels_for(torch.zeros(1))
    assert delta_rule.native_kernels_for(torch.zeros(1, dtype=torch.bfloat16))
    assert not delta_rule.native_kernels_for(torch.zeros(1, dtype=torch.float64))  # float64 math stays on torch


# A verify block: root row 0 and seven nodes in three branches; rows 0 -> 1 -> 3 -> 5 are accepted.
TREE_NODE_PARENTS = np.array([0, 0, 1, 1, 3, 2, 6])  # parent row of node i + 1 (0 = root)
ACCEPTED = [0, 1, 3, 5]


def _prefill_verify_commit(model, prompt: torch.Tensor, nodes: torch.Tensor):
    """Prefill, verify the tree, commit ``ACCEPTED``, decode one more token: logits of each pass and the cache."""
    n, rows = len(prompt), len(nodes) + 1
    cache = model.new_cache(n + rows + 1, "cpu", torch.float32)
    prefill, _ = model(prompt, torch.arange(n), cache, 0, torch.tril(torch.ones(n, n, dtype=torch.bool)))
    row_parents = torch.from_numpy(np.concatenate([[-1], TREE_NODE_PARENTS])).long()
    positions = n + torch.from_numpy(np.concatenate([[0], node_depths(TREE_NODE_PARENTS)])).long()
    mask = torch.cat([torch.ones(rows, n, dtype=torch.bool), torch.from_numpy(tree_attention_mask(TREE_NODE_PARENTS))], dim=1)
    ids = torch.cat([prompt[-1:], nodes])
    verify, _ = model(ids, positions, cache, n, mask, parents=row_parents)
    cache.commit(n, ACCEPTED)
    length = n + len(ACCEPTED)
    step, _ = model(nodes[:1], torch.tensor([length]), cache, length, torch.ones(1, length + 1, dtype=torch.bool))
    return prefill, verify, step, cache


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_tiny_qwen35_verifies_a_tree_alike_on_kernels_and_torch(tiny_qwen35_pair, monkeypatch, state_dtype):
    model, config = load_target(tiny_qwen35_pair.target, dtype=torch.float32, state_dtype=state_dtype)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, config.vocab_size, (5,), generator=gen)
    nodes = torch.randint(0, config.vocab_size, (len(TREE_NODE_PARENTS),), generator=gen)

    monkeypatch.delenv("SPLITSPEC_NATIVE_CPU")  # the torch path
    torch_passes = _prefill_verify_commit(model, prompt, nodes)

    calls = {"conv": 0, "delta": 0}  # count the kernel launches, to know the kernel path really ran

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(native, "tree_conv_silu", counted("conv", native.tree_conv_silu))
    monkeypatch.setattr(native, "tree_gated_delta", counted("delta", native.tree_gated_delta))
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    kernel_passes = _prefill_verify_commit(model, prompt, nodes)

    linear = config.num_linear_layers
    assert calls == {"conv": 3 * linear, "delta": 2 * linear}  # conv: every pass; delta: verify and decode (prefill is chunked)
    for ours, ref in zip(kernel_passes[:3], torch_passes[:3]):  # prefill, verify and decode logits
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    ours, ref = kernel_passes[3], torch_passes[3]
    assert ours.recurrent.dtype == ref.recurrent.dtype == state_dtype
    torch.testing.assert_close(ours.conv, ref.conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.recurrent.float(), ref.recurrent.float(), atol=1e-4, rtol=1e-4)
