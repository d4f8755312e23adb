"""The paged tree-attention kernel (keys read through block tables) against a plain-torch
reference, under Triton's interpreter on the CPU (tests/conftest.py turns it on; the same kernel
source runs on the GPU). The passes are built the way the engine builds them
(``pass_layout`` -> ``PassInputs`` -> ``PassAttention``), over scattered blocks of a pool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.models.layers import QKVProjection
from splitspec.models.paged import PAD_BLOCK, KVBlockPool, PassInputs, pass_layout

pytest.importorskip("triton", reason="triton is not installed")

from native import paged_attention  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")


def random_tree(rows: int, rng: np.random.Generator, chain: bool) -> tuple[np.ndarray, np.ndarray]:
    """Parents inside the block (-1 = the block's root hangs off the prefix) and the visibility
    (ancestors and self) of a random tree, or of a causal chain (a prompt chunk)."""
    parents = np.array([j - 1 if chain else (rng.integers(-1, j) if j else -1) for j in range(rows)], dtype=np.int64)
    tree = np.zeros((rows, rows), dtype=bool)
    for j in range(rows):
        node = j
        while node >= 0:
            tree[j, node] = True
            node = parents[node]
    return parents, tree


def make_pass(
    block_size: int, kv_heads: int, head_dim: int, counts: list[int], starts: list[int], dtype, seed: int = 0,
    full_tables: bool = False, pad_sequence: bool = True,
):
    """A pool of scattered (shuffled, non-contiguous) blocks holding random K/V, and the device
    inputs of a pass over sequences with ``counts`` rows at ``starts``. The pass is padded as a
    CUDA-graph bucket would be: two pad rows, a pad sequence (start 1, pad block only) and one more
    key block, so every table ends in pad-block entries. ``full_tables``: each sequence owns its
    own blocks over all S columns (no pad block in its table)."""
    rng = np.random.default_rng(seed)
    b = len(counts)
    rows, keys_exact = sum(counts), max(s + n for s, n in zip(starts, counts))
    span = (-(-keys_exact // block_size) + 1) * block_size  # one more block than any sequence needs
    per_seq = [span // block_size if full_tables else -(-(s + n) // block_size) for s, n in zip(starts, counts)]
    num_blocks = 1 + sum(per_seq) + 5  # a few blocks nobody owns
    pool = KVBlockPool(1, kv_heads, head_dim, num_blocks, block_size, CPU, dtype)
    g = torch.Generator().manual_seed(seed)
    for cache in (pool.k, pool.v):
        cache[:, :, block_size:] = torch.randn(cache[:, :, block_size:].shape, generator=g).to(dtype)  # the pad block stays zero
    ids = rng.permutation(np.arange(1, num_blocks))
    tables, taken = [], 0
    for count in per_seq:
        tables.append(ids[taken : taken + count])
        taken += count
    trees = [random_tree(n, rng, chain=i == len(counts) - 1 and n > 1) for i, n in enumerate(counts)]
    layout = pass_layout(
        pool, [rng.integers(0, 100, n).tolist() for n in counts], [p for p, _ in trees], starts, tables, [t for _, t in trees]
    )
    shape = (rows + 2, b + int(pad_sequence), layout.max_rows, span, block_size)
    host = np.zeros(PassInputs.nbytes(*shape), dtype=np.uint8)
    inputs = PassInputs.on(torch.from_numpy(host), *shape)
    inputs.fill(layout, host)
    assert (inputs.tables[:, -1] == PAD_BLOCK).all() or full_tables
    return pool, inputs, inputs.attention()


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, at) -> torch.Tensor:
    """Plain torch in float64: gather each sequence's keys by its table, masked softmax -> [B, T, H * D]."""
    b, h, t, d = q.shape
    group = h // k_pool.shape[0]
    cols = torch.arange(at.visible.shape[-1])
    slots = at.tables[:, cols // at.block_size] * at.block_size + cols % at.block_size  # [B, S]
    k = k_pool[:, slots].transpose(0, 1).double().repeat_interleave(group, 1)  # [B, H, S, D]
    v = v_pool[:, slots].transpose(0, 1).double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) / d**0.5
    probs = torch.softmax(scores.masked_fill(~at.visible[:, None], float("-inf")), -1)
    return (probs @ v).transpose(1, 2).flatten(2)  # [B, T, H * D]


def check(out: torch.Tensor, expected: torch.Tensor, at, dtype) -> None:
    """The real rows (the ones ``out_index`` keeps) match; every row is finite (pad rows included)."""
    real = out.flatten(0, 1)[at.out_index].double()
    want = expected.flatten(0, 1)[at.out_index]
    assert torch.isfinite(out.float()).all()
    assert torch.allclose(real, want, atol=TOL[dtype], rtol=TOL[dtype]), (real - want).abs().max()


CASES = [
    # block_size, heads, kv_heads, head_dim, counts (rows of each sequence), starts
    pytest.param(16, 4, 4, 64, [1, 1, 1], [300, 37, 3], id="decode-bs16-g1-d64"),
    pytest.param(8, 4, 2, 128, [24, 9, 17], [150, 37, 0], id="tree-bs8-g2-d128"),
    pytest.param(16, 8, 2, 64, [24, 5, 24], [200, 61, 0], id="tree-bs16-g4-d64"),
    pytest.param(8, 4, 1, 256, [1, 1, 1, 1], [90, 7, 130, 0], id="decode-bs8-g4-d256"),
    pytest.param(16, 2, 2, 128, [11, 24], [70, 101], id="tree-bs16-g1-d128"),
    pytest.param(16, 4, 2, 256, [24, 3, 12], [120, 2, 0], id="tree-bs16-g2-d256"),
]


@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim, counts, starts", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_the_reference(block_size, heads, kv_heads, head_dim, counts, starts, dtype):
    pool, inputs, at = make_pass(block_size, kv_heads, head_dim, counts, starts, dtype)
    b, t = at.row_index.shape
    span = at.visible.shape[-1]
    q = torch.randn(b, heads, t, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    k_pool, v_pool = pool.k[0], pool.v[0]
    assert paged_attention.supported(q, k_pool, v_pool, at.visible)
    launch = paged_attention.plan(b, heads, kv_heads, t, head_dim, span, q.device)
    assert span > 2 * launch.block_s and launch.splits > 1  # several key tiles, the combine kernel
    out = paged_attention.paged_tree_attention(q, k_pool, v_pool, at.tables, at.starts, at.visible, at.block_size)
    assert out.shape == (b, t, heads * head_dim) and out.dtype == dtype
    check(out, reference(q, k_pool, v_pool, at), at, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_stores_directly(dtype, monkeypatch):
    """A device already full of (sequence x K/V head) programs: one split, no combine kernel."""
    monkeypatch.setattr(paged_attention, "sm_count", lambda device: 1)
    pool, inputs, at = make_pass(8, 2, 64, [24, 9], [100, 20], dtype, seed=2)
    b, t = at.row_index.shape
    q = torch.randn(b, 4, t, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert paged_attention.plan(b, 4, 2, t, 64, at.visible.shape[-1], q.device).splits == 1
    out = paged_attention.paged_tree_attention(q, pool.k[0], pool.v[0], at.tables, at.starts, at.visible, at.block_size)
    check(out, reference(q, pool.k[0], pool.v[0], at), at, dtype)


@pytest.mark.parametrize("forced_splits", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_rows_are_read_and_written_through_row_index(dtype, forced_splits, monkeypatch):
    """q as the pass's N ragged rows (``rows``): each real row gets the output of its padded place,
    bit for bit as the padded call gives it, and the pass's pad rows (no place names them) zeros."""
    if not forced_splits:
        monkeypatch.setattr(paged_attention, "sm_count", lambda device: 1)
    heads, kv_heads, head_dim, counts = 4, 2, 64, [7, 1, 12]
    pool, inputs, at = make_pass(8, kv_heads, head_dim, counts, [90, 33, 5], dtype, seed=11)
    real, n = sum(counts), inputs.tokens.shape[0]
    assert n == real + 2  # two pad rows, as a graph bucket has
    q = torch.randn(heads, n, head_dim, generator=torch.Generator().manual_seed(12)).to(dtype)
    padded = torch.cat([q.transpose(0, 1), q.new_zeros(1, heads, head_dim)])[at.row_index].transpose(1, 2)  # [B, H, T, D]
    args = (pool.k[0], pool.v[0], at.tables, at.starts, at.visible, at.block_size)
    assert paged_attention.supported(q, pool.k[0], pool.v[0], at.visible, at.row_index)
    assert not paged_attention.supported(padded, pool.k[0], pool.v[0], at.visible, at.row_index)
    out = paged_attention.paged_tree_attention(q, *args, rows=at.row_index)
    assert out.shape == (n, heads * head_dim) and out.dtype == dtype
    by_place = paged_attention.paged_tree_attention(padded.contiguous(), *args).flatten(0, 1)  # [B * T, H * D]
    assert torch.equal(out[:real], by_place[at.out_index[:real]])
    assert not out[real:].any()
    check(by_place.view(len(counts) + 1, -1, heads * head_dim), reference(padded, pool.k[0], pool.v[0], at), at, dtype)


@pytest.mark.parametrize("forced_splits", [False, True], ids=["one-split", "combined-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_is_applied_in_the_kernels_store(dtype, forced_splits, monkeypatch):
    """``gate`` (a strided view, as of q_proj's packed output) multiplies each real row by its
    sigmoid where the output is stored, as the separate sigmoid and product would; pad rows stay zeros."""
    if not forced_splits:
        monkeypatch.setattr(paged_attention, "sm_count", lambda device: 1)
    heads, kv_heads, head_dim, counts = 4, 2, 64, [7, 1, 12]
    pool, inputs, at = make_pass(8, kv_heads, head_dim, counts, [90, 33, 5], dtype, seed=13)
    real, n = sum(counts), inputs.tokens.shape[0]
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(heads, n, head_dim, generator=gen).to(dtype)
    packed = (3 * torch.randn(n, heads, 2 * head_dim, generator=gen)).to(dtype)  # [q_h | gate_h] per head
    gate = packed[..., head_dim:]  # [N, H, D], rows and heads strided
    args = (pool.k[0], pool.v[0], at.tables, at.starts, at.visible, at.block_size)
    plain = paged_attention.paged_tree_attention(q, *args, rows=at.row_index)
    gated = paged_attention.paged_tree_attention(q, *args, rows=at.row_index, gate=gate)
    expected = plain * torch.sigmoid(gate.reshape(n, -1))
    # bf16: two roundings (the sigmoid's, the product's), each a truncation under the interpreter
    tol = dict(rtol=2**-6, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gated[:real], expected[:real], **tol)
    assert not gated[real:].any()
    with pytest.raises(ValueError, match="gate"):
        paged_attention.paged_tree_attention(q, *args, rows=at.row_index, gate=gate[:, :2])


@pytest.mark.parametrize("forced_splits", [False, True])
def test_keys_and_visibility_past_each_sequence_never_matter(forced_splits, monkeypatch):
    """Columns at or past ``starts[b] + T`` are never read: NaN K/V there (each sequence owns its
    blocks over all S columns) and ``visible`` set True there change nothing, bit for bit; nor does
    ``visible`` of the committed prefix (columns below ``starts[b]``, visible to every row)."""
    if not forced_splits:
        monkeypatch.setattr(paged_attention, "sm_count", lambda device: 1)
    block_size, heads, kv_heads, head_dim = 8, 4, 2, 64
    pool, inputs, at = make_pass(
        block_size, kv_heads, head_dim, [5, 12, 1], [140, 3, 60], torch.float32, seed=5, full_tables=True, pad_sequence=False
    )
    b, t = at.row_index.shape
    span = at.visible.shape[-1]
    q = torch.randn(b, heads, t, head_dim, generator=torch.Generator().manual_seed(9))
    run = lambda k, v, vis: paged_attention.paged_tree_attention(q, k, v, at.tables, at.starts, vis, block_size)  # noqa: E731
    clean = run(pool.k[0], pool.v[0], at.visible)
    check(clean, reference(q, pool.k[0], pool.v[0], at), at, torch.float32)
    k, v, visible = pool.k[0].clone(), pool.v[0].clone(), at.visible.clone()
    for s in range(b):
        past = torch.arange(int(at.starts[s]) + t, span)
        slots = at.tables[s, past // block_size] * block_size + past % block_size
        k[:, slots], v[:, slots] = float("nan"), float("nan")
        visible[s, :, past] = True
        visible[s, :, : int(at.starts[s])] = False
    assert torch.equal(run(k, v, visible), clean)


@pytest.mark.parametrize("forced_splits", [False, True])
def test_a_window_hides_the_prefix_before_prefix_from(forced_splits, monkeypatch):
    """``prefix_from``: columns before it follow ``visible`` (a draft window: each row's own first
    column, as a sliding window's differ by row), the prefix from it on is seen by every row
    without its visibility read; without it, the whole prefix is (the window ignored)."""
    if not forced_splits:
        monkeypatch.setattr(paged_attention, "sm_count", lambda device: 1)
    block_size, heads, kv_heads, head_dim = 8, 4, 2, 64
    pool, inputs, at = make_pass(block_size, kv_heads, head_dim, [6, 3, 1], [150, 40, 9], torch.float32, seed=8, pad_sequence=False)
    b, t = at.row_index.shape
    span = at.visible.shape[-1]
    q = torch.randn(b, heads, t, head_dim, generator=torch.Generator().manual_seed(2))
    firsts = torch.tensor([70, 33, 0])  # the last sequence has no window
    rows, cols = torch.arange(t)[:, None], torch.arange(span)
    first_by_row = torch.minimum(firsts[:, None, None] + rows, at.starts[:, None, None])  # [B, T, 1]: a sliding window
    windowed = at.visible & ((cols >= first_by_row) | (cols >= at.starts[:, None, None]))
    prefix_from = first_by_row.flatten(1).amax(1)  # every row sees the prefix from there on
    out = paged_attention.paged_tree_attention(q, pool.k[0], pool.v[0], at.tables, at.starts, windowed, block_size, prefix_from=prefix_from)
    check(out, reference(q, pool.k[0], pool.v[0], SimpleNamespace(tables=at.tables, block_size=block_size, visible=windowed)), at, torch.float32)
    whole = paged_attention.paged_tree_attention(q, pool.k[0], pool.v[0], at.tables, at.starts, windowed, block_size)
    check(whole, reference(q, pool.k[0], pool.v[0], at), at, torch.float32)  # the window ignored
    assert not torch.allclose(out[:2], whole[:2])


def test_attend_paged_runs_the_kernel_and_matches_the_torch_path(monkeypatch):
    """The layer's dispatch: the kernel where the native kernels run, the gathering torch path
    otherwise, with the same outputs (ragged rows, Qwen3.5's output gate)."""
    heads, kv_heads, head_dim = 4, 2, 32
    attn = QKVProjection(heads * head_dim, heads, kv_heads, head_dim, 1e-6)
    pool, inputs, at = make_pass(16, kv_heads, head_dim, [6, 1, 9], [40, 77, 0], torch.float32, seed=4)
    n = inputs.tokens.shape[0]
    g = torch.Generator().manual_seed(1)
    q, gate = torch.randn(heads, n, head_dim, generator=g), torch.randn(n, heads * head_dim, generator=g)
    calls = []
    kernel = paged_attention.paged_tree_attention
    monkeypatch.setattr(paged_attention, "paged_tree_attention", lambda *a, **kw: calls.append(kw["rows"]) or kernel(*a, **kw))
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        results.append(attn.attend_paged(q, pool.k[0], pool.v[0], at, gate))
    assert len(calls) == 1 and calls[0] is at.row_index  # a ragged pass: rows read and written through row_index
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", "paged_attention")
    attn.attend_paged(q, pool.k[0], pool.v[0], at, gate)
    assert len(calls) == 1  # switched off by name: the torch path ran
    real = 6 + 1 + 9  # the rows past them pad the pass: each path gives them finite values of its own
    assert torch.allclose(results[0][:real], results[1][:real], atol=1e-5), (results[0] - results[1])[:real].abs().max()
    assert torch.isfinite(results[0]).all()


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("counts, starts", [([5], [37]), ([1, 1, 1], [40, 77, 3])], ids=["one-sequence", "decode-rows"])
def test_passes_of_b_times_t_rows_attend_in_place_as_the_gathered_rows_do(counts, starts, native, monkeypatch):
    """A pass of one sequence, or of one row a sequence, padded to N = B * T rows takes its padded
    rows as a view of q (no gather, no reordering): each real row's output equals the one it gets
    in the same pass padded with two more rows, which gathers them."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    attn = QKVProjection(heads * head_dim, heads, kv_heads, head_dim, 1e-6)
    pool, _, _ = make_pass(block_size, kv_heads, head_dim, counts, starts, torch.float32, seed=6, full_tables=True, pad_sequence=False)
    rng = np.random.default_rng(6)
    tables = [list(range(1 + 6 * i, 7 + 6 * i)) for i in range(len(counts))]  # each sequence's own six blocks
    trees = [random_tree(n, rng, chain=False) for n in counts]
    layout = pass_layout(pool, [[1] * n for n in counts], [p for p, _ in trees], starts, tables, [t for _, t in trees])
    b, t = len(counts), 8 if len(counts) == 1 else 1
    n = sum(counts)
    q = torch.randn(heads, b * t + 2, head_dim, generator=torch.Generator().manual_seed(8))
    outs = []
    for rows in (b * t, b * t + 2):  # in place, then gathered
        shape = (rows, b, t, 6 * block_size, block_size)
        host = np.zeros(PassInputs.nbytes(*shape), dtype=np.uint8)
        inputs = PassInputs.on(torch.from_numpy(host), *shape)
        inputs.fill(layout, host)
        outs.append(attn.attend_paged(q[:, :rows], pool.k[0], pool.v[0], inputs.attention()))
    assert torch.allclose(outs[0][:n], outs[1][:n], atol=1e-6), (outs[0][:n] - outs[1][:n]).abs().max()
    assert torch.isfinite(outs[0]).all()  # pad rows too: they feed later layers


def test_dense_forward_paged_matches_the_torch_path(monkeypatch):
    """A whole paged pass of a tiny dense model (fused projections, every native kernel) agrees
    with the plain-torch pass."""
    torch.manual_seed(0)
    config = DenseConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    model = DenseForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3)
    model.fuse_projections()
    rng = np.random.default_rng(0)
    counts, starts, block_size = [5, 1, 3], [21, 9, 0], 8
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        state = model.new_pool(12, block_size, 4, CPU, torch.float32)
        g = torch.Generator().manual_seed(2)
        state.kv.k[:, :, block_size:] = torch.randn(state.kv.k[:, :, block_size:].shape, generator=g)
        state.kv.v[:, :, block_size:] = torch.randn(state.kv.v[:, :, block_size:].shape, generator=g)
        tables = [[7, 2, 9, 4], [11, 3], [5]]
        trees = [random_tree(n, np.random.default_rng(i), chain=i == 2) for i, n in enumerate(counts)]
        layout = pass_layout(
            state.kv, [rng.integers(0, 64, n).tolist() for n in counts], [p for p, _ in trees], starts, tables, [t for _, t in trees]
        )
        logits, _ = model.forward_paged(PassInputs.exact(layout, block_size, CPU), state)
        results.append((logits, state.kv.k.clone(), state.kv.v.clone()))
        rng = np.random.default_rng(0)
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
