"""The fused q/k/v norm + RoPE + cache-write kernel against the plain-torch path, under Triton's
interpreter on the CPU (tests/conftest.py turns it on; the same kernel source runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.dense import DenseConfig, DenseForCausalLM

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.parametrize("fused", ["qkv", "qk", "none"], ids=["fused", "q-and-k-fused", "separate-projections"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_layer_step_matches_the_torch_path(qk_norm, fused, monkeypatch):
    """The kernel from one fused matmul's views, from q and k fused with v apart (a Q4_K_M file's
    layers whose v is Q6_K), or from three projections' outputs, against the torch path; and it
    does run."""
    from native import qkv_rope
    from splitspec.models.layers import fuse_linears

    torch.manual_seed(0)
    config = DenseConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    model = DenseForCausalLM(config)
    for p in model.parameters():  # visible norm weights, not all ones
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3)
    if fused == "qkv":
        model.fuse_projections()
    elif fused == "qk":
        for layer in model.layers:
            layer.self_attn._qk = fuse_linears(layer.self_attn.q_proj, layer.self_attn.k_proj)
    launches = []
    launch = qkv_rope._launch
    monkeypatch.setattr(qkv_rope, "_launch", lambda *a: launches.append(a) or launch(*a))
    tokens, start = torch.randint(0, 64, (6,)), 5
    positions = torch.tensor([5, 6, 6, 7, 8, 7])
    slots = torch.arange(start, start + 6)
    mask = torch.rand(6, 16) > 0.3
    mask[torch.arange(6), slots] = True
    old_k, old_v = torch.randn(2, 2, 2, 16, 16)  # [layers, H_kv, slots, D]: earlier positions
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        cache = model.new_cache(16, "cpu", torch.float32)
        cache.k.copy_(old_k)
        cache.v.copy_(old_v)
        logits, _ = model(tokens, positions, cache, slots, mask)
        results.append((logits, cache.k.clone(), cache.v.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert len(launches) == config.num_layers  # the native run's layers, each one launch


# Qwen3.5's gated layout (native.qkv_rope.gated_qkv_rope): q_proj packs [q_h | gate_h] per head,
# RoPE turns the first R of D dims. A tiny geometry with R < D/2, so most of a head passes through.
H, HKV, D, R = 4, 2, 32, 8
EPS = 1e-6
POOL_SLOTS = 64
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}  # bf16: one rounding (the interpreter truncates)


def gated_inputs(rows: int, dtype: torch.dtype, fused: bool, seed: int):
    """q_gate [T, H * 2D], k, v [T, H_kv * D] (strided views of one matmul's output when ``fused``),
    cos/sin [T, R], norm weights [D], K/V pools [H_kv, slots, D] of random old values, and the rows'
    distinct pool slots [T]."""
    from splitspec.models.layers import rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    widths = [2 * H * D, HKV * D, HKV * D]
    q_gate, k, v = ((torch.randn(rows, w, generator=g) * 2).to(dtype) for w in widths)
    if fused:
        q_gate, k, v = torch.cat([q_gate, k, v], -1).split(widths, -1)
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (rows,), generator=g), R, 10_000_000.0, dtype)
    qw, kw = (1 + 0.5 * torch.randn(2, D, generator=g)).to(dtype)
    pools = torch.randn(2, HKV, POOL_SLOTS, D, generator=g).to(dtype)
    slots = torch.randperm(POOL_SLOTS, generator=g)[:rows]
    return q_gate, k, v, cos, sin, qw, kw, pools, slots


def exact_heads(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition in float64, from the rounded inputs: x [T, heads, D] RMS-normed over D, times
    w, then dims (i, i + R/2) of the first R rotated; -> [heads, T, D]."""
    x, w, cos, sin = x.double(), w.double(), cos.double()[:, None], sin.double()[:, None]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    a, b = x[..., : R // 2], x[..., R // 2 : R]
    rotated = torch.cat([a * cos[..., : R // 2] - b * sin[..., : R // 2], b * cos[..., R // 2 :] + a * sin[..., R // 2 :]], -1)
    return torch.cat([rotated, x[..., R:]], -1).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 23])
@pytest.mark.parametrize("fused", [False, True])
def test_gated_kernel_matches_the_definition(dtype, rows, fused):
    """q normed and partially rotated, k too into its pool slots, v copied there, within one
    rounding of the float64 definition; the gates and every other pool slot untouched."""
    from native import qkv_rope

    q_gate, k, v, cos, sin, qw, kw, pools, slots = gated_inputs(rows, dtype, fused, seed=rows)
    assert (k.stride(0) != k.shape[1]) == fused
    before_gate, before_pools = q_gate.clone(), pools.clone()
    k_pool, v_pool = pools
    q = qkv_rope.gated_qkv_rope(q_gate, k, v, cos, sin, qw, kw, EPS, k_pool, v_pool, slots)
    packed = q_gate.view(rows, H, 2 * D)
    assert q.shape == (H, rows, D) and q.dtype == dtype
    torch.testing.assert_close(q.double(), exact_heads(packed[..., :D], qw, cos, sin), **TOL[dtype])
    torch.testing.assert_close(k_pool[:, slots].double(), exact_heads(k.view(rows, HKV, D), kw, cos, sin), **TOL[dtype])
    assert torch.equal(v_pool[:, slots], v.view(rows, HKV, D).transpose(0, 1))
    assert torch.equal(q_gate, before_gate)
    others = torch.ones(POOL_SLOTS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(pools[:, :, others], before_pools[:, :, others])


def test_gated_kernel_passes_the_unrotated_dims_through():
    """With sin = 0 and cos = 1 the kernel is the norm alone: each dim keeps its place (a swapped or
    sign-flipped partner would show)."""
    from native import qkv_rope

    q_gate, k, v, cos, sin, qw, kw, pools, slots = gated_inputs(5, torch.float32, False, seed=9)
    q = qkv_rope.gated_qkv_rope(q_gate, k, v, torch.ones_like(cos), torch.zeros_like(sin), qw, kw, EPS, *pools, slots)
    x = q_gate.view(5, H, 2 * D)[..., :D]
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * qw
    torch.testing.assert_close(q, normed.transpose(0, 1), rtol=1e-5, atol=1e-5)


def gated_layer(fused: bool):
    from splitspec.models.qwen35 import GatedAttention, Qwen35Config

    c = Qwen35Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=H, num_kv_heads=HKV, head_dim=D,
        rotary_dim=R, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    )
    torch.manual_seed(0)
    attn = GatedAttention(c)
    for p in attn.parameters():  # visible norm weights, not all ones
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3)
    if fused:
        attn.fuse()
    return c, attn


@pytest.mark.parametrize("fused", [False, True])
def test_gated_attention_paged_matches_its_torch_path(fused, monkeypatch):
    """``GatedAttention.project_attend_paged``: the kernel where the native kernels run, the torch
    norms and RoPE otherwise (or when ``qkv_rope`` is switched off by name), with the same outputs
    and pool writes over a pass of three sequences (ragged rows, a tree, a decode row, a chain)."""
    import numpy as np

    from native import qkv_rope
    from splitspec.models.layers import rope_cos_sin
    from splitspec.models.paged import KVBlockPool, PassInputs, pass_layout

    c, attn = gated_layer(fused)
    block_size, counts, starts = 8, [5, 1, 3], [13, 9, 0]
    tables = [[7, 2, 9], [11, 3], [5]]
    parents = [np.array([-1, 0, 0, 1, 2]), np.array([-1]), np.array([-1, 0, 1])]
    trees = []
    for block in parents:
        tree = np.eye(len(block), dtype=bool)
        for j, parent in enumerate(block):
            if parent >= 0:
                tree[j] |= tree[parent]
        trees.append(tree)
    pool = KVBlockPool(1, HKV, D, 12, block_size, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(2)
    old = torch.randn(2, HKV, 11 * block_size, D, generator=g)  # earlier positions; the pad block stays zero
    layout = pass_layout(pool, [[0] * n for n in counts], parents, starts, tables, trees)
    inputs = PassInputs.exact(layout, block_size, torch.device("cpu"))
    at = inputs.attention()
    x = torch.randn(sum(counts), c.hidden_size, generator=g)
    cos, sin = rope_cos_sin(inputs.positions, R, c.rope_theta, x.dtype)
    calls = []
    kernel = qkv_rope.gated_qkv_rope
    monkeypatch.setattr(qkv_rope, "gated_qkv_rope", lambda *a: calls.append(1) or kernel(*a))
    results = []
    for native, off in (("1", ""), ("0", ""), ("1", "qkv_rope")):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", off)
        pool.k[:, :, block_size:], pool.v[:, :, block_size:] = old
        before = pool.k.clone()
        with torch.no_grad():
            out = attn.project_attend_paged(x, cos, sin, pool.k[0], pool.v[0], at)
        assert (pool.k != before).any(dim=(0, 1, 3)).sum() == sum(counts)  # one slot a row written
        results.append((out, pool.k.clone(), pool.v.clone()))
    assert calls == [1]  # the kernel ran once: not on the CPU path, nor switched off by name
    for got, want in (*zip(results[0], results[1], strict=True), *zip(results[2], results[1], strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hybrid_forward_paged_runs_the_gated_kernel(tiny_qwen35_pair, monkeypatch):
    """A whole paged pass of the tiny Qwen3.5 target (head_dim 16, R = 4) with only ``qkv_rope`` of
    the native kernels on: the same logits and K/V pool as the torch pass."""
    import numpy as np

    from native import qkv_rope
    from splitspec.models.loader import load_target
    from splitspec.models.paged import PassInputs, pass_layout

    model, _ = load_target(tiny_qwen35_pair.target, dtype=torch.float32)
    c, block_size, counts, starts = model.config, 8, [4, 1], [6, 0]
    calls = []
    kernel = qkv_rope.gated_qkv_rope
    monkeypatch.setattr(qkv_rope, "gated_qkv_rope", lambda *a: calls.append(1) or kernel(*a))
    others = "rms_norm,silu_mul,tree_attention,paged_attention,chunked_delta_rule,tree_delta_rule,delta_inputs,gated_rms_norm,gguf_matmul,top_k"
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", others)
        state = model.new_pool(6, block_size, 3, torch.device("cpu"), torch.float32)
        g = torch.Generator().manual_seed(3)
        state.kv.k[:, :, block_size:] = torch.randn(state.kv.k[:, :, block_size:].shape, generator=g)
        state.kv.v[:, :, block_size:] = torch.randn(state.kv.v[:, :, block_size:].shape, generator=g)
        chain = [np.arange(n) - 1 for n in counts]
        trees = [np.tril(np.ones((n, n), dtype=bool)) for n in counts]
        tokens = [[int(t) for t in np.random.default_rng(1).integers(0, c.vocab_size, n)] for n in counts]
        layout = pass_layout(state.kv, tokens, chain, starts, [[3, 1], [4]], trees, [1, 2])
        logits, _ = model.forward_paged(PassInputs.exact(layout, block_size, torch.device("cpu")), state)
        results.append((logits, state.kv.k.clone(), state.kv.v.clone()))
    assert calls == [c.num_full_layers]
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
