"""Random weights of real model shapes — FOR BENCHMARKS ONLY, never for serving users.

``random:NAME`` is accepted wherever a target or draft path is: the benchmark machines have no
network and no model files, and a step's speed depends on shapes, dtypes and kernels, not on the
values. The weights are drawn on the device itself (normal, std 0.02), so a 16 GB model appears
in a second instead of being written to and read from disk. Nothing about them is meaningful:
a random target's greedy output is arbitrary, and a random draft accepts almost nothing.
"""

from __future__ import annotations

import os

import torch

from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.models.dflash import DFlashConfig, DFlashDraft, default_target_layer_ids

PREFIX = "random:"

# Geometries of published checkpoints (their config.json), used only for their shapes.
TARGETS = {
    "qwen3-8b": DenseConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, max_context=40960,
    ),
    "qwen3-0.6b": DenseConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, max_context=40960, tie_word_embeddings=True,
    ),
    # Small enough for a CPU: how CI runs the benchmark end to end.
    "tiny": DenseConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, max_context=8192,
    ),
}
# Drafts: NAME-dflash is a 5-layer DFlash draft of target NAME (the z-lab Qwen3-8B draft's depth).
DRAFT_LAYERS = 5
DRAFT_BLOCK = 16


def is_random(path: str | os.PathLike) -> bool:
    return str(path).startswith(PREFIX)


def _name(path: str | os.PathLike, table: dict) -> str:
    name = str(path).removeprefix(PREFIX)
    if name not in table:
        raise ValueError(f"{path}: unknown random shape; choose one of {', '.join(PREFIX + n for n in table)}")
    return name


def random_target_config(path: str | os.PathLike) -> DenseConfig:
    return TARGETS[_name(path, TARGETS)]


def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, 0.02)


def random_target(path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> tuple[DenseForCausalLM, DenseConfig]:
    config = random_target_config(path)
    with torch.device(device):
        model = DenseForCausalLM(config).to(dtype)
    _randomize(model)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval(), config


def random_target_head(path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, DenseConfig]:
    config = random_target_config(path)
    shape = (config.vocab_size, config.hidden_size)
    embed = torch.randn(shape, device=device, dtype=dtype) * 0.02
    head = embed if config.tie_word_embeddings else torch.randn(shape, device=device, dtype=dtype) * 0.02
    return embed, head, config


def random_draft(path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> tuple[DFlashDraft, DFlashConfig]:
    name = str(path).removeprefix(PREFIX).removesuffix("-dflash")
    if not str(path).endswith("-dflash") or name not in TARGETS:
        raise ValueError(f"{path}: unknown random draft; choose one of {', '.join(PREFIX + n + '-dflash' for n in TARGETS)}")
    t = TARGETS[name]
    layers = DRAFT_LAYERS if t.num_layers >= 2 * DRAFT_LAYERS else 2
    config = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, block_size=DRAFT_BLOCK,
        mask_token_id=t.vocab_size - 1, target_layer_ids=tuple(default_target_layer_ids(t.num_layers, layers)),
        vocab_size=t.vocab_size,
    )
    with torch.device(device):
        model = DFlashDraft(config).to(dtype)
    _randomize(model)
    return model.eval(), config
