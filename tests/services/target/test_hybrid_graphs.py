"""The hybrid (Qwen3.5) target on the fast path: its fixed-shape passes against its exact-shape
eager ones, in float32.

A fixed-shape pass pads rows and sequences to buckets so that it can be captured as a CUDA graph.
For the hybrid that needs three things on top of the dense target's (tests/services/target/test_graphs.py):
padding must leave every sequence's recurrent state alone, the pass must read no tensor value on
the host, and what a tree pass keeps until the commit must sit in buffers of fixed address. The
commit recomputes the accepted path's state from the rows' kept inputs instead of keeping every
row's state; it must give what the tree pass computed for that row. On the CPU the fixed shapes
run without capture, on the torch delta rule and on the Triton kernels (Triton's interpreter).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.target.engine import TargetEngine, TargetLimits, VerifyStep, _work
from splitspec.models import delta_rule
from splitspec.models.delta_rule import (
    batch_parents,
    chain_parents,
    gated_delta_tree,
    l2_normalize,
    path_gated_delta_reference,
    reloaded_rows,
)
from splitspec.models.loader import load_target
from splitspec.models.paged import PassInputs, pass_layout
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree, tree_attention_mask

GREEDY = SamplingParams()
LENGTHS = (3, 17, 40, 90, 9)  # prompts: one chunk each, 90 padded from 90 to 128 rows
ATOL = 2e-5  # float32: a padded pass runs other matrix shapes than the exact one


@pytest.fixture(scope="module")
def model(tiny_qwen35_pair):
    model, _ = load_target(tiny_qwen35_pair.target, dtype=torch.float32)
    return model


# Under the interpreter only the DeltaNet kernels run: the others have their own tests, and
# interpreting every kernel of every pass would take minutes.
OTHER_KERNELS = "rms_norm,silu_mul,tree_attention,paged_attention,qkv_rope,chunked_delta_rule"


@pytest.fixture(params=["torch", "kernels"])
def path(request, monkeypatch):
    """The torch delta rule, or the Triton kernels under the interpreter (as on a GPU)."""
    if request.param == "kernels":
        pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
        monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", OTHER_KERNELS)
    return request.param


def tree_of(rng: np.random.Generator, vocab: int, kind: str) -> tuple[list[int], list[int]]:
    """Nodes and parents of a decode step (no nodes), a chain, or a DDTree of budget 5 or 22."""
    if kind == "decode":
        return [], []
    if kind == "chain":
        n = int(rng.integers(2, 9))
        return rng.integers(0, vocab, n).tolist(), list(range(n))
    ids = np.stack([rng.choice(vocab, 3, replace=False) for _ in range(8)])
    tree = build_ddtree(ids, -np.sort(rng.random((8, 3)) * 3, axis=1), 5 if kind == "small" else 22)
    return tree.tokens.tolist(), tree.parents.tolist()


def tree_pass(engine: TargetEngine, steps: list[tuple[str, list[int], list[int]]]):
    """One verify pass of ``steps`` without the walk: its layout and logits (copied)."""
    items = [_work(i, engine.sequences.get(sid), VerifyStep(sid, tokens, parents)) for i, (sid, tokens, parents) in enumerate(steps)]
    for item in items:
        engine._grow(item.state, item.state.length + len(item.row_tokens))
    layout = pass_layout(
        engine.kv, [w.row_tokens for w in items], [w.rows for w in items], [w.state.length for w in items],
        [w.state.holding.blocks for w in items], [w.tree for w in items], [w.state.holding.slot for w in items],
    )
    logits, _ = engine.runner.run(layout, ())
    return layout, logits.clone()


def root_path(parents: list[int], node: int) -> list[int]:
    """Rows root .. ``node`` (root row 0, node ``j`` row ``j``)."""
    rows = [node]
    while rows[-1]:
        rows.append(parents[rows[-1] - 1])
    return rows[::-1]


def assert_same_states(eager: TargetEngine, fixed: TargetEngine, sid: str) -> None:
    a, b = (e.sequence_cache(e.sequences.get(sid)) for e in (eager, fixed))
    length = eager.sequences.get(sid).length
    assert length == fixed.sequences.get(sid).length
    for name in ("conv", "recurrent"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(a.k[:, :, :length], b.k[:, :, :length], atol=ATOL, rtol=1e-4)


def test_fixed_shape_passes_equal_the_eager_ones(model, path, monkeypatch):
    """Batches of 1 to 5 sequences of mixed lengths, with decode steps, chains and trees (padded
    rows; padded sequences at 3 and 5): the same logits, and after committing the same paths in
    both, the same conv and recurrent states."""
    eager, fixed = TargetEngine(model), TargetEngine(model, fixed_shapes=True)
    assert fixed.runner.fixed_shapes and fixed.state.slots._reserved is not None
    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size
    ids = [f"s{i}" for i in range(len(LENGTHS))]
    with monkeypatch.context() as torch_prefill:  # the interpreter's conv would walk 64+ padded rows a chunk
        torch_prefill.delenv("SPLITSPEC_NATIVE_CPU", raising=False)
        for sid, length in zip(ids, LENGTHS):
            prompt = rng.integers(0, vocab, length).tolist()
            for engine in (eager, fixed):
                engine.prefill(sid, prompt, GREEDY, reserve_tokens=400)
            assert_same_states(eager, fixed, sid)  # padded prompt chunks advanced the state alike
    padded = set()
    for size in (1, 2, 3, 4, 5) if path == "torch" else (1, 3, 5):
        members = sorted(rng.choice(ids, size, replace=False).tolist())
        steps = [(sid, *tree_of(rng, vocab, str(rng.choice(["decode", "chain", "small", "b22"])))) for sid in members]
        (layout, want), (_, got) = tree_pass(eager, steps), tree_pass(fixed, steps)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
        padded.update(key[:2] for key in fixed.runner._passes if not key[-1])
        # Commit a random row's path of every tree (deeper than the random target would accept).
        commits = []
        for s, (sid, _, parents) in enumerate(steps):
            node = int(rng.integers(0, len(parents) + 1))
            commits.append((sid, root_path(parents, node), int(layout.offsets[s]), int(rng.integers(0, vocab))))
        for engine in (eager, fixed):
            engine._commit([(engine.sequences.get(sid), rows, first) for sid, rows, first, _ in commits])
            for sid, _, _, token in commits:
                engine.sequences.get(sid).pending_token = token
        for sid in members:
            assert_same_states(eager, fixed, sid)
    # The passes did pad: rows past the real ones, and sequences to 4 and 8.
    assert {b for _, b in padded} >= {1, 4, 8} and any(n > 23 for n, _ in padded)
    assert fixed.state.slots.read(0)["recurrent"].abs().max() == 0  # the pad slot stays zero


def test_tree_passes_on_the_chunked_kernel_give_the_torch_logits(model, monkeypatch):
    """A fixed-shape pass of three sequences (a budget-22 tree, a chain, a decode step), then a
    second tree pass after committing: the DeltaNet outputs from the chunked tree kernel
    (native.tree_chunk_delta, turned on) give the logits and committed states of the torch walk."""
    from native import tree_chunk_delta

    calls, chunked = [], tree_chunk_delta.tree_chunk_delta
    monkeypatch.setattr(tree_chunk_delta, "tree_chunk_delta", lambda *a, **kw: calls.append(1) or chunked(*a, **kw))
    vocab = model.config.vocab_size
    engines = {}
    for path in ("torch", "kernels"):
        with monkeypatch.context() as m:
            if path == "kernels":
                m.setenv("SPLITSPEC_NATIVE_CPU", "1")
                m.setenv("SPLITSPEC_NATIVE_OFF", OTHER_KERNELS)
                m.setenv("SPLITSPEC_NATIVE_ON", "tree_chunk_delta")
            engine = TargetEngine(model, fixed_shapes=True)
            step_rng = np.random.default_rng(11)
            for sid, length in zip(("a", "b", "c"), (12, 30, 5)):
                with monkeypatch.context() as torch_prefill:
                    torch_prefill.delenv("SPLITSPEC_NATIVE_CPU", raising=False)
                    engine.prefill(sid, step_rng.integers(0, vocab, length).tolist(), GREEDY, reserve_tokens=200)
            results = []
            for kinds in (("b22", "chain", "decode"), ("small", "b22", "chain")):
                steps = [(sid, *tree_of(step_rng, vocab, kind)) for sid, kind in zip(("a", "b", "c"), kinds)]
                layout, logits = tree_pass(engine, steps)
                results.append(logits)
                commits = [(engine.sequences.get(sid), root_path(parents, len(parents)), int(layout.offsets[s]))
                           for s, (sid, _, parents) in enumerate(steps)]
                engine._commit(commits)
                for sid in ("a", "b", "c"):
                    engine.sequences.get(sid).pending_token = int(step_rng.integers(0, vocab))
            engines[path] = (engine, results)
    assert len(calls) == 2 * model.config.num_linear_layers  # the kernel ran every DeltaNet layer of both passes
    (torch_engine, want), (kernel_engine, got) = engines["torch"], engines["kernels"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    for sid in ("a", "b", "c"):
        assert_same_states(torch_engine, kernel_engine, sid)


def test_padding_reads_and_a_tree_pass_writes_no_sequence_state(model):
    """A padded tree pass (3 sequences padded to 4, 23 + 1 + 6 rows padded to 32) leaves every
    state slot as it was and writes K/V only at its rows' own positions and the pad block."""
    fixed = TargetEngine(model, fixed_shapes=True)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    for sid, length in zip("abc", (5, 30, 12)):
        fixed.prefill(sid, rng.integers(0, vocab, length).tolist(), GREEDY, reserve_tokens=200)
    slots = fixed.state.slots
    conv, recurrent = slots.conv.clone(), slots.recurrent.clone()
    caches = {sid: fixed.sequence_cache(fixed.sequences.get(sid)) for sid in "abc"}
    steps = [("a", *tree_of(rng, vocab, "b22")), ("b", [], []), ("c", *tree_of(rng, vocab, "chain"))]
    layout, _ = tree_pass(fixed, steps)
    assert layout.num_sequences == 3 and any(key[:2] == (32, 4) for key in fixed.runner._passes)
    assert torch.equal(slots.conv, conv) and torch.equal(slots.recurrent, recurrent)
    for sid in "abc":
        length = fixed.sequences.get(sid).length
        after = fixed.sequence_cache(fixed.sequences.get(sid))
        assert torch.equal(after.k[:, :, :length], caches[sid].k[:, :, :length])
        assert torch.equal(after.v[:, :, :length], caches[sid].v[:, :, :length])
    assert slots.pending is not None and slots.pending.rows == 32


