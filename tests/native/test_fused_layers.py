"""The residual-add + RMSNorm, SiLU·mul and tree-attention kernels against their plain-torch
references, under Triton's interpreter on the CPU (tests/conftest.py turns it on; the same kernel
source runs on the GPU). The layer-level check through a whole model is test_qkv_rope.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from splitspec.models.layers import QKVProjection, RMSNorm, SwiGLU

pytest.importorskip("triton", reason="triton is not installed")

from native import rms_norm, silu_mul, tree_attention  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def both_paths(monkeypatch, run):
    """``run()`` with the kernels (interpreted) and with the plain-torch references. Without
    autograd: a call it records runs the reference (the kernels have no backward pass)."""
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        with torch.inference_mode():
            results.append(run())
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100])  # 100: a row shorter than its power-of-two block
def test_norm_and_residual_norm_match_the_reference(dtype, hidden, monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    norm.to(dtype)
    delta, residual = torch.randn(2, 3, hidden, dtype=dtype)
    (y, (ya, total)), (y_ref, (ya_ref, total_ref)) = both_paths(
        monkeypatch, lambda: (norm(residual), norm.forward_add(delta, residual))
    )
    # The interpreter rounds to bfloat16 by truncation, a GPU to nearest: one unit in the last place.
    for a, b in ((total, total_ref), (y, y_ref), (ya, ya_ref)):
        assert a.dtype == dtype and torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype]), (a - b).abs().max()


def test_norm_falls_back_for_strided_rows(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    x = torch.randn(8, 6).t()  # not contiguous: the reference runs
    assert not rms_norm.supported(x, torch.ones(8))
    assert torch.allclose(RMSNorm(8, 1e-6)(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_swiglu(dtype, monkeypatch):
    torch.manual_seed(1)
    mlp = SwiGLU(32, 1100).to(dtype)  # 1100: more than one 1024-wide block, with a tail
    mlp.fuse()
    x = torch.randn(3, 32, dtype=dtype)
    fused, reference = both_paths(monkeypatch, lambda: mlp(x))
    assert torch.allclose(fused.float(), reference.float(), atol=TOL[dtype], rtol=TOL[dtype]), (fused - reference).abs().max()
    gate_up = torch.randn(2, 2 * 5)
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    assert torch.allclose(silu_mul.silu_mul(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:], atol=1e-6)


def tree_case(tokens: int, heads: int, kv_heads: int, head_dim: int, span: int, capacity: int, dtype, seed: int = 0):
    """Queries, a cache of ``capacity`` slots read over its first ``span``, and a mask where each
    token sees a random prefix subset plus itself (its own slot is ``span - tokens + i``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, tokens, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(kv_heads, capacity, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, capacity, head_dim, generator=g).to(dtype)
    mask = torch.rand(tokens, span, generator=g) > 0.4
    own = span - tokens + torch.arange(tokens)
    mask[torch.arange(tokens), own] = True
    return q, k_cache[:, :span], v_cache[:, :span], mask


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, head_dim, span",
    [
        (1, 4, 1, 16, 256),  # decode: 4 query rows, many splits (the combine kernel)
        (5, 4, 2, 32, 100),  # a span that is not a multiple of the key block
        (24, 8, 2, 16, 64),  # a verify block: 96 rows in two row blocks, one split (direct store)
        (3, 2, 2, 64, 300),  # no grouping
        (2, 6, 2, 256, 80),  # head_dim 256 (Qwen3.5's full attention): narrower tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_matches_the_torch_attention(tokens, heads, kv_heads, head_dim, span, dtype, monkeypatch):
    attn = QKVProjection(heads * head_dim, heads, kv_heads, head_dim, 1e-6)
    attn.o_proj = torch.nn.Identity()  # compare the attention itself: [T, H * D]
    q, k, v, mask = tree_case(tokens, heads, kv_heads, head_dim, span, span + 7, dtype)
    assert tree_attention.supported(q, k, v, mask)
    fused, reference = both_paths(monkeypatch, lambda: attn.attend(q, k, v, mask))
    assert fused.shape == (tokens, heads * head_dim) and fused.dtype == dtype
    assert torch.allclose(fused.float(), reference.float(), atol=TOL[dtype], rtol=TOL[dtype]), (fused - reference).abs().max()


def test_tree_attention_row_that_sees_one_key(monkeypatch):
    """A pad row of a verify bucket sees only its own slot: its output is exactly that value row."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    q, k, v, mask = tree_case(2, 2, 1, 16, 256, 256, torch.float32, seed=3)
    mask[1] = False
    mask[1, 200] = True
    out = tree_attention.tree_attention(q, k, v, mask)
    assert torch.allclose(out[1].view(2, 16), v[0, 200].expand(2, 16), atol=1e-6)
