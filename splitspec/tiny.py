"""``splitspec make-tiny``: a tiny random dense target (GGUF, with tokenizer) and a matching DFlash draft.

The target is a ``qwen3`` (q/k norms), ``qwen2`` (q/k/v biases) or ``llama`` (q/k rows permuted
the way llama.cpp's converter stores them) GGUF; ``write_target_gguf`` is also the tests' writer.

The pair exercises every code path in seconds on a CPU. Its weights are random, so the draft
rarely guesses the target's tokens: expect an acceptance length near 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.numpy import save_file

from splitspec.models.dense import DenseConfig
from splitspec.models.dflash import DFlashConfig
from splitspec.models.loader import GGUF_DRAFT_GLOBAL_NAMES, gguf_name
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
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
}
# (GGUF tensor name, float32 array) -> (data as written, its GGUF type).
Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType]]


@dataclass(frozen=True)
class TinySpec:
    architecture: str = "qwen3"  # qwen3 | qwen2 | llama | qwen35
    tie_embeddings: bool = False
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
    # qwen35 only: Gated DeltaNet geometry.
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    full_attention_interval: int = 4

    def target_geometry(self, vocab_size: int) -> dict:
        """The config fields every target family shares."""
        return dict(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.target_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, max_context=self.max_context,
        )


def _matrices(
    cfg, hidden_in: int, rng: np.random.Generator, scale: float, qk_norm: bool = True, bias: bool = False
) -> dict[str, np.ndarray]:
    """Random attention + MLP weights of one layer, keyed by module parameter name."""
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    out = {
        "input_layernorm.weight": norm(h),
        "self_attn.q_proj.weight": mat(q, hidden_in),
        "self_attn.k_proj.weight": mat(kv, hidden_in),
        "self_attn.v_proj.weight": mat(kv, hidden_in),
        "self_attn.o_proj.weight": mat(h, q),
    }
    if qk_norm:
        out["self_attn.q_norm.weight"] = norm(cfg.head_dim)
        out["self_attn.k_norm.weight"] = norm(cfg.head_dim)
    out["post_attention_layernorm.weight"] = norm(h)
    out["mlp.gate_proj.weight"] = mat(ff, h)
    out["mlp.up_proj.weight"] = mat(ff, h)
    out["mlp.down_proj.weight"] = mat(h, ff)
    if bias:
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"self_attn.{name}.bias"] = (rng.standard_normal(rows) * 0.5).astype(np.float32)
    return out


def llama_permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for ``llama`` GGUFs: within each head, row (half, i) moves to (i, half)."""
    per_head = w.shape[0] // heads
    return w.reshape(heads, 2, per_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(config: DenseConfig, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Module-named float weights -> GGUF-named ones, permuting q/k rows for ``llama``."""
    out = {}
    for name, array in state.items():
        if config.architecture == "llama" and ".self_attn.q_proj." in name:
            array = llama_permute_rows(array, config.num_heads)
        elif config.architecture == "llama" and ".self_attn.k_proj." in name:
            array = llama_permute_rows(array, config.num_kv_heads)
        out[gguf_name(name)] = array
    return out


def encoder(weight_type: str) -> Encoder:
    """The writer's encoding for ``--weight-type``: matrices in that type, 1-D tensors in F32."""
    qtype = WEIGHT_TYPES[weight_type]

    def encode(name: str, array: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType]:
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            return array, GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F16:
            return array.astype(np.float16), qtype
        return quantize(array, qtype), qtype

    return encode


def write_target_gguf(
    path: Path,
    config: DenseConfig,
    weights: dict[str, np.ndarray],
    vocab,
    weight_type: str | Encoder = "f32",
    *,
    tokenizer_pre: str = "qwen2",
    eos: str = "<|im_end|>",
    chat_template: str | None = CHATML_TEMPLATE,
    name: str = "splitspec-tiny",
    rope_scaling_factor: float | None = None,
    split_max_tensors: int = 0,
) -> None:
    """Write a GGUF of ``config.architecture``. ``weights`` uses GGUF tensor names (llama.cpp's layout);
    ``weight_type`` names a type or is an :data:`Encoder` choosing one per tensor; ``eos`` names
    the end-of-sequence token of ``vocab`` (its BOS is ``<|endoftext|>``).
    ``rope_scaling_factor`` writes linear RoPE scaling metadata; ``split_max_tensors`` > 0 splits the
    file into parts ``NAME-00001-of-0000N.gguf`` of at most that many tensors, as llama.cpp's gguf-split does."""
    encode = encoder(weight_type) if isinstance(weight_type, str) else weight_type
    writer = GGUFWriter(str(path), config.architecture, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if rope_scaling_factor is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling_factor)
    write_gguf_tokenizer(writer, vocab, eos=eos, pre=tokenizer_pre, chat_template=chat_template)
    finish_gguf(writer, weights, encode)


def finish_gguf(writer: GGUFWriter, weights: dict[str, np.ndarray], encode: Encoder) -> None:
    """Add the GGUF-named ``weights`` as ``encode`` chooses, then write the file(s)."""
    for name, array in weights.items():
        data, qtype = encode(name, array)
        native = qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)  # numpy dtypes gguf knows
        writer.add_tensor(name, data, raw_dtype=None if native else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_target(spec: TinySpec, vocab_size: int, rng: np.random.Generator) -> tuple[DenseConfig, dict[str, np.ndarray]]:
    """A random target of ``spec.architecture``: its config and float weights by module parameter name."""
    arch = spec.architecture
    target = DenseConfig(
        **spec.target_geometry(vocab_size),
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        architecture=arch,
    )
    state = {
        "embed_tokens.weight": rng.standard_normal((target.vocab_size, target.hidden_size)).astype(np.float32),
        "norm.weight": np.ones(target.hidden_size, np.float32),
    }
    if not spec.tie_embeddings:
        state["lm_head.weight"] = (rng.standard_normal((target.vocab_size, target.hidden_size)) * 0.2).astype(np.float32)
    for i in range(target.num_layers):
        layer = _matrices(target, target.hidden_size, rng, spec.weight_scale, target.qk_norm, target.attention_bias)
        state.update((f"layers.{i}.{name}", array) for name, array in layer.items())
    return target, state


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec(), weight_type: str | Encoder = "f32") -> tuple[Path, Path]:
    """Write ``out_dir/target.gguf`` and ``out_dir/draft/`` and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = byte_level_vocab()
    arch = spec.architecture
    target_path = out / TARGET_FILE
    if arch == "qwen35":
        from splitspec import tiny_qwen35

        target = tiny_qwen35.tiny_qwen35_config(spec, len(vocab.tokens))
        weights = tiny_qwen35.qwen35_to_gguf(target, tiny_qwen35.qwen35_hf_weights(target, rng, spec.weight_scale))
        tiny_qwen35.write_qwen35_gguf(target_path, target, weights, vocab, weight_type)
    else:
        target, state = random_target(spec, len(vocab.tokens), rng)
        pre = "llama-bpe" if arch == "llama" else "qwen2"
        write_target_gguf(target_path, target, gguf_weights(target, state), vocab, weight_type, tokenizer_pre=pre)

    draft, tensors = random_draft(target, spec, vocab.special_ids["<|mask|>"], rng)
    draft_dir = out / DRAFT_DIR
    write_draft_dir(draft_dir, draft, tensors, target.num_layers)
    return target_path, draft_dir


def write_draft_dir(path: Path, draft: DFlashConfig, tensors: dict[str, np.ndarray], num_target_layers: int) -> None:
    """A DFlash draft in z-lab's directory layout: ``config.json`` and ``model.safetensors``."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(draft.to_dict(num_target_layers), indent=2) + "\n")


def random_draft(
    target: DenseConfig | Qwen35Config, spec: TinySpec, mask_token_id: int, rng: np.random.Generator
) -> tuple[DFlashConfig, dict[str, np.ndarray]]:
    """A random DFlash draft for ``target`` (one tap per draft layer, from layer 1 on), as z-lab names its tensors."""
    draft = DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.draft_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(range(1, target.num_layers))[: spec.draft_layers],
        vocab_size=target.vocab_size,
    )
    hidden = target.hidden_size
    tensors = {
        "fc.weight": (rng.standard_normal((hidden, draft.num_taps * hidden)) * spec.weight_scale).astype(np.float32),
        "hidden_norm.weight": np.ones(hidden, np.float32),
        "norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(draft.num_layers):
        for name, array in _matrices(draft, hidden, rng, spec.weight_scale).items():
            tensors[f"layers.{i}.{name}"] = array
    return draft, tensors


DRAFT_GGUF_ARCH = "qwen3-dflash-draft"


def write_draft_gguf(path: Path, config: DFlashConfig, tensors: dict[str, np.ndarray], weight_type: str = "f32") -> None:
    """A DFlash draft in the GGUF layout of lucebox's converter: ``dflash.fc.weight``,
    ``dflash.hidden_norm.weight``, ``blk.i.*``, ``output_norm.weight`` and ``ARCH.dflash.*`` metadata
    (plus ``ARCH.dflash.target_layer_ids``, which spares the reader the default tap formula)."""
    arch = DRAFT_GGUF_ARCH
    writer = GGUFWriter(str(path), arch)
    for key, value in [
        ("embedding_length", config.hidden_size), ("feed_forward_length", config.intermediate_size),
        ("block_count", config.num_layers), ("attention.head_count", config.num_heads),
        ("attention.head_count_kv", config.num_kv_heads), ("attention.key_length", config.head_dim),
        ("attention.value_length", config.head_dim), ("dflash.block_size", config.block_size),
        ("dflash.mask_token_id", config.mask_token_id), ("dflash.n_target_layers", config.num_taps),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    if config.vocab_size is not None:
        writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_array(f"{arch}.dflash.target_layer_ids", list(config.target_layer_ids))
    finish_gguf(writer, {gguf_name(name, GGUF_DRAFT_GLOBAL_NAMES): array for name, array in tensors.items()}, encoder(weight_type))
