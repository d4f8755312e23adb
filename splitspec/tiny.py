"""``splitspec make-tiny``: a tiny random target (GGUF, with tokenizer) and a matching DFlash draft.

The target is Qwen3 (``arch="qwen3"``) or the Qwen3.5 hybrid (``arch="qwen35"``: Gated DeltaNet
and gated attention layers). The pair exercises every code path in seconds on a CPU. Its weights
are random, so the draft rarely guesses the target's tokens: expect an acceptance length near 1.

The Qwen3.5 target is drawn in Hugging Face layout and converted the way llama.cpp's
``convert_hf_to_gguf.py`` does (:func:`qwen35_to_gguf`), so the GGUF loader's inverse transforms
are exercised on what real files hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import save_file

from splitspec.models.dflash import DFlashConfig
from splitspec.models.loader import (
    QWEN3_LAYER_NAMES,
    permute_v_heads,
    qwen35_from_hf,
    qwen35_gguf_names,
    qwen35_hf_name,
    tiled_v_head_order,
)
from splitspec.models.qwen3 import Qwen3Config
from splitspec.models.qwen35 import Qwen35Config
from splitspec.tokenizer import byte_level_vocab, write_gguf_tokenizer

TARGET_FILE = "target.gguf"
DRAFT_DIR = "draft"

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEIGHT_TYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
}


TARGET_ARCHS = ("qwen3", "qwen35")


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3"
    hidden_size: int = 64
    target_layers: int = 4
    draft_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    block_size: int = 16
    max_context: int = 4096
    weight_scale: float = 0.08  # std of random matrices; larger makes the target less uniform
    seed: int = 0
    # qwen35 only: Gated DeltaNet geometry (RoPE turns head_dim // 4 dims, as Qwen3.5's 64 of 256).
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    full_attention_interval: int = 4


def _matrices(cfg, hidden_in: int, rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """Random attention + MLP weights of one layer, keyed by module name."""
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    return {
        "input_layernorm": norm(h),
        "self_attn.q_proj": mat(q, hidden_in),
        "self_attn.k_proj": mat(kv, hidden_in),
        "self_attn.v_proj": mat(kv, hidden_in),
        "self_attn.o_proj": mat(h, q),
        "self_attn.q_norm": norm(cfg.head_dim),
        "self_attn.k_norm": norm(cfg.head_dim),
        "post_attention_layernorm": norm(h),
        "mlp.gate_proj": mat(ff, h),
        "mlp.up_proj": mat(ff, h),
        "mlp.down_proj": mat(h, ff),
    }


def _keeps_f32(name: str, array: np.ndarray) -> bool:
    # As llama.cpp's converter: norms, biases, decay rates and the short conv stay F32.
    return array.ndim == 1 or name.endswith("ssm_conv1d.weight")


def _write_gguf(
    path: Path, arch: str, metadata: Callable[[GGUFWriter], None], weights: dict[str, np.ndarray], vocab, weight_type: str
) -> None:
    """Write a GGUF of ``arch`` with the tokenizer; ``weights`` uses GGUF tensor names."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name("splitspec-tiny")
    metadata(writer)
    write_gguf_tokenizer(writer, vocab, chat_template=CHATML_TEMPLATE)
    qtype = WEIGHT_TYPES[weight_type]
    for name, array in weights.items():
        if _keeps_f32(name, array) or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_target_gguf(path: Path, config: Qwen3Config, weights: dict[str, np.ndarray], vocab, weight_type: str) -> None:
    """Write a ``qwen3`` GGUF. ``weights`` uses GGUF tensor names; 1-D tensors stay F32."""

    def metadata(writer: GGUFWriter) -> None:
        writer.add_block_count(config.num_layers)
        writer.add_context_length(config.max_context)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_heads)
        writer.add_head_count_kv(config.num_kv_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)

    _write_gguf(path, "qwen3", metadata, weights, vocab, weight_type)


def write_qwen35_gguf(path: Path, config: Qwen35Config, weights: dict[str, np.ndarray], vocab, weight_type: str) -> None:
    """Write a ``qwen35`` GGUF with the metadata keys of spec 4.1; ``weights`` from :func:`qwen35_to_gguf`."""

    def metadata(writer: GGUFWriter) -> None:
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

    _write_gguf(path, "qwen35", metadata, weights, vocab, weight_type)


