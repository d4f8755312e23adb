"""Random weights of real model shapes — FOR BENCHMARKS ONLY, never for serving users.

``random:NAME`` is accepted wherever a target or draft path is: the benchmark machines have no
network and no model files, and a step's speed depends on shapes, dtypes and kernels, not on the
values. The weights are drawn on the device itself, so a 16 GB model appears in a second instead
of being written to and read from disk. Nothing about them is meaningful: a random target's
greedy output is a fixed permutation of its input tokens, and a random draft accepts almost nothing.
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


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue  # see random_target_head
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                # Small writes into the residual stream keep each position's own token embedding
                # dominant there, so the next token is decided by a wide margin (see the head).
                std = RESIDUAL_WRITE_STD if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.normal_(0.0, std, generator=generator)


RESIDUAL_WRITE_STD = 1e-4


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def random_target(path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> tuple[DenseForCausalLM, DenseConfig]:
    config = random_target_config(path)
    with torch.device(device):
        model = DenseForCausalLM(config).to(dtype)
    embed, head, _ = random_target_head(path, device, dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    _randomize(model, _generator(device, 1))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.fuse_projections()
    return model.eval(), config


def random_target_head(path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, DenseConfig]:
    """Embedding [vocab, hidden] and LM head: head row ``j`` is the embedding of token ``perm[j]``
    for a fixed random permutation, so the model continues token ``x`` with ``perm^-1(x)``
    by a margin that no rounding difference between a tree pass and a single-token pass can flip:
    greedy output is the same on every path, which the replay benchmark relies on. (Tied shapes
    repeat the last token.) Seeded, so the draft worker draws the same tensors as the target."""
    config = random_target_config(path)
    embed = torch.randn((config.vocab_size, config.hidden_size), device=device, generator=_generator(device, 0)).to(dtype)
    if config.tie_word_embeddings:
        return embed, embed, config
    perm = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0)).to(device)
    return embed, embed[perm], config


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
    _randomize(model, _generator(device, 2))
    model.fuse_projections()
    return model.eval(), config
