"""Random weights of real model shapes — FOR BENCHMARKS ONLY, never for serving users.

``random:NAME`` names a shape for the benchmark (``splitspec bench``, ``splitspec.bench.workers``,
the GPU scripts): the benchmark machines have no network and no model files, and a step's speed depends on shapes, dtypes and kernels, not on the
values. The weights are drawn on the device itself, so a 16 GB model appears in a second instead
of being written to and read from disk. Nothing about them is meaningful: a random target's
greedy output is a fixed permutation of its input tokens, and a random draft accepts almost nothing.

Shapes (``SHAPES``): dense ``qwen3-8b``, ``qwen3-0.6b``, ``tiny``; hybrid ``qwen35-27b`` and
``tiny-qwen35``; and ``*-q4km`` variants, whose linear layers stay in random GGUF blocks laid out
as llama.cpp's Q4_K_M (``models.quantized.q4_k_m_types``; blocks from ``random_blocks``), held
by ``QuantLinear`` as a ``--keep-quantized`` load holds a real Q4_K_M file, with the token
embedding in Q4_K blocks (``QuantEmbedding``) and the LM head in Q6_K. ``NAME-dflash`` is a
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
from splitspec.models.quantized import QuantEmbedding, interleave_layers, link_producers, q4_k_m_types, quant_linear, swap_quant_linears
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
# IQ4_XS: d * (6-bit scale - 32) * one of its sixteen int8 levels (mean 0.2% of the std);
# Q8_0: d * int8 q (uniform over -128 .. 127: std 73.9, mean -0.5, 0.7% of the std).
# Their moments; the [0.5, 1.5) spread of d adds 4%.
_STD_PER_D = {Q.Q4_K: 258.0, Q.Q5_K: 527.0, Q.Q6_K: 1366.0, Q.IQ4_XS: 1246.0, Q.Q8_0: 73.9}
_SCALE_FIELDS = {  # byte offset of each f16, times d
    Q.Q4_K: ((0, 1.0), (2, 7.5)), Q.Q5_K: ((0, 1.0), (2, 15.5)), Q.Q6_K: ((208, 1.0),), Q.IQ4_XS: ((0, 1.0),),
    Q.Q8_0: ((0, 1.0),),
}
RANDOM_BLOCK_TYPES = tuple(_STD_PER_D)


def random_blocks(qtype: Q, rows: int, in_features: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes]: GGUF blocks of ``qtype`` (one of ``RANDOM_BLOCK_TYPES``: Q4_K, Q5_K,
    Q6_K, IQ4_XS, Q8_0) on ``generator``'s device with random quant bits and sub-block scales, and
    f16 block scales ``d`` drawn in [0.5, 1.5) x the value that makes the values' std about ``std``
    (finite, never NaN or inf)."""
    device = generator.device
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows, row_bytes(qtype, in_features)), dtype=torch.uint8, device=device, generator=generator)
    blocks = raw.view(rows, in_features // block_values, block_bytes)
    d = std / _STD_PER_D[qtype] * (0.5 + torch.rand(blocks.shape[:2], device=device, generator=generator))
    for offset, times in _SCALE_FIELDS[qtype]:
        blocks[..., offset : offset + 2] = (d * times).to(torch.float16).view(torch.uint8).view(*blocks.shape[:2], 2)
    return raw


Q6_K_BYTES = GGML_QUANT_SIZES[Q.Q6_K][1]  # 210: 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, f16 d


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """float [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 210]: valid Q6_K blocks, made
    on ``w``'s device.

    Terms: a *super-block* is 256 consecutive values of a row with one f16 scale ``d``; a
    *sub-block* is 16 of them with one int8 scale ``sc``; a value is ``d * sc * (q - 32)`` with a
    6-bit ``q``. The choice is the plain symmetric one (not llama.cpp's search): a sub-block's step
    ``amax / 31`` puts its largest magnitude on q - 32 = +-31; ``d`` is the largest step over 127,
    rounded to f16 first so that the int8 scales are rounded against the ``d`` the file holds.
    Error per value: at most half a step plus 31 x half of ``d`` (the scale's rounding), under 2% of
    its super-block's largest magnitude while ``d`` is a normal f16 (that magnitude above about 0.25;
    below it the format's subnormal ``d`` adds error, as in any Q6_K file). Byte layout as ``native.gguf_dequant._q6_k`` reads it: value
    128 h + 32 r + l (half h, row r < 4, lane l < 32) keeps its low 4 bits in nibble r // 2 of byte
    64 h + 32 (r % 2) + l and its high 2 bits at bit 2 r of byte 128 + 32 h + l."""
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"Q6_K rows hold multiples of 256 values, got {k}")
    x = w.float().reshape(-1, 16, 16)  # [n super-blocks, 16 sub-blocks, 16 values]
    n = x.shape[0]
    step = x.abs().amax(-1) / 31  # [n, 16]
    d = (step.amax(-1) / 127).to(torch.float16)  # [n]
    d32 = d.float()[:, None]
    # An all-zero super-block has d = 0: scale 0 and q - 32 = 0 decode it exactly.
    sc = torch.where(d32 > 0, step / d32.clamp_min(1e-30), 0.0).round().clamp(0, 127)  # [n, 16]
    eff = (d32 * sc)[..., None]  # [n, 16, 1]: the step the file holds
    q = torch.where(eff > 0, x / eff.clamp_min(1e-30), 0.0).round().clamp(-32, 31).to(torch.int32) + 32  # 0 .. 63
    u = q.reshape(n, 2, 4, 32)  # [n, half, row, lane]
    ql = (u[:, :, 0:2] & 15) | ((u[:, :, 2:4] & 15) << 4)  # [n, 2, 2, 32]: rows 0, 1 low nibbles; rows 2, 3 high
    qh = ((u >> 4) << (2 * torch.arange(4, device=w.device, dtype=torch.int32)).view(1, 1, 4, 1)).sum(2)  # [n, 2, 32]: disjoint bits
    out = torch.empty(n, Q6_K_BYTES, dtype=torch.uint8, device=w.device)
    out[:, :128] = ql.reshape(n, 128).to(torch.uint8)
    out[:, 128:192] = qh.reshape(n, 64).to(torch.uint8)
    out[:, 192:208] = sc.to(torch.int8).view(torch.uint8)
    out[:, 208:210] = d.view(torch.uint8).view(n, 2)
    return out.view(rows, -1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """float [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 144]: valid Q4_K blocks, made
    on ``w``'s device.

    A value is ``d * scale * q - dmin * min`` with a 4-bit ``q`` and 6-bit ``scale`` and ``min`` per
    sub-block of 32. The plain choice (not llama.cpp's search): a sub-block spans [lo, hi] with
    lo = min(values, 0), its step (hi - lo) / 15 and its min -lo; ``d`` and ``dmin`` are the largest
    step and min over 63, rounded to f16 first so that the 6-bit fields are rounded against the
    values the file holds. Byte layout as ``native.gguf_dequant._q4_k`` reads it: f16 d, f16 dmin,
    12 bytes of 6-bit fields (``_q4_k_scale_min`` in ``native.gguf_matmul`` decodes them), then
    byte l of group j holding value 64 j + l in its low nibble and 64 j + 32 + l in its high one."""
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K rows hold multiples of 256 values, got {k}")
    x = w.float().reshape(-1, 8, 32)  # [n super-blocks, 8 sub-blocks, 32 values]
    n = x.shape[0]
    lo = x.amin(-1).clamp(max=0.0)  # [n, 8]
    step = (x.amax(-1) - lo) / 15
    d = (step.amax(-1) / 63).to(torch.float16)  # [n]
    dmin = ((-lo).amax(-1) / 63).to(torch.float16)
    d32, dmin32 = d.float()[:, None], dmin.float()[:, None]
    sc = torch.where(d32 > 0, step / d32.clamp_min(1e-30), 0.0).round().clamp(0, 63).to(torch.int32)  # [n, 8]
    mn = torch.where(dmin32 > 0, -lo / dmin32.clamp_min(1e-30), 0.0).round().clamp(0, 63).to(torch.int32)
    eff, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]  # [n, 8, 1]: what the file decodes
    q = torch.where(eff > 0, (x + offset) / eff.clamp_min(1e-30), 0.0).round().clamp(0, 15).to(torch.int32)
    out = torch.empty(n, 144, dtype=torch.uint8, device=w.device)
    out[:, 0:2] = d.view(torch.uint8).view(n, 2)
    out[:, 2:4] = dmin.view(torch.uint8).view(n, 2)
    # sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7 as nibbles of bytes
    # 8-11 (scale low, min high) with their top two bits over those of bytes 0-7
    out[:, 4:8] = ((sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)).to(torch.uint8)
    out[:, 8:12] = ((mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)).to(torch.uint8)
    out[:, 12:16] = ((sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)).to(torch.uint8)
    pairs = q.reshape(n, 4, 2, 32)  # [n, group j, low/high half, l]
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
    return out.view(rows, -1)