class HostReads(TorchFunctionMode):
    """Records every torch call that reads a tensor's values on the host (a device sync on a GPU,
    and a capture error inside a CUDA graph), or whose output shape depends on them."""

    READS = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
        torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.nonzero, torch.Tensor.nonzero,
        torch.argwhere, torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
        torch.unique_consecutive, torch.bincount, torch.Tensor.bincount,
    }

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        index = args[1] if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1 else None
        indices = index if isinstance(index, tuple) else (index,)
        if (
            func in self.READS
            or any(isinstance(i, torch.Tensor) and (i.dtype == torch.bool or i.dim() == 0) for i in indices)
            or (func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and len(tensors) > 1)
        ):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def test_a_static_pass_reads_no_tensor_on_the_host(model):
    """The fixed-shape tree pass and prompt chunk call nothing that reads a tensor on the host; the
    eager tree pass's torch delta rule does (it groups rows by depth on the host), which shows
    the check sees such reads."""
    engine = TargetEngine(model)
    rng = np.random.default_rng(2)
    vocab = model.config.vocab_size
    for sid in "ab":
        engine.prefill(sid, rng.integers(0, vocab, 9).tolist(), GREEDY, reserve_tokens=100)
    tokens, parents = tree_of(rng, vocab, "b22")
    items = [_work(0, engine.sequences.get("a"), VerifyStep("a", tokens, parents)), _work(1, engine.sequences.get("b"), VerifyStep("b", [], []))]
    for item in items:
        engine._grow(item.state, item.state.length + len(item.row_tokens))
    layout = pass_layout(
        engine.kv, [w.row_tokens for w in items], [w.rows for w in items], [w.state.length for w in items],
        [w.state.holding.blocks for w in items], [w.tree for w in items], [w.state.holding.slot for w in items],
    )
    chunk = pass_layout(engine.kv, [[5] * 7], [chain_parents(7).numpy()], [0], [engine.sequences.get("b").holding.blocks],
                        [np.tril(np.ones((7, 7), dtype=bool))], [engine.sequences.get("b").holding.slot])

    def reads(layout, shape, static, prompt_chunk=False) -> list[str]:
        host = np.zeros(PassInputs.nbytes(*shape, engine.kv.block_size), dtype=np.uint8)
        inputs = PassInputs.on(torch.from_numpy(host), *shape, engine.kv.block_size, static=static)
        inputs.fill(layout, host, layout.num_rows - 1)
        with HostReads() as mode:
            engine.model.forward_paged(inputs, engine.state, logit_rows=inputs.last_row if prompt_chunk else None, chain=prompt_chunk)
        return mode.reads

    slots = engine.state.slots
    before = slots.recurrent.clone()
    assert reads(layout, (32, 2, 24, 256), static=True) == []
    assert reads(chunk, (64, 1, 64, 256), static=True, prompt_chunk=True) == []
    exact = (layout.num_rows, 2, layout.max_rows, 256)
    assert "tolist" in reads(layout, exact, static=False)
    assert not torch.equal(slots.recurrent, before)  # the prompt chunk did advance b's slot (a real pass ran)


