"""Benchmark-only random shapes (splitspec.bench.random_weights): quantized blocks that decode to
finite values of the intended spread, the device Q6_K quantizer against gguf's dequantizer, the
structured LM head (the same greedy output on every kernel path), llama.cpp's Q4_K_M types per
tensor, the QuantLinear swap inside the hybrid model, the published geometries, and the roofline's
byte count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from native.gguf_dequant import dequantize
from native.gguf_matmul import QuantLinear
from splitspec.bench.components import weight_bytes
from splitspec.bench.random_weights import (
    RANDOM_BLOCK_TYPES,
    SHAPES,
    _permutation,
    quant_types,
    quantize_q4_k,
    quantize_q6_k,
    random_blocks,
    random_draft,
    random_draft_config,
    random_target,
    random_target_config,
    random_target_head,
)
from splitspec.models.quantized import QuantEmbedding, q4_k_m_types, swap_quant_linears
from splitspec.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

# llama.cpp's use_more_bits layers, worked out by hand: first and last eighth, every third between.
MORE_BITS_OF_4 = [2, 3]  # no first eighth (4 // 8 = 0); layer 3 is the last eighth (7 * 4 // 8 = 3), 2 is (2 - 0) % 3 == 2
MORE_BITS_OF_36 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
MORE_BITS_OF_64 = [*range(8), *range(10, 56, 3), *range(56, 64)]  # 64 // 8 = 8, 7 * 64 // 8 = 56


@pytest.mark.parametrize("qtype", RANDOM_BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("std", [0.02, 1e-4, 1.0])
def test_random_blocks_decode_to_finite_values_of_the_intended_spread(qtype, std):
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 64, 1024, std, torch.Generator().manual_seed(0))
    assert raw.dtype == torch.uint8 and raw.shape == (64, 1024 // block_values * block_bytes)
    values = dequantize(raw, qtype, (64, 1024))
    assert torch.isfinite(values).all()
    assert 0.8 * std < values.std().item() < 1.25 * std
    assert abs(values.mean().item()) < 0.1 * std
    # Every f16 scale field is finite and positive; the quant bits vary.
    scales = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.Q8_0: (0,)}[qtype]
    blocks = raw.view(-1, block_bytes)
    for offset in scales:
        d = blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()
        assert torch.isfinite(d).all() and (d > 0).all()
    assert set(RANDOM_BLOCK_TYPES) == {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q8_0}
    assert len(torch.unique(blocks[:, 4:34])) > 200


def _q6_k_input(rows: int, k: int) -> torch.Tensor:
    """Rows of scales 0.3 to 30 (where ``d`` is a normal f16: quantize_q6_k's bound holds), an
    all-zero super-block, a lone outlier, a constant run."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(rows, k, generator=g) * torch.logspace(-0.5, 1.5, rows)[:, None]
    w[0, :256] = 0.0
    w[1, 300] = 50.0
    w[2, 256:512] = -0.75
    return w


def test_q6_k_quantizer_round_trips_through_ggufs_dequantizer():
    """quantize_q6_k writes valid Q6_K blocks: gguf's numpy dequantizer reads them back within
    the quantizer's bound (half a step plus 31 half-units of d: under 2% of each super-block's
    largest magnitude), and native.gguf_dequant reads the same values bit for bit."""
    w = _q6_k_input(24, 768)
    raw = quantize_q6_k(w)
    assert raw.dtype == torch.uint8 and raw.shape == (24, 3 * 210) and raw.is_contiguous()
    back = gguf_dequantize(raw.numpy(), Q.Q6_K)  # [24, 768] float32
    assert back.shape == (24, 768)
    error = np.abs(back - w.numpy()).reshape(-1, 256).max(1)
    peak = np.abs(w.numpy()).reshape(-1, 256).max(1)
    assert (error <= 0.02 * peak).all(), (error / np.maximum(peak, 1e-30)).max()
    assert error[0] == 0.0  # the all-zero super-block: d = 0, exact
    assert error[2 * 3 + 1] <= 1e-3 * 0.75  # a constant one: off by d's f16 rounding only
    # A lone outlier sets its super-block's d: it comes back within the bound; the block's small
    # values may round to zero, which the bound (relative to the largest magnitude) allows.
    assert abs(back[1, 300] - 50.0) <= 0.02 * 50.0
    relative = np.linalg.norm(back - w.numpy(), axis=1) / np.linalg.norm(w.numpy(), axis=1)
    assert relative.max() < 0.03
    assert np.array_equal(dequantize(raw, Q.Q6_K, (24, 768)).numpy().view(np.uint32), back.view(np.uint32))
    blocks = raw.view(-1, 210)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    assert torch.isfinite(d).all() and (d >= 0).all() and (scales >= 0).all()
    with pytest.raises(ValueError, match="multiples of 256"):
        quantize_q6_k(torch.zeros(2, 300))


def test_q6_k_quantizer_puts_every_value_where_ggufs_layout_reads_it():
    """The packing alone: row c of the identity is one-hot at column c of one super-block, so each
    row exercises one position of the low-nibble, high-bit and sub-block-scale fields; gguf must
    read every row back one-hot at its own column (1 within d's f16 rounding, exact zeros elsewhere)."""
    back = gguf_dequantize(quantize_q6_k(torch.eye(256)).numpy(), Q.Q6_K)
    assert np.array_equal(back != 0, np.eye(256, dtype=bool))
    assert np.abs(np.diag(back) - 1.0).max() < 1e-3


def test_q4_k_quantizer_round_trips_through_ggufs_dequantizer():
    """Blocks that gguf's own dequantizer reads back exactly as ours does, within the format's error:
    half a sub-block's step (its span / 30, at most 1/15 of the super-block's largest magnitude)
    plus the 6-bit fields' rounding, with every byte field exercised (all eight sub-blocks' scales
    and mins differ)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 512, generator=g) * torch.linspace(0.1, 3.0, 16).repeat_interleave(32)  # sub-block spans differ
    raw = quantize_q4_k(w)
    assert raw.shape == (6, 2 * 144) and raw.dtype == torch.uint8
    back = torch.from_numpy(gguf_dequantize(raw.numpy(), Q.Q4_K)).reshape(6, 512)
    assert torch.equal(back, dequantize(raw, Q.Q4_K, (6, 512)))
    span = w.reshape(-1, 256).abs().amax(-1, keepdim=True)  # [super-blocks, 1]
    assert ((back - w).reshape(-1, 256).abs() / span).max() < 0.08
    with pytest.raises(ValueError, match="multiples of 256"):
        quantize_q4_k(torch.zeros(2, 300))


def _types(model: nn.Module) -> dict[str, str]:
    return {name: m.qtype.name for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_q4km_shapes_hold_the_llama_cpp_type_of_every_linear():
    model, _ = random_target("random:tiny-q4km")
    types = _types(model)
    # Every linear is kept in blocks, and the embedding in Q4_K blocks, as a keep-quantized load
    # holds a Q4_K_M file's token_embd; without keep_quantized the embedding is a dense table.
    assert len(types) == 1 + 4 * 7 and isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.qtype == Q.Q4_K
    dense, _ = random_target("random:tiny-q4km", keep_quantized=False)
    assert isinstance(dense.embed_tokens, nn.Embedding)
    ids = torch.arange(model.embed_tokens.num_embeddings)
    assert torch.equal(dense.embed_tokens(ids), model.embed_tokens(ids))
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
    others = sum(p.numel() * 2 for n, p in model.named_parameters())  # norms, conv, ... (the embedding's blocks are buffers: a step reads one row)
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


@pytest.mark.parametrize("name", ["tiny-q4km", "tiny-qwen35-q4km"])
def test_quantized_head_is_the_permuted_embedding_in_q6_k_blocks_and_the_draft_borrows_it(name):
    """The target's Q6_K head holds row j = embedding of token perm[j]; the draft worker borrows the
    very same blocks of both (keep-quantized) or their dequantized values (not)."""
    model, config = random_target(f"random:{name}")
    embed, kept, _ = random_target_head(f"random:{name}", keep_quantized=True)
    table, head, _ = random_target_head(f"random:{name}")
    assert isinstance(embed, QuantEmbedding) and torch.equal(embed.raw, model.embed_tokens.raw)
    ids = torch.arange(config.vocab_size)
    assert torch.equal(table, model.embed_tokens(ids))
    assert isinstance(kept, QuantLinear) and kept.qtype == Q.Q6_K and torch.equal(kept.raw, model.lm_head.raw)
    assert torch.equal(head, dequantize(model.lm_head.raw, Q.Q6_K, tuple(head.shape)))
    permuted = table[_permutation(config, "cpu")]
    assert ((head - permuted).norm(dim=1) / permuted.norm(dim=1)).max() < 0.03
    draft, draft_config = random_draft(f"random:{name}-dflash")
    assert draft_config.vocab_size == config.vocab_size and all(torch.isfinite(p).all() for p in draft.parameters())


@pytest.mark.parametrize("name", ["tiny", "tiny-q4km", "tiny-qwen35", "tiny-qwen35-q4km"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_position_continues_with_its_own_token_by_a_wide_margin(name, dtype):
    """Greedy output is perm^-1(x) after token x, by a margin (top logit less the runner-up) of over
    half the top logit, about hidden: far beyond any difference between kernel paths (bf16 rounding
    of a logit of that size is under 1%); a random head would have near-ties everywhere."""
    model, config = random_target(f"random:{name}", dtype=dtype)
    inverse = torch.argsort(_permutation(config, "cpu"))
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(64, "cpu", dtype)
    logits, _ = model(tokens, torch.arange(40), cache, 0, torch.ones(40, 40, dtype=torch.bool).tril())
    top = logits.float().topk(2, dim=-1).values
    assert torch.equal(logits.argmax(-1), inverse[tokens])
    assert ((top[:, 0] - top[:, 1]) > 0.5 * top[:, 0]).all()


def _kernel_path_logits() -> dict:
    """Run under TRITON_INTERPRET=1 SPLITSPEC_NATIVE_CPU=1 (see the test below): tiny-q4km's final
    hidden states over a prompt (the trunk on the torch references: SPLITSPEC_NATIVE=0 while it
    runs), then its Q6_K head through the GEMV kernel (one row a call, M = 1) and through the
    tl.dot kernel (all rows in one call), in float16."""
    from native.gguf_matmul import default_tiling, gguf_matmul

    model, config = random_target("random:tiny-q4km")
    tokens = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    hidden = []
    model.lm_head.register_forward_hook(lambda module, args, out: hidden.append(args[0]))
    os.environ["SPLITSPEC_NATIVE"] = "0"
    model(tokens, torch.arange(6), model.new_cache(8, "cpu", torch.float32), 0, torch.ones(6, 6, dtype=torch.bool).tril())
    del os.environ["SPLITSPEC_NATIVE"]
    h = hidden[0].half()  # [6, hidden]
    raw, n = model.lm_head.raw, config.vocab_size
    assert default_tiling(1, Q.Q6_K).gemv and not default_tiling(len(h), Q.Q6_K).gemv
    gemv = torch.cat([gguf_matmul(h[i : i + 1], raw, Q.Q6_K, n) for i in range(len(h))]).float()
    dot = gguf_matmul(h, raw, Q.Q6_K, n).float()
    top = dot.topk(2, dim=-1).values
    return {
        "expected": torch.argsort(_permutation(config, "cpu"))[tokens].tolist(),
        "gemv": gemv.argmax(-1).tolist(), "dot": dot.argmax(-1).tolist(),
        "path_difference": (gemv - dot).abs().max().item(), "margin": (top[:, 0] - top[:, 1]).min().item(),
    }


def test_greedy_output_is_the_same_through_the_gemv_and_the_dot_kernel():
    """The benchmark's oracle rows rely on it: the M = 1 GEMV kernel and the M > 1 tl.dot kernel
    round differently, and the structured head's margin dwarfs that difference."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0; the CPU interpreter runs this)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPLITSPEC_NATIVE_CPU": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["gemv"] == result["dot"] == result["expected"]
    assert 0 < result["path_difference"] and result["margin"] > 50 * result["path_difference"]


@pytest.mark.parametrize("name", ["tiny-q4km", "tiny-qwen35-q4km"])
def test_without_keep_quantized_the_same_blocks_are_dequantized(name):
    """``keep_quantized=False`` (a benchmark worker without --keep-quantized) holds every linear as
    an nn.Linear of the blocks' values, as a load of a Q4_K_M file without it does: the same logits
    as the kept model, whose QuantLinears dequantize the same blocks on the CPU."""
    kept, config = random_target(f"random:{name}")
    plain, _ = random_target(f"random:{name}", keep_quantized=False)
    assert not _types(plain) and isinstance(plain.lm_head, nn.Linear)
    assert torch.equal(plain.lm_head.weight, dequantize(kept.lm_head.raw, Q.Q6_K, tuple(plain.lm_head.weight.shape)))
    tokens = torch.tensor([3, 77, 150, 9])
    outputs = [
        m(tokens, torch.arange(4), m.new_cache(8, "cpu", torch.float32), 0, torch.ones(4, 4, dtype=torch.bool).tril())[0]
        for m in (kept, plain)
    ]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-4)


def test_quant_types_are_those_the_model_holds():
    assert quant_types("random:qwen35-27b-q4km") == [Q.Q4_K, Q.Q6_K] == quant_types("random:tiny-q4km")
    assert quant_types("random:qwen3-8b") == []
    assert set(quant_types("random:tiny-qwen35-q4km")) == {Q.Q4_K, Q.Q6_K}


if __name__ == "__main__":  # the interpreter half of test_greedy_output_is_the_same_through_the_gemv_and_the_dot_kernel
    sys.path.insert(0, str(Path(__file__).parents[2]))
    print(json.dumps(_kernel_path_logits()))
