"""Our Qwen3 forward against transformers' own GGUF loading of the same file."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.loader import load_target
from splitspec.models.dense import KVCache
from splitspec.tiny import TinySpec, make_tiny

transformers = pytest.importorskip("transformers")

# transformers' qwen3 GGUF mapping derives head_dim from hidden/heads, so keep them consistent.
HF_SPEC = TinySpec(hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=256, target_layers=3, seed=3)


def _causal(n: int, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + n)
    return torch.arange(start + n)[None, :] <= positions[:, None]


@pytest.fixture(scope="module", params=["f32", "f16", "bf16", "q8_0"])
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"hf-{request.param}")
    target, _ = make_tiny(out, HF_SPEC, weight_type=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file=target.name, dtype=torch.float32).eval()
    ours, config = load_target(target)
    return hf, ours, config


def test_prefill_logits_match_transformers(pair):
    hf, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = KVCache(config, 16, torch.device("cpu"), torch.float32)
    logits, _ = ours(ids, torch.arange(12), cache, 0, _causal(12))
    assert (logits - ref).abs().max().item() < 1e-4


def test_incremental_decode_matches_full_forward(pair):
    hf, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(config, 16, torch.device("cpu"), torch.float32)
    ours(ids[:4], torch.arange(4), cache, 0, _causal(4))
    for t in range(4, 10):
        step, _ = ours(ids[t : t + 1], torch.tensor([t]), cache, t, _causal(1, t))
        with torch.no_grad():
            ref = hf(ids[None, : t + 1]).logits[0, -1]
        assert (step[0] - ref).abs().max().item() < 1e-4


def test_tap_features_are_layer_outputs(pair):
    hf, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
    cache = KVCache(config, 8, torch.device("cpu"), torch.float32)
    # hidden_states[i + 1] is the output of layer i (HF normalises only the last one, never a tap).
    _, features = ours(ids, torch.arange(6), cache, 0, _causal(6), taps=(1, 0))
    expected = torch.cat([hidden[2][0], hidden[1][0]], dim=-1)
    assert (features - expected).abs().max().item() < 1e-4