def test_commit_by_recomputation_gives_the_state_the_tree_computed(model, path):
    """For every row of a tree, committing its path from the rows' kept inputs gives the state
    the tree pass itself computed for that row (the sequence-cache forward keeps them all)."""
    rng = np.random.default_rng(4)
    vocab, config = model.config.vocab_size, model.config
    prompt = rng.integers(0, vocab, 11).tolist()
    tokens, parents = tree_of(rng, vocab, "b22")
    rows = np.concatenate([[-1], parents]).astype(np.int64)
    cache = model.new_cache(64, "cpu", torch.float32)
    n = len(prompt)
    model(torch.tensor(prompt), torch.arange(n), cache, 0, torch.tril(torch.ones(n, n, dtype=torch.bool)))
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    mask = torch.cat([torch.ones(len(rows), n, dtype=torch.bool), torch.from_numpy(tree_attention_mask(np.asarray(parents)))], 1)
    engine = TargetEngine(model)
    engine.prefill("s", prompt, GREEDY, reserve_tokens=64)
    state = engine.sequences.get("s")
    row_tokens = [state.pending_token, *tokens]
    model(torch.tensor(row_tokens), n + torch.tensor(depths), cache, n, mask, parents=torch.from_numpy(rows))
    engine.tree_forward(state, np.asarray(tokens), np.asarray(parents))
    slots = engine.state.slots
    committed = slots.recurrent[:, state.holding.slot].clone()
    for node in range(len(tokens) + 1):
        slots.recurrent[:, state.holding.slot] = committed
        slots._committed.clear()  # commit the same pass's rows again, from the same state
        slots.commit(state.holding.slot, root_path(parents, node))
        stored = torch.stack([s[node] for s in cache.pending.states])  # [L, Hv, Dk, Dv] the tree's own
        torch.testing.assert_close(slots.recurrent[:, state.holding.slot], stored, atol=1e-5, rtol=1e-4)
    assert config.num_linear_layers == len(cache.pending.states)


