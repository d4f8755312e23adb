"""``splitspec make-tiny``: a tiny random Qwen3 target (GGUF, with tokenizer) and a matching DFlash draft.

The pair exercises every code path in seconds on a CPU. Its weights are random, so the draft
rarely guesses the target's tokens: expect an acceptance length near 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import save_file

from splitspec.models.dflash import DFlashConfig
from splitspec.models.loader import QWEN3_LAYER_NAMES
from splitspec.models.qwen3 import Qwen3Config
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


@dataclass(frozen=True)
class TinySpec:
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


def write_target_gguf(path: Path, config: Qwen3Config, weights: dict[str, np.ndarray], vocab, weight_type: str) -> None:
    """Write a ``qwen3`` GGUF. ``weights`` uses GGUF tensor names; 1-D tensors stay F32."""
    writer = GGUFWriter(str(path), "qwen3")
    writer.add_name("splitspec-tiny")
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
    write_gguf_tokenizer(writer, vocab, chat_template=CHATML_TEMPLATE)
    qtype = WEIGHT_TYPES[weight_type]
    for name, array in weights.items():
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec(), weight_type: str = "f32") -> tuple[Path, Path]:
    """Write ``out_dir/target.gguf`` and ``out_dir/draft/`` and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = byte_level_vocab()
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
    target_path = out / TARGET_FILE
    write_target_gguf(target_path, target, weights, vocab, weight_type)

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
    draft_dir = out / DRAFT_DIR
    draft_dir.mkdir(exist_ok=True)
    save_file(tensors, str(draft_dir / "model.safetensors"))
    (draft_dir / "config.json").write_text(json.dumps(draft.to_dict(target.num_layers), indent=2) + "\n")
    return target_path, draft_dir
