"""The Qwen3.5 hybrid target against transformers' ``Qwen3_5ForCausalLM`` on the same random weights,
loaded from a GGUF written with llama.cpp's converter transforms and from a Hugging Face directory."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from splitspec.fixtures.tiny import TinySpec
from splitspec.fixtures.tiny_qwen35 import qwen35_hf_weights, qwen35_to_gguf, tiny_qwen35_config, write_qwen35_gguf
from splitspec.models.gguf_file import GGUFFile, ModelFileError
from splitspec.models.loader import load_target, load_target_head, read_target_config
from splitspec.models.qwen35 import Qwen35Config, TreeRows, tree_node_bytes, tree_row_bytes
from splitspec.models.qwen35_loader import tiled_v_head_order
from splitspec.text.tokenizer import byte_level_vocab

transformers = pytest.importorskip("transformers")

# 8 layers: two full-attention layers (3 and 7); three value heads per key head.
SPEC = TinySpec(architecture="qwen35", target_layers=8, linear_num_key_heads=2, linear_num_value_heads=6, seed=3)


def _causal(n: int, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + n)
    return torch.arange(start + n)[None, :] <= positions[:, None]


def hf_config(c: Qwen35Config):
    return transformers.Qwen3_5TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.conv_kernel, full_attention_interval=c.full_attention_interval,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.rotary_dim / c.head_dim,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        max_position_embeddings=c.max_context, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One set of random weights as a transformers model, a GGUF and a Hugging Face directory."""
    out = tmp_path_factory.mktemp("qwen35")
    vocab = byte_level_vocab()
    config = tiny_qwen35_config(SPEC, len(vocab.tokens))
    hf_weights = qwen35_hf_weights(config, np.random.default_rng(SPEC.seed), SPEC.weight_scale)
    hf = transformers.Qwen3_5ForCausalLM(hf_config(config)).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in hf_weights.items()}, strict=True)
    hf.save_pretrained(out / "hf")
    gguf_weights = qwen35_to_gguf(config, hf_weights)
    write_qwen35_gguf(out / "target.gguf", config, gguf_weights, vocab, "f32")
    return {"hf": hf, "config": config, "hf_weights": hf_weights, "gguf_weights": gguf_weights, "dir": out}


@pytest.fixture(scope="module", params=["gguf", "hf-dir"])
def pair(request, checkpoint):
    path = checkpoint["dir"] / ("target.gguf" if request.param == "gguf" else "hf")
    ours, config = load_target(path)
    assert dataclasses.replace(config, rms_norm_eps=1e-6) == checkpoint["config"]  # GGUF stores eps as float32
    return checkpoint["hf"], ours, config


def test_prefill_logits_match_transformers(pair):
    hf, ours, config = pair
    n = 70  # two chunks of the chunked delta rule
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    logits, _ = ours(ids, torch.arange(n), ours.new_cache(n, "cpu", torch.float32), 0, _causal(n))
    assert (logits - ref).abs().max().item() < 1e-4


def test_step_by_step_logits_match_transformers(pair):
    hf, ours, config = pair
    n, prompt = 24, 5
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = hf(ids[None]).logits[0]
        hf_cache = transformers.DynamicCache(config=hf.config)
        hf(ids[None, :prompt], cache=hf_cache, use_cache=True)
    cache = ours.new_cache(n, "cpu", torch.float32)
    ours(ids[:prompt], torch.arange(prompt), cache, 0, _causal(prompt))
    for t in range(prompt, n):
        step, _ = ours(ids[t : t + 1], torch.tensor([t]), cache, t, _causal(1, t))
        with torch.no_grad():
            hf_step = hf(ids[None, t : t + 1], cache=hf_cache, use_cache=True).logits[0, -1]
        assert (step[0] - full[t]).abs().max().item() < 1e-4
        assert (step[0] - hf_step).abs().max().item() < 1e-4


def test_tap_features_are_layer_outputs(pair):
    hf, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
    _, features = ours(ids, torch.arange(6), ours.new_cache(8, "cpu", torch.float32), 0, _causal(6), taps=(3, 1))
    assert (features - torch.cat([hidden[4][0], hidden[2][0]], dim=-1)).abs().max().item() < 1e-4


def test_draft_reads_the_target_head(pair, checkpoint):
    for path in (checkpoint["dir"] / "target.gguf", checkpoint["dir"] / "hf"):
        embed, head, config = load_target_head(path)
        assert torch.equal(embed, torch.from_numpy(checkpoint["hf_weights"]["model.embed_tokens.weight"]))
        assert torch.equal(head, torch.from_numpy(checkpoint["hf_weights"]["lm_head.weight"]))
        assert read_target_config(path).architecture == config.architecture == "qwen35"