def test_a_slot_is_committed_once_per_pass(model):
    engine = TargetEngine(model)
    engine.prefill("s", [1, 2, 3], GREEDY, reserve_tokens=32)
    state = engine.sequences.get("s")
    engine.tree_forward(state, np.array([4, 5]), np.array([0, 1]))
    engine.commit(state, [0, 1])
    with pytest.raises(RuntimeError, match="at most once"):
        engine.state.slots.commit(state.holding.slot, [0])


# -- the kernels' new options, against the torch references (Triton's interpreter) ----------------

H, HK, DK, DV = 4, 2, 6, 12  # DK, DV not powers of two; two value heads per key head


def delta_rows(gen: torch.Generator, n: int, heads: int = H):
    q = l2_normalize(torch.randn(n, heads, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(n, heads, DK, generator=gen))
    v = torch.randn(n, heads, DV, generator=gen)
    return q, k, v, -2 * torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen)


@pytest.fixture
def kernels(monkeypatch):
    pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    from native import tree_delta_rule

    return tree_delta_rule


@pytest.mark.parametrize("store_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_tree_kernel_reads_states_by_slot_and_stores_the_kept_rows(kernels, store_dtype):
    """Three sequences of a padded block (rows past offsets[S] belong to none) starting from slots
    of a table: outputs as the reference's, 0 for padding; stored states where kept."""
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.tensor([-1, 0, 0, 1, 3, 2]), chain_parents(1), torch.tensor([-1, 0, 1, 0, 3])]
    parents, offsets = batch_parents(blocks)
    pad = 4
    parents = torch.cat([parents, torch.full((pad,), -1)])
    n = len(parents)
    q, k, v, g, beta = delta_rows(gen, n)
    table = torch.randn(6, H, DK, DV, generator=gen).to(store_dtype)
    index = torch.tensor([4, 1, 5])
    keep = reloaded_rows(parents)
    assert keep.nonzero().flatten().tolist() == [0, 1, 2, 7]  # reloaded by rows 2, 3, 5 and 10
    out, states = kernels.tree_gated_delta(q, k, v, g, beta, table, parents, store_dtype, offsets, state_index=index, keep=keep, block_v=8)
    real = int(offsets[-1])
    ref_out, ref_states = gated_delta_tree(q[:real], k[:real], v[:real], g[:real], beta[:real], table, parents[:real], store_dtype, index)
    torch.testing.assert_close(out[:real], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    kept = keep[:real]
    torch.testing.assert_close(states[:real][kept].float(), ref_states[kept].float(), atol=1e-2 if store_dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


@pytest.mark.parametrize("store_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_path_kernel_equals_its_reference(kernels, store_dtype, monkeypatch):
    """Three sequences' paths (1, 4 and 2 rows) over 3 layers, inputs viewed out of larger buffers
    (as the reserved tree rows are): the kernel advances the slots in place as the reference does,
    and leaves the other slots alone."""
    gen = torch.Generator().manual_seed(11)
    layers, capacity, n = 3, 16, 10
    states = torch.randn(layers, 5, H, DK, DV, generator=gen).to(store_dtype)
    keys = l2_normalize(torch.randn(layers, capacity, HK, DK, generator=gen))[:, :n]
    values = torch.randn(layers, capacity, H, DV, generator=gen)[:, :n]
    decays, betas = -2 * torch.rand(layers, capacity, H, generator=gen)[:, :n], torch.rand(layers, capacity, H, generator=gen)[:, :n]
    slots = torch.tensor([3, 1, 4])
    paths = torch.tensor([[2, 0, 0, 0], [0, 1, 5, 7], [8, 9, 0, 0]])
    lengths = torch.tensor([1, 4, 2])
    ours, ref = states.clone(), states.clone()
    kernels.path_gated_delta(ours, slots, paths, lengths, keys, values, decays, betas, block_v=8)
    path_gated_delta_reference(ref, slots, paths, lengths, keys, values, decays, betas)
    assert not torch.equal(ref, states)
    assert torch.equal(ours[:, [0, 2]], states[:, [0, 2]])
    if store_dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:
        assert (ours == ref).float().mean().item() > 0.99  # the same roundings: nearly every bit equal
    # The indices as views of one table (as Qwen35Slots.commit_paths packs them): the same bits.
    table = torch.cat([paths, lengths[:, None], slots[:, None], torch.full((3, 2), -7)], dim=1)
    packed = states.clone()
    kernels.path_gated_delta(packed, table[:, 5], table[:, :4], table[:, 4], keys, values, decays, betas, block_v=8)
    assert torch.equal(packed, ours)
    with pytest.raises(ValueError, match="int64"):
        kernels.path_gated_delta(packed, slots.int(), paths, lengths, keys, values, decays, betas)
    # The dispatcher picks the kernel here.
    calls = []
    original = kernels.path_gated_delta
    monkeypatch.setattr(kernels, "path_gated_delta", lambda *args: calls.append(1) or original(*args))
    delta_rule.path_gated_delta(states.clone(), slots, paths, lengths, keys, values, decays, betas)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_conv_commit_kernel_equals_the_torch_commit(kernels, dtype, monkeypatch):
    """Three sequences' new conv histories (K - 1 = 3) over 3 layers, from rows of a larger buffer
    and from their old histories (windows as Qwen35Slots.commit_paths packs them, read as views of
    one table): the kernel rewrites the slots in place bit for bit as the torch commit does, and
    leaves the other slots alone."""
    gen = torch.Generator().manual_seed(12)
    layers, capacity, n, channels = 3, 16, 10, 40
    conv = torch.randn(layers, 5, 3, channels, generator=gen).to(dtype)
    inputs = torch.randn(layers, capacity, channels, generator=gen).to(dtype)[:, :n]
    slots = torch.tensor([3, 1, 4])
    # paths [2], [0, 1, 5], [8, 9]: their last three rows, the old history's latest before them
    windows = torch.tensor([[-2, -1, 2], [0, 1, 5], [-1, 8, 9]])
    table = torch.cat([torch.zeros(3, 2, dtype=torch.int64), slots[:, None], windows], dim=1)
    ours, ref = conv.clone(), conv.clone()
    kernels.commit_conv_histories(ours, table[:, 2], table[:, 3:], inputs, block=16)
    ref[:, slots] = delta_rule.committed_histories(ref[:, slots], inputs, windows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, 3, :2], conv[:, 3, 1:]) and torch.equal(ours[:, 3, 2], inputs[:, 2])
    assert torch.equal(ours[:, [0, 2]], conv[:, [0, 2]])
    # The dispatcher takes the kernel, and the torch commit where the math is float64.
    calls = []
    original = kernels.commit_conv_histories
    monkeypatch.setattr(kernels, "commit_conv_histories", lambda *args: calls.append(1) or original(*args))
    again = conv.clone()
    delta_rule.commit_conv_histories(again, slots, windows, inputs)
    assert calls == [1] and torch.equal(again, ref)
    wide = conv.double()
    delta_rule.commit_conv_histories(wide, slots, windows, inputs.double())
    assert calls == [1] and torch.equal(wide.to(dtype), ref)


def test_tree_passes_beyond_the_reserved_rows_run_eagerly(model):
    """With 4 sequences the slots reserve the rows of four budget-22 trees (96); a larger tree pass
    runs at its exact shape, keeping its rows in buffers of its own, and commits alike."""
    limits = TargetLimits(max_sequences=4)
    eager, fixed = TargetEngine(model, limits), TargetEngine(model, limits, fixed_shapes=True)
    assert fixed.runner.max_rows == fixed.state.slots._reserved.rows == 96
    rng = np.random.default_rng(9)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, 6).tolist()
    for engine in (eager, fixed):
        engine.prefill("s", prompt, GREEDY, reserve_tokens=300)
    parents = [int(rng.integers(0, j)) if j > 1 else 0 for j in range(1, 121)]  # 121 rows
    for tokens, parents in ((rng.integers(0, vocab, 120).tolist(), parents), tree_of(rng, vocab, "b22")):
        (_, want), (_, got) = tree_pass(eager, [("s", tokens, parents)]), tree_pass(fixed, [("s", tokens, parents)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
        assert fixed.state.slots.pending.rows == (121 if len(tokens) == 120 else 24)
        path = root_path(parents, len(tokens))
        for engine in (eager, fixed):
            engine.commit(engine.sequences.get("s"), path)
        assert_same_states(eager, fixed, "s")
    assert sorted(key[0] for key in fixed.runner._passes if not key[-1]) == [24]  # the 121-row pass: not a fixed shape