HEAD_CHUNK_ROWS = 16384  # rows drawn or dequantized at once: bounded float32 scratch (27B's head is 1.3G values)
QUANTIZE_CHUNK_ROWS = 4096  # rows quantized at once: the quantizers keep several float32 and int32 copies of a chunk


def _q6_k_head(embed: QuantEmbedding, perm: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Q6_K LM head of a quantized shape: row ``j`` is ``embed``'s row ``perm[j]`` in Q6_K blocks
    (``random_target_head`` says why), quantized from the values the model's lookups give (its
    dtype), into ``out`` when given (a capped worker cannot hold the 1 GB head at 27B twice)."""
    vocab, hidden = embed.num_embeddings, embed.embedding_dim
    raw = torch.empty(vocab, row_bytes(Q.Q6_K, hidden), dtype=torch.uint8, device=embed.raw.device) if out is None else out
    for start in range(0, vocab, QUANTIZE_CHUNK_ROWS):
        rows = perm[start : start + QUANTIZE_CHUNK_ROWS]
        raw[start : start + len(rows)] = quantize_q6_k(embed(rows))
    return raw


def _q4_k_embedding(config, device: torch.device | str, dtype: torch.dtype) -> QuantEmbedding:
    """A quantized shape's token embedding: ``_embedding``'s standard normal values in Q4_K blocks
    (``quantize_q4_k``), held as ``QuantEmbedding`` as a keep-quantized load holds a Q4_K_M file's
    ``token_embd`` (0.67 GiB at 27B against 2.37 in bf16). Drawn and quantized by row chunks on a
    seeded generator, so the draft worker draws the same blocks as the target."""
    raw = torch.empty(config.vocab_size, row_bytes(Q.Q4_K, config.hidden_size), dtype=torch.uint8, device=device)
    generator = _generator(device, 0)
    for start in range(0, config.vocab_size, QUANTIZE_CHUNK_ROWS):
        rows = min(QUANTIZE_CHUNK_ROWS, config.vocab_size - start)
        raw[start : start + rows] = quantize_q4_k(torch.randn((rows, config.hidden_size), device=device, generator=generator))
    return QuantEmbedding.of(raw, Q.Q4_K, config.hidden_size, dtype)


def _dequantized_rows(raw: torch.Tensor, qtype: Q, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """GGUF rows ``raw`` [n, row bytes] as a [n, in_features] table in ``dtype``, by row chunks
    (bounded float32 scratch), as a load without ``--keep-quantized`` holds a GGUF weight."""
    out = torch.empty(raw.shape[0], in_features, dtype=dtype, device=raw.device)
    for start in range(0, raw.shape[0], HEAD_CHUNK_ROWS):
        rows = raw[start : start + HEAD_CHUNK_ROWS]
        out[start : start + len(rows)] = dequantize(rows, qtype, (len(rows), in_features)).to(dtype)
    return out


def _dequantized_embedding(embed: QuantEmbedding) -> torch.Tensor:
    """``embed``'s table in its dtype."""
    return _dequantized_rows(embed.raw, embed.qtype, embed.embedding_dim, embed.dtype)


