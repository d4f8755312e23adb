"""A tiny Qwen3.5 hybrid target in GGUF blocks of several types, for the keep-quantized tests.

Rows are 256 values wide (hidden, intermediate, attention and value widths) so that K-quants
apply. The types vary by layer over each tensor whose value heads the converter tiles, so that
every way of untiling them (rows of blocks moved, inputs gathered) meets Q4_K, Q6_K and Q8_0;
``attn_qkv`` of one layer is Q5_K (llama.cpp's Q4_K_M choice) and one ``ffn_up`` Q5_0, so that
whether a type has a kernel (``native.gguf_matmul.KERNEL_TYPES``) decides, not the loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.numpy import load_file

from splitspec.fixtures.tiny import TinySpec, make_tiny, write_draft_gguf
from splitspec.fixtures.tiny_qwen35 import qwen35_hf_weights, qwen35_to_gguf, tiny_qwen35_config, write_qwen35_gguf
from splitspec.models.dflash import DFlashConfig
from splitspec.text.tokenizer import byte_level_vocab
from tests.kquants import QUANTIZERS, quantize_k

# 4 layers: DeltaNet 0-2, gated attention 3; four value heads per key head, so that the tiled
# order [0, 4, 1, 5, 2, 6, 3, 7] is not its own inverse (with two per key head it would be, and
# tiling where untiling is meant would go unseen).
SPEC = TinySpec(
    architecture="qwen35", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=8, linear_head_dim=32, target_layers=4, draft_layers=2, seed=5,
)
# GGUF tensor name (after ``blk.N.``) -> its type in layers 0, 1, 2 (DeltaNet; layer 3 takes layer 0's).
LAYER_TYPES = {
    "attn_qkv.weight": (Q.Q6_K, Q.Q8_0, Q.Q5_K),
    "attn_gate.weight": (Q.Q4_K, Q.Q6_K, Q.Q8_0),
    "ssm_out.weight": (Q.Q4_K, Q.Q8_0, Q.Q6_K),
    "ssm_alpha.weight": (Q.Q8_0, Q.Q4_K, Q.Q6_K),
    "ssm_beta.weight": (Q.Q4_K, Q.Q6_K, Q.Q8_0),
    "ffn_up.weight": (Q.Q4_K, Q.Q5_0, Q.Q4_K),
}
OTHER_TYPES = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "attn_output.weight": Q.Q8_0}


def file_type(name: str) -> Q:
    """The type this fixture gives the GGUF tensor ``name`` (a matrix)."""
    if name in OTHER_TYPES:
        return OTHER_TYPES[name]
    _, layer, short = name.split(".", 2)
    if short in OTHER_TYPES:
        return OTHER_TYPES[short]
    return LAYER_TYPES[short][int(layer) % 3] if short in LAYER_TYPES else Q.Q4_K


def encode(name: str, array: np.ndarray) -> tuple[np.ndarray, Q]:
    """The fixture's encoder: 1-D tensors F32, matrices in ``file_type``."""
    if array.ndim == 1:
        return array, Q.F32
    qtype = file_type(name)
    return (quantize_k(array, qtype) if qtype in QUANTIZERS else quantize(array, qtype)), qtype


def write_target(path: Path, tied: bool = False) -> Path:
    """The fixture target alone at ``path``; ``tied``: without ``output.weight`` (the head is the embedding)."""
    vocab = byte_level_vocab()
    config = tiny_qwen35_config(SPEC, len(vocab.tokens))
    weights = qwen35_to_gguf(config, qwen35_hf_weights(config, np.random.default_rng(SPEC.seed), SPEC.weight_scale))
    if tied:
        del weights["output.weight"]
    write_qwen35_gguf(path, config, weights, vocab, encode)
    return path


def make_pair(out: Path) -> tuple[Path, Path, Path]:
    """The fixture target with its random DFlash draft, as a z-lab directory and as a Q8_0 GGUF:
    (target.gguf, draft directory, draft.gguf)."""
    target, draft_dir = make_tiny(out, SPEC, encode)
    raw = json.loads((draft_dir / "config.json").read_text())
    config = DFlashConfig.from_dict(raw)
    tensors = load_file(str(draft_dir / "model.safetensors"))
    write_draft_gguf(out / "draft.gguf", config, tensors, "q8_0")
    return target, draft_dir, out / "draft.gguf"