def tiny_qwen35_config(spec: TinySpec, vocab_size: int) -> Qwen35Config:
    return Qwen35Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.target_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rotary_dim=spec.head_dim // 4,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        full_attention_interval=spec.full_attention_interval,
        max_context=spec.max_context,
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


def qwen35_to_gguf(config: Qwen35Config, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's converter transforms (spec 4.1): GGUF names, norms stored ``w + 1`` (except the
    gated norm), ``ssm_a = -exp(A_log)``, the conv weight squeezed to [C, K], value heads tiled."""
    tile = tiled_v_head_order(config.linear_num_key_heads, config.linear_num_value_heads)
    out = {}
    for name, gguf_name in qwen35_gguf_names(config).items():
        array = qwen35_from_hf(name, torch.from_numpy(hf[qwen35_hf_name(name, "model.")])).numpy()
        out[gguf_name] = permute_v_heads(array, gguf_name.split(".", 2)[-1], tile, config)
    return out


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec(), weight_type: str = "f32") -> tuple[Path, Path]:
    """Write ``out_dir/target.gguf`` and ``out_dir/draft/`` and return their paths."""
    if spec.arch not in TARGET_ARCHS:
        raise ValueError(f"arch {spec.arch!r} is not one of {', '.join(TARGET_ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = byte_level_vocab()
    target_path = out / TARGET_FILE
    if spec.arch == "qwen35":
        target = tiny_qwen35_config(spec, len(vocab.tokens))
        write_qwen35_gguf(target_path, target, qwen35_to_gguf(target, qwen35_hf_weights(target, rng, spec.weight_scale)), vocab, weight_type)
    else:
        target = _write_tiny_qwen3(target_path, spec, rng, vocab, weight_type)
    _write_tiny_draft(out / DRAFT_DIR, spec, target, rng, vocab)
    return target_path, out / DRAFT_DIR


def _write_tiny_qwen3(path: Path, spec: TinySpec, rng: np.random.Generator, vocab, weight_type: str) -> Qwen3Config:
    target = Qwen3Config(
        vocab_size=len(vocab.tokens),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.target_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_context=spec.max_context,
    )
    weights = {
        "token_embd.weight": rng.standard_normal((target.vocab_size, target.hidden_size)).astype(np.float32),
        "output_norm.weight": np.ones(target.hidden_size, np.float32),
        "output.weight": (rng.standard_normal((target.vocab_size, target.hidden_size)) * 0.2).astype(np.float32),
    }
    gguf_names = {dst: src for src, dst in QWEN3_LAYER_NAMES.items()}
    for i in range(target.num_layers):
        for name, array in _matrices(target, target.hidden_size, rng, spec.weight_scale).items():
            weights[f"blk.{i}.{gguf_names[name]}.weight"] = array
    write_target_gguf(path, target, weights, vocab, weight_type)
    return target


def _write_tiny_draft(draft_dir: Path, spec: TinySpec, target: Qwen3Config | Qwen35Config, rng: np.random.Generator, vocab) -> None:
    draft = DFlashConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.draft_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        mask_token_id=vocab.special_ids["<|mask|>"],
        target_layer_ids=tuple(range(1, target.num_layers))[: spec.draft_layers],  # one tap per draft layer
        vocab_size=target.vocab_size,
    )
    tensors = {
        "fc.weight": (rng.standard_normal((spec.hidden_size, draft.num_taps * spec.hidden_size)) * spec.weight_scale).astype(np.float32),
        "hidden_norm.weight": np.ones(spec.hidden_size, np.float32),
        "norm.weight": np.ones(spec.hidden_size, np.float32),
    }
    for i in range(draft.num_layers):
        for name, array in _matrices(draft, spec.hidden_size, rng, spec.weight_scale).items():
            tensors[f"layers.{i}.{name}.weight"] = array
    draft_dir.mkdir(exist_ok=True)
    save_file(tensors, str(draft_dir / "model.safetensors"))
    (draft_dir / "config.json").write_text(json.dumps(draft.to_dict(target.num_layers), indent=2) + "\n")
