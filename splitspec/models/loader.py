"""Load targets and drafts from their on-disk formats into PyTorch modules.

Target: GGUF (architecture ``qwen3``). Draft: the z-lab DFlash layout (``config.json`` +
``model.safetensors``). The draft has no embedding or LM head of its own; it borrows the
target's, read here from the target file (``load_target_head``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file
from tqdm import tqdm

from splitspec.models.dflash import DFlashConfig, DFlashDraft
from splitspec.models.gguf_file import GGUFFile, ModelFileError
from splitspec.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

logger = logging.getLogger(__name__)

# GGUF tensor name -> module parameter name, for the dense Qwen3 family (llama.cpp naming).
QWEN3_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SUPPORTED_TARGET_ARCHS = ("qwen3",)


def qwen3_config_from_gguf(f: GGUFFile) -> Qwen3Config:
    arch = f.architecture
    if arch not in SUPPORTED_TARGET_ARCHS:
        raise ModelFileError(f"{f.path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_TARGET_ARCHS)})")
    vocab_size, hidden = f.tensor_shape("token_embd.weight")
    heads = int(f.get(f"{arch}.attention.head_count"))
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=int(f.get(f"{arch}.embedding_length")),
        intermediate_size=int(f.get(f"{arch}.feed_forward_length")),
        num_layers=int(f.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 1_000_000.0)),
        rms_norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=int(f.get(f"{arch}.context_length", 40960)),
        tie_word_embeddings=not f.has_tensor("output.weight"),
    )


def _progress(items: list, desc: str):
    # tqdm hides itself when stderr is not a terminal (disable=None).
    return tqdm(items, desc=desc, unit="tensor", disable=None, leave=False)


def load_target(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Qwen3ForCausalLM, Qwen3Config]:
    f = GGUFFile(path)
    config = qwen3_config_from_gguf(f)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(config.num_layers):
        for src, dst in QWEN3_LAYER_NAMES.items():
            names[f"blk.{i}.{src}.weight"] = f"layers.{i}.{dst}.weight"
    state = {}
    for src, dst in _progress(list(names.items()), f"loading {f.path.name}"):
        state[dst] = torch.from_numpy(f.tensor(src, expected[dst])).to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval(), config


def load_target_head(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, Qwen3Config]:
    """The target's token embedding [vocab, hidden] and LM head [vocab, hidden], for the draft."""
    f = GGUFFile(path)
    config = qwen3_config_from_gguf(f)
    embed = torch.from_numpy(f.tensor("token_embd.weight")).to(device=device, dtype=dtype)
    head = embed if config.tie_word_embeddings else torch.from_numpy(f.tensor("output.weight")).to(device=device, dtype=dtype)
    return embed, head, config


def load_dflash_draft(
    directory: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[DFlashDraft, DFlashConfig]:
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{config_path}: cannot read draft config ({exc})") from exc
    config = DFlashConfig.from_dict(raw, source=str(config_path))
    try:
        tensors = load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise ModelFileError(f"{weights_path}: cannot read draft weights ({exc})") from exc
    with torch.device("meta"):
        model = DFlashDraft(config)
    state = {}
    for name, param in model.named_parameters():
        if name not in tensors:
            raise ModelFileError(f"{weights_path}: missing tensor {name!r}")
        array = tensors[name]
        if tuple(array.shape) != tuple(param.shape):
            raise ModelFileError(f"{weights_path}: tensor {name!r} has shape {array.shape}, expected {tuple(param.shape)}")
        state[name] = torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval(), config