def _dequantized(module: QuantLinear, dtype: torch.dtype) -> torch.nn.Linear:
    """An ``nn.Linear`` holding ``module``'s weight dequantized to ``dtype``."""
    n, k = module.out_features, module.in_features
    linear = torch.nn.Linear(k, n, bias=module.bias is not None, device="meta")
    weight = _dequantized_rows(module.raw, module.qtype, k, dtype)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        linear.bias = torch.nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
    return linear


def quant_types(path: str | os.PathLike) -> list[Q]:
    """The GGUF types a shape's linears hold (Q4_K and Q6_K for the ``*-q4km`` shapes; none for the
    others), in ``RANDOM_BLOCK_TYPES`` order; worked out on the meta device, so nothing is allocated."""
    shape = random_shape(path)
    if not shape.quantized:
        return []
    config = shape.config
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config) if isinstance(config, Qwen35Config) else DenseForCausalLM(config)
    present = set(q4_k_m_types(model).values())
    return [q for q in RANDOM_BLOCK_TYPES if q in present]


def random_target(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None, keep_quantized: bool = True,
) -> tuple[DenseForCausalLM | Qwen35ForCausalLM, DenseConfig | Qwen35Config]:
    """``state_dtype``: the hybrid family's recurrent-state storage (see ``Qwen35ForCausalLM``).
    ``keep_quantized`` (``*-q4km`` shapes): the linears stay ``QuantLinear`` modules holding their
    GGUF blocks, as ``load_target(keep_quantized=True)`` holds a Q4_K_M file; False dequantizes
    the same blocks to ``dtype``, as a load without it does (the benchmark workers pass their
    ``--keep-quantized``)."""
    shape = random_shape(path)
    config = shape.config
    with torch.device("meta"):  # no float32 copy of the whole model, ever: 27B would not fit
        model = Qwen35ForCausalLM(config, state_dtype) if isinstance(config, Qwen35Config) else DenseForCausalLM(config)
    if shape.quantized:
        swap_quant_linears(model, q4_k_m_types(model))
        model.embed_tokens = None  # its Q4_K blocks are set below: no bf16 table allocated first
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        if shape.quantized:
            embed = _q4_k_embedding(config, device, dtype)
            _q6_k_head(embed, _permutation(config, device), out=model.lm_head.raw)
            if keep_quantized:
                model.embed_tokens = embed
            else:
                model.embed_tokens = torch.nn.Embedding.from_pretrained(_dequantized_embedding(embed), freeze=True)
        else:
            embed = model.embed_tokens.weight
            _embedding(config, device, dtype, out=embed)
            if not config.tie_word_embeddings:
                model.lm_head.weight.copy_(embed[_permutation(config, device)])
    _randomize(model, _generator(device, 1))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if shape.quantized and not keep_quantized:
        for name, module in list(model.named_modules()):
            if isinstance(module, QuantLinear):
                model.set_submodule(name, _dequantized(module, dtype))
    interleave_layers(model, dtype)
    model.fuse_projections()
    link_producers(model)
    return model.eval(), config


