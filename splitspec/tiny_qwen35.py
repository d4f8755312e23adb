"""The tiny random Qwen3.5 hybrid target of ``splitspec make-tiny --architecture qwen35``.

Weights are drawn in Hugging Face's layout (``Qwen3_5ForCausalLM``) and put through llama.cpp's
converter transforms, so that loading them exercises the inverse transforms of the real files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from splitspec.models.qwen35 import Qwen35Config
from splitspec.models.qwen35_loader import permute_v_heads, qwen35_from_hf, qwen35_gguf_names, qwen35_hf_name, tiled_v_head_order
from splitspec.tiny import CHATML_TEMPLATE, encoder, finish_gguf
from splitspec.tokenizer import write_gguf_tokenizer


def tiny_qwen35_config(spec, vocab_size: int) -> Qwen35Config:
    """The hybrid geometry of a ``TinySpec`` (RoPE turns head_dim // 4 dims, as Qwen3.5's 64 of 256)."""
    return Qwen35Config(
        **spec.target_geometry(vocab_size),
        rotary_dim=spec.head_dim // 4,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        full_attention_interval=spec.full_attention_interval,
    )


def qwen35_hf_weights(config: Qwen35Config, rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """Random weights of a ``Qwen3_5ForCausalLM`` in its own names and layout: zero-centred norms,
    ``A_log``, ``conv1d.weight`` [C, 1, K], value heads grouped by key head."""
    c = config

    def mat(rows: int, cols: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def vec(dim: int, mean: float, std: float) -> np.ndarray:
        return (mean + std * rng.standard_normal(dim)).astype(np.float32)

    h, nv = c.hidden_size, c.linear_num_value_heads
    weights = {"model.embed_tokens.weight": mat(c.vocab_size, h, 1.0), "model.norm.weight": vec(h, 0.0, 0.1), "lm_head.weight": mat(c.vocab_size, h, 0.2)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": vec(h, 0.0, 0.1),
            p + "post_attention_layernorm.weight": vec(h, 0.0, 0.1),
            p + "mlp.gate_proj.weight": mat(c.intermediate_size, h),
            p + "mlp.up_proj.weight": mat(c.intermediate_size, h),
            p + "mlp.down_proj.weight": mat(h, c.intermediate_size),
        }
        if c.is_full_attention(i):
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            weights |= {
                p + "self_attn.q_proj.weight": mat(2 * q, h),
                p + "self_attn.k_proj.weight": mat(kv, h),
                p + "self_attn.v_proj.weight": mat(kv, h),
                p + "self_attn.o_proj.weight": mat(h, q),
                p + "self_attn.q_norm.weight": vec(c.head_dim, 0.0, 0.1),
                p + "self_attn.k_norm.weight": vec(c.head_dim, 0.0, 0.1),
            }
        else:
            weights |= {
                p + "linear_attn.in_proj_qkv.weight": mat(c.conv_channels, h),
                p + "linear_attn.in_proj_z.weight": mat(c.value_dim, h),
                p + "linear_attn.in_proj_b.weight": mat(nv, h, 0.5),
                p + "linear_attn.in_proj_a.weight": mat(nv, h, 0.5),
                p + "linear_attn.conv1d.weight": (rng.standard_normal((c.conv_channels, 1, c.conv_kernel)) * 0.5).astype(np.float32),
                p + "linear_attn.dt_bias": vec(nv, 0.0, 0.5),
                p + "linear_attn.A_log": np.log(rng.uniform(0.5, 4.0, nv)).astype(np.float32),
                p + "linear_attn.norm.weight": vec(c.linear_value_head_dim, 1.0, 0.1),
                p + "linear_attn.out_proj.weight": mat(h, c.value_dim),
            }
    return weights


def write_qwen35_gguf(path: Path, config: Qwen35Config, weights: dict[str, np.ndarray], vocab, weight_type: str) -> None:
    """Write a ``qwen35`` GGUF with the metadata keys of spec 4.1; ``weights`` from :func:`qwen35_to_gguf`.
    As llama.cpp's converter, the short conv stays F32 whatever ``weight_type`` says."""
    base = encoder(weight_type)

    def encode(name: str, array: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType]:
        return (array, GGMLQuantizationType.F32) if name.endswith("ssm_conv1d.weight") else base(name, array)

    writer = GGUFWriter(str(path), "qwen35")
    writer.add_name("splitspec-tiny")
    c = config
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_context)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_full_attention_interval(c.full_attention_interval)
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_inner_size(c.value_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_rope_dimension_count(c.rotary_dim)
    # M-RoPE sections ([11, 11, 10, 0] for 64 dims): unused for text, written as real files have them.
    third = -(-c.rotary_dim // 6)
    writer.add_rope_dimension_sections([third, third, c.rotary_dim // 2 - 2 * third, 0])
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    write_gguf_tokenizer(writer, vocab, chat_template=CHATML_TEMPLATE)
    finish_gguf(writer, weights, encode)


def qwen35_to_gguf(config: Qwen35Config, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's converter transforms (spec 4.1): GGUF names, norms stored ``w + 1`` (except the
    gated norm), ``ssm_a = -exp(A_log)``, the conv weight squeezed to [C, K], value heads tiled."""
    tile = tiled_v_head_order(config.linear_num_key_heads, config.linear_num_value_heads)
    out = {}
    for name, gguf_name in qwen35_gguf_names(config).items():
        array = qwen35_from_hf(name, torch.from_numpy(hf[qwen35_hf_name(name, "model.")])).numpy()
        out[gguf_name] = permute_v_heads(array, gguf_name.split(".", 2)[-1], tile, config)
    return out
