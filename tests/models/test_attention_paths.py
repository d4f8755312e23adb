"""``layers.QKVProjection.attention``'s paths for grouped-query heads with a mask agree: plain
matmuls (decode and verify shapes) and the fused kernel one query head of each group at a time
(prompt chunks over long contexts, which keeps the mask [T, S] instead of repeating it)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models import layers


@pytest.mark.parametrize("batched", [False, True])
def test_the_fused_path_equals_the_matmul_path(monkeypatch, batched):
    torch.manual_seed(0)
    attn = layers.QKVProjection(hidden=64, num_heads=6, num_kv_heads=2, head_dim=16, eps=1e-6).double()
    t, s = 5, 11
    q = torch.randn(2, 6, t, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, s, 16, dtype=torch.float64), torch.randn(2, 2, s, 16, dtype=torch.float64)
    mask = torch.rand(2, t, s) < 0.6
    mask[..., 0] = True  # every row sees a key
    if not batched:
        q, k, v, mask = q[0], k[0], v[0], mask[0]
    monkeypatch.setattr(layers, "SMALL_ATTENTION", 1 << 30)
    plain = attn.attention(q, k, v, mask)
    monkeypatch.setattr(layers, "SMALL_ATTENTION", 0)
    fused = attn.attention(q, k, v, mask)
    assert fused.shape == plain.shape == ((2,) if batched else ()) + (t, 6 * 16)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    # Row r of head i against K/V head i // 3, by the definition.
    qi, ki, vi, mi = (q, k, v, mask) if not batched else (q[1], k[1], v[1], mask[1])
    scores = (qi[4] @ ki[1].T / 4.0).masked_fill(~mi, float("-inf"))
    expected = torch.softmax(scores, -1) @ vi[1]  # head 4 uses K/V head 1
    torch.testing.assert_close((fused[1] if batched else fused)[:, 4 * 16 : 5 * 16], expected, rtol=1e-12, atol=1e-12)