def random_target_head(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | QuantLinear, DenseConfig | Qwen35Config]:
    """Embedding [vocab, hidden] and LM head, as the draft worker borrows them from the target.

    Head row ``j`` is the embedding of token ``perm[j]`` for a fixed random permutation, so the
    model continues token ``x`` with ``perm^-1(x)``: its final hidden state is ``x``'s embedding
    (normed) plus small writes (``RESIDUAL_WRITE_STD``), whose logit against row ``perm^-1(x)`` is
    about ``hidden`` and against any other row about ``sqrt(hidden)`` at most a few times over. No
    rounding difference between a tree pass and a single-token pass (a GEMV kernel against a
    ``tl.dot`` one, bf16 against float32 accumulation) can flip that: greedy output is the same on
    every path, which the oracle rows of the benchmark rely on. (Tied shapes repeat the last
    token.) A quantized shape's embedding is Q4_K blocks (``_q4_k_embedding``) and its head that
    matrix in Q6_K blocks (``_q6_k_head``): a ``QuantEmbedding`` and a ``QuantLinear`` holding them
    with ``keep_quantized``, else both dequantized to ``dtype`` as a draft worker dequantizes a real
    target's. Seeded, so the draft worker draws the same tensors as
    the target (on the same kind of device, in the same dtype)."""
    shape = random_shape(path)
    config = shape.config
    if shape.quantized:
        embed = _q4_k_embedding(config, device, dtype)
        kept = quant_linear(_q6_k_head(embed, _permutation(config, device)), Q.Q6_K, config.hidden_size)
        if keep_quantized:
            return embed, kept, config
        return _dequantized_embedding(embed), _dequantized(kept, dtype).weight.detach(), config
    embed = _embedding(config, device, dtype)
    if config.tie_word_embeddings:
        return embed, embed, config
    return embed, embed[_permutation(config, device)], config


def _embedding(config, device: torch.device | str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The token embedding [vocab, hidden] in ``dtype``: standard normal values drawn by row chunks
    (no float32 copy of the whole table: 5 GB at 27B, which a capped worker could not hold), into
    ``out`` when given."""
    out = torch.empty((config.vocab_size, config.hidden_size), device=device, dtype=dtype) if out is None else out
    generator = _generator(device, 0)
    for start in range(0, config.vocab_size, HEAD_CHUNK_ROWS):
        rows = min(HEAD_CHUNK_ROWS, config.vocab_size - start)
        out[start : start + rows] = torch.randn((rows, config.hidden_size), device=device, generator=generator).to(dtype)
    return out


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
