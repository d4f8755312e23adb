"""Random weights of real model shapes — FOR BENCHMARKS ONLY, never for serving users.

``random:NAME`` names a shape for the benchmark (``splitspec bench``, ``splitspec.bench.workers``,
the GPU scripts): the benchmark machines have no network and no model files, and a step's speed depends on shapes, dtypes and kernels, not on the
values. The weights are drawn on the device itself, so a 16 GB model appears in a second instead
of being written to and read from disk. Nothing about them is meaningful: a random target's
greedy output is a fixed permutation of its input tokens, and a random draft accepts almost nothing.

Shapes (``SHAPES``): dense ``qwen3-8b``, ``qwen3-0.6b``, ``tiny``; hybrid ``qwen35-27b`` and
``tiny-qwen35``; and ``*-q4km`` variants, whose linear layers stay in random GGUF blocks laid out
as llama.cpp's Q4_K_M (``models.quantized.q4_k_m_types``; blocks from ``random_blocks``), held
by ``QuantLinear`` as a ``--keep-quantized`` load holds a real Q4_K_M file. ``NAME-dflash`` is a
DFlash draft for target ``NAME``, in the compute dtype (published drafts are BF16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from native.gguf_dequant import dequantize
from native.gguf_matmul import QuantLinear, row_bytes
from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.models.dflash import DFlashConfig, DFlashDraft, default_target_layer_ids
from splitspec.models.quantized import q4_k_m_types, swap_quant_linears
from splitspec.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

PREFIX = "random:"


@dataclass(frozen=True)
class RandomShape:
    config: DenseConfig | Qwen35Config
    quantized: bool = False  # linear weights as random Q4_K_M-style GGUF blocks
    draft_heads: tuple[int, int, int] | None = None  # the draft's (heads, KV heads, head dim); None = the target's


# Geometries of published checkpoints (their config.json), used only for their shapes.
QWEN3_8B = DenseConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
    num_kv_heads=8, head_dim=128, max_context=40960,
)
QWEN3_06B = DenseConfig(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
    num_kv_heads=8, head_dim=128, max_context=40960, tie_word_embeddings=True,
)
# Qwen3.5-27B's text model: its Hugging Face text_config, the same numbers as the GGUF
# metadata llama.cpp prints for it (qwen35.block_count 64, embedding_length 5120,
# feed_forward_length 17408, attention.head_count 24 / head_count_kv 4 / key_length 256,
# rope.dimension_count 64, ssm.group_count 16, ssm.time_step_rank 48, ssm.state_size 128,
# ssm.inner_size 6144, ssm.conv_kernel 4, full_attention_interval 4; ggml-org/llama.cpp PR #23792).
QWEN35_27B = Qwen35Config(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
    head_dim=256, rotary_dim=64, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, conv_kernel=4, full_attention_interval=4, rope_theta=10_000_000.0, max_context=262144,
)
# Small enough for a CPU: how CI runs the benchmark end to end. K-quant rows hold multiples of 256
# values, hence the wider tiny shapes of the quantized and hybrid tests.
TINY = DenseConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=16, max_context=8192,
)
TINY_K = DenseConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=64, max_context=8192,
)
TINY_QWEN35 = Qwen35Config(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=2, num_kv_heads=1,
    head_dim=128, rotary_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, max_context=8192,
)
QWEN35_DRAFT_HEADS = (32, 8, 128)  # the config.json of z-lab/Qwen3.5-27B-DFlash
SHAPES = {
    "qwen3-8b": RandomShape(QWEN3_8B),
    "qwen3-8b-q4km": RandomShape(QWEN3_8B, quantized=True),
    "qwen3-0.6b": RandomShape(QWEN3_06B),
    "qwen35-27b": RandomShape(QWEN35_27B, draft_heads=QWEN35_DRAFT_HEADS),
    "qwen35-27b-q4km": RandomShape(QWEN35_27B, quantized=True, draft_heads=QWEN35_DRAFT_HEADS),
    "tiny": RandomShape(TINY),
    "tiny-q4km": RandomShape(TINY_K, quantized=True),
    "tiny-qwen35": RandomShape(TINY_QWEN35, draft_heads=(4, 2, 64)),
    "tiny-qwen35-q4km": RandomShape(TINY_QWEN35, quantized=True, draft_heads=(4, 2, 64)),
}
# Drafts: NAME-dflash is a 5-layer DFlash draft of target NAME (the z-lab Qwen3-8B and Qwen3.5-27B
# drafts' depth) with the target's hidden and intermediate sizes, as those drafts have.
DRAFT_LAYERS = 5
DRAFT_BLOCK = 16
RESIDUAL_WRITE_STD = 1e-4


def is_random(path: str | os.PathLike) -> bool:
    return str(path).startswith(PREFIX)


def random_shape(path: str | os.PathLike) -> RandomShape:
    name = str(path).removeprefix(PREFIX)
    if name not in SHAPES:
        raise ValueError(f"{path}: unknown random shape; choose one of {', '.join(PREFIX + n for n in SHAPES)}")
    return SHAPES[name]


def random_target_config(path: str | os.PathLike) -> DenseConfig | Qwen35Config:
    return random_shape(path).config


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _std(name: str) -> float:
    # Small writes into the residual stream keep each position's own token embedding dominant
    # there, so the next token is decided by a wide margin (see random_target_head).
    return RESIDUAL_WRITE_STD if name.endswith(("o_proj", "down_proj", "out_proj")) else 0.02


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Fill every parameter and packed weight of ``module`` (just materialized, contents arbitrary)
    except the embedding and LM head weights (see ``random_target_head``)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue
            if name.endswith("linear_attn.ssm_a"):
                p.fill_(-1.0)  # a decay: -exp(A_log) < 0 keeps the recurrent state bounded
            elif p.dim() == 1:
                p.fill_(1.0)  # norms, dt_bias
            else:
                p.normal_(0.0, _std(name.removesuffix(".weight")), generator=generator)
        for name, m in module.named_modules():
            if isinstance(m, QuantLinear) and name != "lm_head":
                m.raw.copy_(random_blocks(m.qtype, m.out_features, m.in_features, _std(name), generator))


# Std of a block's values per unit of its f16 scale ``d``, with the other fields uniformly random:
# Q4_K: d * scale * q - dmin * min, 6-bit scale and min, 4-bit q, dmin = 7.5 d (zero mean);
# Q5_K: the same with a 5-bit q, dmin = 15.5 d; Q6_K: d * int8 scale * (6-bit q - 32);
# IQ4_XS: d * (6-bit scale - 32) * one of its sixteen int8 levels (mean 0.2% of the std).
# Their moments; the [0.5, 1.5) spread of d adds 4%.
_STD_PER_D = {Q.Q4_K: 258.0, Q.Q5_K: 527.0, Q.Q6_K: 1366.0, Q.IQ4_XS: 1246.0}
_SCALE_FIELDS = {  # byte offset of each f16, times d
    Q.Q4_K: ((0, 1.0), (2, 7.5)), Q.Q5_K: ((0, 1.0), (2, 15.5)), Q.Q6_K: ((208, 1.0),), Q.IQ4_XS: ((0, 1.0),),
}


def random_blocks(qtype: Q, rows: int, in_features: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes]: GGUF blocks of ``qtype`` (Q4_K, Q5_K, Q6_K or IQ4_XS) on ``generator``'s device
    with random quant bits and sub-block scales, and f16 super-block scales ``d`` drawn in
    [0.5, 1.5) x the value that makes the values' std about ``std`` (finite, never NaN or inf)."""
    device = generator.device
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows, row_bytes(qtype, in_features)), dtype=torch.uint8, device=device, generator=generator)
    blocks = raw.view(rows, in_features // block_values, block_bytes)
    d = std / _STD_PER_D[qtype] * (0.5 + torch.rand(blocks.shape[:2], device=device, generator=generator))
    for offset, times in _SCALE_FIELDS[qtype]:
        blocks[..., offset : offset + 2] = (d * times).to(torch.float16).view(torch.uint8).view(*blocks.shape[:2], 2)
    return raw


def _quantized_head(config, device: torch.device | str) -> torch.Tensor:
    """The Q6_K LM head of a quantized shape: random rows of the embedding's scale (std 1)."""
    return random_blocks(Q.Q6_K, config.vocab_size, config.hidden_size, 1.0, _generator(device, 3))


def random_target(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, state_dtype: torch.dtype | None = None
) -> tuple[DenseForCausalLM | Qwen35ForCausalLM, DenseConfig | Qwen35Config]:
    """``state_dtype``: the hybrid family's recurrent-state storage (see ``Qwen35ForCausalLM``)."""
    shape = random_shape(path)
    config = shape.config
    with torch.device("meta"):  # no float32 copy of the whole model, ever: 27B would not fit
        model = Qwen35ForCausalLM(config, state_dtype) if isinstance(config, Qwen35Config) else DenseForCausalLM(config)
    if shape.quantized:
        swap_quant_linears(model, q4_k_m_types(model))
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(_embedding(config, device, dtype))
        if shape.quantized:
            model.lm_head.raw.copy_(_quantized_head(config, device))
        elif not config.tie_word_embeddings:
            model.lm_head.weight.copy_(model.embed_tokens.weight[_permutation(config, device)])
    _randomize(model, _generator(device, 1))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if isinstance(model, DenseForCausalLM):
        model.fuse_projections()  # QuantLinear layers stay unfused (see layers.fuse_linears)
    return model.eval(), config


def random_target_head(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, DenseConfig | Qwen35Config]:
    """Embedding [vocab, hidden] and LM head: head row ``j`` is the embedding of token ``perm[j]``
    for a fixed random permutation, so the model continues token ``x`` with ``perm^-1(x)``
    by a margin that no rounding difference between a tree pass and a single-token pass can flip:
    greedy output is the same on every path, which the oracle rows of the benchmark rely on. (Tied shapes
    repeat the last token.) A quantized shape's head is its random Q6_K blocks, dequantized as a
    draft worker dequantizes a real target's head (no such margin). Seeded, so the draft worker
    draws the same tensors as the target."""
    shape = random_shape(path)
    config = shape.config
    embed = _embedding(config, device, dtype)
    if config.tie_word_embeddings:
        return embed, embed, config
    if not shape.quantized:
        return embed, embed[_permutation(config, device)], config
    raw, head = _quantized_head(config, device), torch.empty_like(embed)
    for start in range(0, config.vocab_size, 16384):  # bounded float32 scratch: 27B's head is 1.3G values
        rows = raw[start : start + 16384]
        head[start : start + len(rows)] = dequantize(rows, Q.Q6_K, (len(rows), config.hidden_size)).to(dtype)
    return embed, head, config


def _embedding(config, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn((config.vocab_size, config.hidden_size), device=device, generator=_generator(device, 0)).to(dtype)


def _permutation(config, device: torch.device | str) -> torch.Tensor:
    return torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0)).to(device)


def random_draft_config(path: str | os.PathLike) -> DFlashConfig:
    name = str(path).removeprefix(PREFIX).removesuffix("-dflash")
    if not str(path).endswith("-dflash") or name not in SHAPES:
        raise ValueError(f"{path}: unknown random draft; choose one of {', '.join(PREFIX + n + '-dflash' for n in SHAPES)}")
    shape = SHAPES[name]
    t = shape.config
    heads, kv_heads, head_dim = shape.draft_heads or (t.num_heads, t.num_kv_heads, t.head_dim)
    layers = DRAFT_LAYERS if t.num_layers >= 2 * DRAFT_LAYERS else 2
    return DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=DRAFT_BLOCK,
        mask_token_id=t.vocab_size - 1, target_layer_ids=tuple(default_target_layer_ids(t.num_layers, layers)),
        vocab_size=t.vocab_size,
    )


def random_draft(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[DFlashDraft, DFlashConfig]:
    config = random_draft_config(path)
    with torch.device("meta"):
        model = DFlashDraft(config)
    model = model.to(dtype).to_empty(device=device)
    _randomize(model, _generator(device, 2))
    model.fuse_projections()
    return model.eval(), config
