"""``layers.fuse_linears``: several linears over one input as one matmul, float weights or GGUF
blocks alike, with each layer's own parameter a view into the fused one (no extra memory)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from native.gguf_matmul import QuantLinear
from splitspec.bench.random_weights import random_target
from splitspec.models.layers import fuse_linears
from tests.kquants import quantize_k


def _quant_linear(qtype: Q, out_features: int, in_features: int, seed: int) -> QuantLinear:
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    m = QuantLinear(qtype, in_features, out_features)
    m.raw.copy_(torch.from_numpy(quantize_k(w, qtype).reshape(out_features, -1)))
    return m


def test_kept_blocks_fuse_into_one_matmul_of_views():
    layers = [_quant_linear(Q.Q4_K, n, 512, seed) for seed, n in enumerate((48, 16, 8))]
    x = torch.randn(5, 512)
    apart = torch.cat([m(x) for m in layers], dim=-1)
    fused = fuse_linears(*layers)
    assert fused is not None and fused.qtype == Q.Q4_K and fused.out_features == 72
    torch.testing.assert_close(fused(x), apart, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused(x, 48), apart[:, 48:], rtol=1e-6, atol=1e-6)  # the rows after the first layer's
    start = fused.weight.data_ptr()
    for m, offset in zip(layers, (0, 48, 64)):  # each layer's blocks are its rows of the fused blocks
        assert m.raw.data_ptr() == start + offset * fused.weight.stride(0)
    torch.testing.assert_close(torch.cat([m(x) for m in layers], dim=-1), apart, rtol=0, atol=0)


def test_unlike_blocks_stay_apart():
    mixed = [_quant_linear(Q.Q4_K, 32, 512, 0), _quant_linear(Q.Q6_K, 32, 512, 1)]
    before = [m.raw.data_ptr() for m in mixed]
    assert fuse_linears(*mixed) is None
    assert [m.raw.data_ptr() for m in mixed] == before
    assert fuse_linears(nn.Linear(512, 8, bias=False), mixed[0]) is None


def test_attention_whose_v_differs_fuses_q_and_k():
    """A Q4_K_M file's attention layer with a Q6_K v beside Q4_K q and k: q and k become one
    matmul, v stays alone, and the projections are the three layers' (with or without queries)."""
    from splitspec.models.layers import QKVProjection

    attn = QKVProjection(512, num_heads=2, num_kv_heads=1, head_dim=16, eps=1e-6)
    attn.q_proj, attn.k_proj, attn.v_proj = (_quant_linear(t, n, 512, s) for s, (t, n) in enumerate(((Q.Q4_K, 32), (Q.Q4_K, 16), (Q.Q6_K, 16))))
    x = torch.randn(3, 512)
    apart = [m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    attn.fuse()
    assert attn._qkv is None and attn._qk is not None and attn._qk.out_features == 48
    for ours, theirs in zip(attn._projections(x), apart):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    q, k, v = attn._projections(x, queries=False)
    assert q.shape == (3, 0)
    torch.testing.assert_close(k, apart[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, apart[2], rtol=0, atol=0)


def test_float_weights_fuse_with_their_biases():
    torch.manual_seed(0)
    layers = [nn.Linear(64, n) for n in (24, 8)]
    x = torch.randn(3, 64)
    apart = torch.cat([m(x) for m in layers], dim=-1).detach()
    fused = fuse_linears(*layers)
    assert fused is not None and fused.qtype is None
    torch.testing.assert_close(fused(x), apart)
    torch.testing.assert_close(fused(x, 24), apart[:, 24:])


def _prefill_logits(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = len(ids)
    cache = model.new_cache(n, "cpu", dtype)
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    return model(ids, torch.arange(n), cache, 0, mask)[0]


def test_hybrid_fused_projections_keep_the_logits():
    """A qwen35 model's fused projections (gate/up; a DeltaNet layer's q/k/v, z, b and a) give the
    logits of the same model unfused, kept quantized (float32) or not (float64)."""
    for path, dtype, tol in (("random:tiny-qwen35", torch.float64, 1e-10), ("random:tiny-qwen35-q4km", torch.float32, 1e-5)):
        fused, config = random_target(path, "cpu", dtype)
        assert all(layer.mlp._gate_up is not None for layer in fused.layers)
        deltanets = [layer.linear_attn for layer in fused.layers if not layer.full_attention]
        alike = [getattr(net.in_proj_qkv, "qtype", None) == getattr(net.in_proj_z, "qtype", None) for net in deltanets]
        assert [net._in_proj is not None for net in deltanets] == alike and any(alike)  # Q4_K_M gives some in_proj_qkv Q6_K
        # Where in_proj_qkv stays alone, z, b and a (one block type) are one matmul.
        assert [net._in_proj_zba is not None for net in deltanets] == [not same for same in alike]
        assert all(alike) == path.endswith("qwen35")  # the Q4_K_M layout has both kinds
        unfused, _ = random_target(path, "cpu", dtype)
        for layer in unfused.layers:
            layer.mlp._gate_up = None
            if not layer.full_attention:
                layer.linear_attn._in_proj = layer.linear_attn._in_proj_zba = None
        ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(_prefill_logits(fused, ids, dtype), _prefill_logits(unfused, ids, dtype), rtol=tol, atol=tol)


def test_interleaved_blocks_fuse_as_they_are_and_give_the_same_outputs():
    layers = [_quant_linear(Q.Q4_K, n, 512, seed) for seed, n in enumerate((48, 16, 32))]
    x = torch.randn(5, 512)
    apart = torch.cat([m(x) for m in layers], dim=-1)
    file_bytes = [m.raw.clone() for m in layers]
    for m, before in zip(layers, file_bytes):
        m.interleave()
        assert m.interleaved and m.raw.shape == before.shape and not torch.equal(m.raw, before) and "interleaved" in repr(m)
    torch.testing.assert_close(torch.cat([m(x) for m in layers], dim=-1), apart, rtol=0, atol=0)
    fused = fuse_linears(*layers)
    assert fused is not None and fused.interleaved
    torch.testing.assert_close(fused(x), apart, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused(x, 48), apart[:, 48:], rtol=1e-6, atol=1e-6)  # whole groups of 16 features
    torch.testing.assert_close(fused(x, 40), apart[:, 40:], rtol=1e-6, atol=1e-6)  # not: all rows, then the slice
    for m, before in zip(layers, file_bytes):  # each part a view of its groups of the fused blocks, still interleaved
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, _dequantized(before, m)), rtol=1e-6, atol=1e-6)
        m.deinterleave()
        assert torch.equal(m.raw, before) and not m.interleaved


def test_a_part_in_the_files_layout_makes_the_fused_blocks_the_files():
    layers = [_quant_linear(Q.Q4_K, 32, 512, 0), _quant_linear(Q.Q4_K, 8, 512, 1)]  # 8 rows: no whole group
    x = torch.randn(3, 512)
    apart = torch.cat([m(x) for m in layers], dim=-1)
    file_bytes = layers[0].raw.clone()
    layers[0].interleave()
    fused = fuse_linears(*layers)
    assert fused is not None and not fused.interleaved and not layers[0].interleaved
    assert torch.equal(fused.weight[:32], file_bytes)
    torch.testing.assert_close(fused(x), apart, rtol=1e-6, atol=1e-6)


def _dequantized(raw: torch.Tensor, m: QuantLinear) -> torch.Tensor:
    from native.gguf_dequant import dequantize

    return dequantize(raw, m.qtype, (m.out_features, m.in_features))
