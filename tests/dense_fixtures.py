"""Tiny random Llama / Qwen2 / Qwen3 checkpoints built by ``transformers``, and their GGUF conversions.

The GGUF writer follows llama.cpp's converter: GGUF tensor names, q/k rows permuted for ``llama``,
Llama 3.1 RoPE scaling as a ``rope_freqs`` tensor, linear scaling as metadata, an output tensor
only when the embeddings are untied. Quant types are llama.cpp's names; ``q4_k_m`` mixes types the
way llama.cpp's Q4_K_M preset does (Q6_K for the output, attn_v and ffn_down, Q4_K elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from splitspec.fixtures.gguf_writing import encoder
from splitspec.fixtures.tiny import gguf_weights, write_target_gguf
from splitspec.models.dense import DenseConfig
from splitspec.models.layers import llama3_freq_factors
from splitspec.text.tokenizer import byte_level_vocab
from tests.kquants import quantize_k

ARCHITECTURES = ("llama", "qwen2", "qwen3")
QUANT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_k_m")
_K = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}


def hf_model(arch: str, *, tie: bool = False, rope: dict | None = None, seed: int = 0, layers: int = 2, vocab_size: int | None = None):
    """A transformers model of ``arch`` with every weight random (biases and norms too).

    Rows are 256 wide (hidden and intermediate sizes multiples of 256) so that K-quants apply, and
    head_dim = hidden / heads because transformers' GGUF loader assumes it (and, for qwen3, its
    default of 128: it ignores attention.key_length)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[arch]
    theta = 10_000.0
    config = config_class(
        vocab_size=vocab_size or len(byte_level_vocab().tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        **({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128} if arch == "qwen3"
           else {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}), max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, rope_parameters={"rope_theta": theta, "rope_type": "default", **(rope or {})},
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.06 * torch.randn_like(p))
    return model


def dense_config(model) -> DenseConfig:
    """The DenseConfig a converter would describe for ``model`` (RoPE scaling left to the writer)."""
    c = model.config
    return DenseConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rope_theta=c.rope_parameters["rope_theta"], rms_norm_eps=c.rms_norm_eps,
        max_context=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        qk_norm=c.model_type == "qwen3", attention_bias=c.model_type == "qwen2", architecture=c.model_type,
    )


def quant_encoder(quant: str):
    """GGUF encoding for ``quant`` (see the module docstring); 1-D tensors stay F32."""
    if quant not in _K and quant != "q4_k_m":
        return encoder(quant)

    def encode(name: str, array: np.ndarray):
        if array.ndim == 1:
            return array, Q.F32
        if quant == "q4_k_m":
            qtype = Q.Q6_K if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")) else Q.Q4_K
        else:
            qtype = _K[quant]
        return quantize_k(array, qtype), qtype

    return encode


def write_gguf(model, path: Path, quant: str) -> Path:
    """Convert ``model`` to a GGUF at ``path`` with weights in ``quant``."""
    config = dense_config(model)
    state = {k.removeprefix("model."): v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    weights = gguf_weights(config, state)
    rope = model.config.rope_parameters
    if rope["rope_type"] == "llama3":
        weights["rope_freqs.weight"] = np.array(
            llama3_freq_factors(config.head_dim, config.rope_theta, rope["factor"], rope["low_freq_factor"],
                                rope["high_freq_factor"], rope["original_max_position_embeddings"]),
            np.float32,
        )
    linear = rope["factor"] if rope["rope_type"] == "linear" else None
    pre = "llama-bpe" if config.architecture == "llama" else "qwen2"
    write_target_gguf(path, config, weights, byte_level_vocab(), quant_encoder(quant), tokenizer_pre=pre, rope_scaling_factor=linear)
    return path
