"""The fused q/k/v norm + RoPE + cache-write kernel against the plain-torch path, under Triton's
interpreter on the CPU (tests/conftest.py turns it on; the same kernel source runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.dense import DenseConfig, DenseForCausalLM

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.parametrize("qk_norm", [True, False])
def test_layer_step_matches_the_torch_path(qk_norm, monkeypatch):
    torch.manual_seed(0)
    config = DenseConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    model = DenseForCausalLM(config)
    for p in model.parameters():  # visible norm weights, not all ones
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3)
    model.fuse_projections()
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