def test_gguf_holds_the_converter_layout(checkpoint):
    """Tiled value heads (GGUF position p pairs with key head p % Hk), +1 norms, -exp(A_log), squeezed conv."""
    assert tiled_v_head_order(2, 6).tolist() == [0, 3, 1, 4, 2, 5]
    c, hf, gguf = checkpoint["config"], checkpoint["hf_weights"], checkpoint["gguf_weights"]
    hk, hv, dv, groups = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_num_value_heads // c.linear_num_key_heads
    qk = 2 * c.key_dim
    p = "model.layers.0.linear_attn."
    for pos in range(hv):
        head = (pos % hk) * groups + pos // hk  # the HF head at GGUF position pos; it reads key head pos % hk
        rows, hf_rows = slice(pos * dv, (pos + 1) * dv), slice(head * dv, (head + 1) * dv)
        assert np.array_equal(gguf["blk.0.attn_qkv.weight"][qk:][rows], hf[p + "in_proj_qkv.weight"][qk:][hf_rows])
        assert np.array_equal(gguf["blk.0.ssm_conv1d.weight"][qk:][rows], hf[p + "conv1d.weight"][qk:, 0][hf_rows])
        assert np.array_equal(gguf["blk.0.attn_gate.weight"][rows], hf[p + "in_proj_z.weight"][hf_rows])
        assert np.array_equal(gguf["blk.0.ssm_out.weight"][:, rows], hf[p + "out_proj.weight"][:, hf_rows])
        assert np.array_equal(gguf["blk.0.ssm_alpha.weight"][pos], hf[p + "in_proj_a.weight"][head])
        assert np.array_equal(gguf["blk.0.ssm_beta.weight"][pos], hf[p + "in_proj_b.weight"][head])
        assert np.array_equal(gguf["blk.0.ssm_dt.bias"][pos], hf[p + "dt_bias"][head])
        assert np.allclose(gguf["blk.0.ssm_a"][pos], -np.exp(hf[p + "A_log"][head]))
    assert np.array_equal(gguf["blk.0.attn_qkv.weight"][:qk], hf[p + "in_proj_qkv.weight"][:qk])  # q, k untouched
    assert np.allclose(gguf["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    assert np.allclose(gguf["blk.3.attn_q_norm.weight"], hf["model.layers.3.self_attn.q_norm.weight"] + 1)
    assert np.array_equal(gguf["blk.0.ssm_norm.weight"], hf[p + "norm.weight"])  # the gated norm is plain
    assert np.array_equal(gguf["blk.3.attn_q.weight"], hf["model.layers.3.self_attn.q_proj.weight"])  # [q | gate] per head


def test_tree_node_bytes_of_the_27b_geometry():
    big = Qwen35Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
        head_dim=256, rotary_dim=64, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    assert (big.num_linear_layers, big.num_full_layers, big.conv_channels) == (48, 16, 10240)
    f32 = tree_node_bytes(big, torch.bfloat16, torch.float32)
    bf16 = tree_node_bytes(big, torch.bfloat16, torch.bfloat16)
    assert f32.recurrent == 48 * 48 * 128 * 128 * 4 == 150_994_944  # spec 3.7: 3.1 MB per layer
    assert bf16.recurrent == 75_497_472  # spec 3.7: 75.5 MB per verify token in 16 bits
    assert f32.conv == 48 * 10240 * 2 and f32.kv == 16 * 2 * 4 * 256 * 2
    assert bf16.total == 75_497_472 + 983_040 + 65_536


def test_tree_rows_kept_for_a_recomputed_commit_of_the_27b_geometry(checkpoint):
    """A served tree pass keeps each row's conv input and delta-rule inputs (TreeRows), not its
    state: at the 27B geometry (bfloat16 compute) 1.98 MB a row against 151 MB of float32 state,
    so a budget-22 tree (23 rows) keeps 45.6 MB instead of 3.47 GB."""
    big = Qwen35Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
        head_dim=256, rotary_dim=64, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    row = tree_row_bytes(big, torch.bfloat16)
    assert row == 48 * (10240 * 2 + 16 * 128 * 4 + 48 * 128 * 2 + 2 * 48 * 4) == 1_984_512
    state = tree_node_bytes(big, torch.bfloat16, torch.float32).recurrent
    assert 23 * state == 3_472_883_712 and 23 * row == 45_643_776 and state // row == 76
    # The count is what TreeRows allocates.
    rows = TreeRows.empty(checkpoint["config"], 5, torch.device("cpu"), torch.float32)
    allocated = sum(x.nbytes for x in (rows.conv_inputs, rows.keys, rows.values, rows.decays, rows.betas))
    assert allocated == 5 * tree_row_bytes(checkpoint["config"], torch.float32)


def test_bad_hf_config_names_the_key(checkpoint, tmp_path):
    directory = tmp_path / "bad"
    directory.mkdir()
    raw = json.loads((checkpoint["dir"] / "hf" / "config.json").read_text())
    del raw["linear_num_value_heads"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError, match="missing key 'linear_num_value_heads'"):
        read_target_config(directory)


def test_gguf_that_contradicts_its_metadata_names_the_tensor(checkpoint, tmp_path):
    broken = dataclasses.replace(checkpoint["config"], linear_num_value_heads=4)  # the weights have 6
    write_qwen35_gguf(tmp_path / "bad.gguf", broken, checkpoint["gguf_weights"], byte_level_vocab(), "f32")
    with pytest.raises(ModelFileError, match=r"bad.gguf: tensor 'blk\.0\.\w+\.weight' has shape"):
        load_target(tmp_path / "bad.gguf")
    assert GGUFFile(tmp_path / "bad.gguf").architecture == "qwen35"
