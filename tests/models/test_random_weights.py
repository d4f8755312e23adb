"""Benchmark-only random shapes (splitspec.bench.random_weights): quantized blocks that decode to
finite values of the intended spread, llama.cpp's Q4_K_M types per tensor, the QuantLinear swap
inside the hybrid model, the published geometries, and the roofline's byte count."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from native.gguf_dequant import dequantize
from native.gguf_matmul import QuantLinear
from splitspec.bench.components import weight_bytes
from splitspec.bench.random_weights import (
    SHAPES,
    random_blocks,
    random_draft,
    random_draft_config,
    random_target,
    random_target_config,
    random_target_head,
)
from splitspec.models.quantized import q4_k_m_types, swap_quant_linears
from splitspec.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

# llama.cpp's use_more_bits layers, worked out by hand: first and last eighth, every third between.
MORE_BITS_OF_4 = [2, 3]  # no first eighth (4 // 8 = 0); layer 3 is the last eighth (7 * 4 // 8 = 3), 2 is (2 - 0) % 3 == 2
MORE_BITS_OF_36 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
MORE_BITS_OF_64 = [*range(8), *range(10, 56, 3), *range(56, 64)]  # 64 // 8 = 8, 7 * 64 // 8 = 56


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS], ids=lambda q: q.name)
@pytest.mark.parametrize("std", [0.02, 1e-4, 1.0])
def test_random_blocks_decode_to_finite_values_of_the_intended_spread(qtype, std):
    raw = random_blocks(qtype, 64, 1024, std, torch.Generator().manual_seed(0))
    assert raw.dtype == torch.uint8 and raw.shape == (64, 1024 // 256 * GGML_QUANT_SIZES[qtype][1])
    values = dequantize(raw, qtype, (64, 1024))
    assert torch.isfinite(values).all()
    assert 0.8 * std < values.std().item() < 1.25 * std
    assert abs(values.mean().item()) < 0.1 * std
    # Every f16 scale field is finite and positive; the quant bits vary.
    scales = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}[qtype]
    blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
    for offset in scales:
        d = blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()
        assert torch.isfinite(d).all() and (d > 0).all()
    assert len(torch.unique(blocks[:, 16:128])) > 200


def _types(model: nn.Module) -> dict[str, str]:
    return {name: m.qtype.name for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_q4km_shapes_hold_the_llama_cpp_type_of_every_linear():
    model, _ = random_target("random:tiny-q4km")
    types = _types(model)
    # Every linear is kept in blocks; the embedding stays a dense table, as the loader dequantizes it.
    assert len(types) == 1 + 4 * 7 and isinstance(model.embed_tokens, nn.Embedding)
    assert types.pop("lm_head") == "Q6_K"
    for name, qtype in types.items():
        layer, kind = int(name.split(".")[1]), name.split(".", 2)[2]
        promoted = kind in ("self_attn.v_proj", "mlp.down_proj") and layer in MORE_BITS_OF_4
        assert qtype == ("Q6_K" if promoted else "Q4_K"), name


def test_q4km_recipe_on_the_real_geometries():
    with torch.device("meta"):
        dense = load_target_meta("qwen3-8b")
        hybrid = load_target_meta("qwen35-27b")
    types = q4_k_m_types(dense)
    six = sorted(int(n.split(".")[1]) for n, q in types.items() if q == Q.Q6_K and n.endswith("v_proj"))
    assert six == MORE_BITS_OF_36
    assert sorted(int(n.split(".")[1]) for n, q in types.items() if q == Q.Q6_K and n.endswith("down_proj")) == MORE_BITS_OF_36
    assert sum(q == Q.Q6_K for q in types.values()) == 37  # 18 attn_v + 18 ffn_down + output
    types = q4_k_m_types(hybrid)
    # attn_v (attention layers 3, 7, ..., 63) and attn_qkv (the DeltaNet layers) count as one
    # series, one per layer: Q6_K on the use_more_bits layers of 64, whichever kind the layer is.
    v_like = sorted(int(n.split(".")[1]) for n, q in types.items() if q == Q.Q6_K and n.endswith(("v_proj", "in_proj_qkv")))
    assert v_like == MORE_BITS_OF_64
    assert types["layers.3.self_attn.v_proj"] == Q.Q6_K and types["layers.11.self_attn.v_proj"] == Q.Q4_K
    assert types["layers.10.linear_attn.in_proj_qkv"] == Q.Q6_K and types["layers.9.linear_attn.in_proj_qkv"] == Q.Q4_K
    assert types["layers.0.linear_attn.out_proj"] == Q.Q4_K and types["layers.3.self_attn.q_proj"] == Q.Q4_K
    assert set(types.values()) == {Q.Q4_K, Q.Q6_K}


def load_target_meta(name: str) -> nn.Module:
    from splitspec.models.dense import DenseForCausalLM

    config = SHAPES[name].config
    return Qwen35ForCausalLM(config) if isinstance(config, Qwen35Config) else DenseForCausalLM(config)


@pytest.mark.parametrize("name", ["tiny-q4km", "tiny-qwen35-q4km"])
def test_weight_bytes_are_the_packed_blocks_plus_the_other_parameters(name):
    model, _ = random_target(f"random:{name}", dtype=torch.bfloat16)
    raw = sum(m.raw.numel() for m in model.modules() if isinstance(m, QuantLinear))
    others = sum(p.numel() * 2 for n, p in model.named_parameters() if n != "embed_tokens.weight")  # norms, conv, ...
    assert raw > 0 and weight_bytes(model) == raw + others
    # The packed linears: about 4.5 to 6.6 bits per weight (Q4_K and Q6_K), far below bf16's 16.
    values = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    assert 4.5 <= 8 * raw / values <= 6.6


def test_quant_linears_in_the_hybrid_model_compute_with_their_dequantized_weights():
    """The module swap works in every qwen35 mixer: replacing each QuantLinear by an nn.Linear holding
    its dequantized weight gives the same logits, bit for bit (on the CPU QuantLinear runs the
    reference, dequantize + F.linear), over a chain pass and a tree pass."""
    packed, config = random_target("random:tiny-qwen35-q4km")
    dense, _ = random_target("random:tiny-qwen35-q4km")
    for name, m in list(dense.named_modules()):
        if isinstance(m, QuantLinear):
            linear = nn.Linear(m.in_features, m.out_features, bias=False)
            linear.weight.data = dequantize(m.raw, m.qtype, (m.out_features, m.in_features))
            dense.set_submodule(name, linear)
    assert {type(m) for m in dense.modules()}.isdisjoint({QuantLinear})
    kinds = {name.rsplit(".", 1)[-1] for name in _types(packed)}
    assert kinds == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                     "gate_proj", "up_proj", "down_proj", "lm_head"}
    tokens = torch.tensor([3, 77, 150, 9, 400, 12])
    positions = torch.arange(6)
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    outputs = []
    for model in (packed, dense):
        cache = model.new_cache(32, "cpu", torch.float32)
        chain, _ = model(tokens, positions, cache, 0, torch.ones(6, 6, dtype=torch.bool).tril())
        tree, _ = model(tokens[:4], positions[:4] + 6, cache, 6, torch.ones(4, 10, dtype=torch.bool), parents=parents[:4])
        outputs.append((chain, tree))
    for ours, expected in zip(outputs[0], outputs[1]):
        assert torch.isfinite(ours).all() and torch.equal(ours, expected)


def test_swap_refuses_a_module_that_is_no_linear():
    with torch.device("meta"):
        model = load_target_meta("tiny-qwen35")
    with pytest.raises(TypeError, match="layers.0.input_layernorm is a RMSNorm"):
        swap_quant_linears(model, {"layers.0.input_layernorm": Q.Q4_K})


def test_published_geometries():
    c = random_target_config("random:qwen35-27b")
    assert isinstance(c, Qwen35Config) and random_target_config("random:qwen35-27b-q4km") == c
    assert (c.hidden_size, c.num_layers, c.num_linear_layers, c.num_full_layers) == (5120, 64, 48, 16)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.conv_channels, c.vocab_size) == (16, 48, 10240, 248320)
    d = random_draft_config("random:qwen35-27b-dflash")
    assert (d.hidden_size, d.intermediate_size, d.num_layers, d.num_heads, d.num_kv_heads, d.head_dim) == (5120, 17408, 5, 32, 8, 128)
    assert d.target_layer_ids == (1, 16, 31, 46, 61)
    assert random_draft_config("random:qwen3-8b-q4km-dflash") == random_draft_config("random:qwen3-8b-dflash")
    with pytest.raises(ValueError, match="random:qwen35-27b-q4km"):
        random_target_config("random:qwen35-9b")


def test_quantized_draft_head_is_the_targets_dequantized_q6_k_head():
    """The draft worker borrows the target's LM head: for a quantized shape, the dequantized blocks
    the target multiplies with."""
    model, _ = random_target("random:tiny-q4km")
    embed, head, _ = random_target_head("random:tiny-q4km")
    assert torch.equal(embed, model.embed_tokens.weight)
    assert torch.equal(head, dequantize(model.lm_head.raw, Q.Q6_K, tuple(head.shape)))
    draft, config = random_draft("random:tiny-qwen35-q4km-dflash")
    assert config.num_heads == 4 and all(torch.isfinite(p).all() for p in draft.parameters())
