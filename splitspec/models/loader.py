"""Load targets and drafts from their on-disk formats into PyTorch modules.

Targets (the dense family of ``models.dense``: Llama, Qwen2, Qwen3) come from a GGUF file (split
or not; architectures ``llama``, ``qwen2``, ``qwen3``) or a Hugging Face directory (``config.json``
+ safetensors; ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``). Drafts come from
the z-lab DFlash directory layout or a GGUF conversion (lucebox's, or llama.cpp's ``dflash``
architecture, which DFlash2 drafts use: ``splitspec.models.draft_gguf``). The draft has no
embedding or LM head of its own; it borrows the target's, read here from the target
(``load_target_head``).

The hybrid Qwen3.5 family (GGUF ``qwen35`` or a ``qwen3_5`` directory) loads through
``models.qwen35_loader``; ``read_target_config``, ``load_target`` and ``load_target_head`` pick
the family. Every path may also be a Hub reference (``hf://...``, see ``splitspec.models.hub``). A file
that does not fit raises ``ModelFileError`` naming the file and the offending key or tensor.

``keep_quantized`` (GGUF files of either family, and GGUF drafts) keeps the weights of
kernel-typed linears and a quantized token embedding in the file's blocks (``models.quantized``):
for the target, for the draft's borrowed embedding and LM head, and for a GGUF draft's linears.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from native.gguf_dequant import dequantize
from native.gguf_matmul import KERNEL_TYPES, QuantLinear
from splitspec.models import draft_gguf, qwen35_loader
from splitspec.models.dense import DenseConfig, DenseForCausalLM
from splitspec.models.dflash import DFlashConfig, DFlashDraft, default_target_layer_ids
from splitspec.models.dflash2 import DFlash2Config, DFlash2Draft
from splitspec.models.gguf_file import GGUFFile, ModelFileError, skip_other_tensors
from splitspec.models.hf_dir import HFDirectory
from splitspec.models.hub import resolve_model
from splitspec.models.layers import llama3_freq_factors
from splitspec.models.quantized import (
    QuantEmbedding,
    interleave_layers,
    keeps_embedding,
    kept_summary,
    link_producers,
    quant_linear,
    swap_quant_linears,
    swap_quant_modules,
)
from splitspec.models.qwen35 import QWEN35_ARCHS, Qwen35Config, Qwen35ForCausalLM
from splitspec.models.weights import load_gguf_raw, load_gguf_tensor, progress

logger = logging.getLogger(__name__)

# GGUF tensor name -> module parameter name inside one decoder layer (llama.cpp naming).
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # DFlash2 drafts' convolutions before and after each sublayer (splitspec.models.draft_gguf)
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
# GGUF draft tensor name -> DFlash module name (lucebox's conversion of the z-lab layout).
GGUF_DRAFT_GLOBAL_NAMES = {"dflash.fc.weight": "fc.weight", "dflash.hidden_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight"}
SUPPORTED_TARGET_ARCHS = ("llama", "qwen2", "qwen3")
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Tensors a checkpoint may carry that the model recomputes.
_IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


def gguf_name(module_name: str, global_names: dict[str, str] = GGUF_GLOBAL_NAMES) -> str:
    """The GGUF tensor name of a module parameter: ``global_names`` (GGUF -> module) for the
    top-level ones, ``blk.N.*`` for those of layer N."""
    for gguf, module in global_names.items():
        if module == module_name:
            return gguf
    _, i, rest = module_name.split(".", 2)  # layers.{i}.{rest}
    return f"blk.{i}.{_GGUF_LAYER_REVERSE[rest]}"


_GGUF_LAYER_REVERSE = {v: k for k, v in GGUF_LAYER_NAMES.items()}


class _Source(Protocol):
    """A target checkpoint: its config, and its tensors by the names the model's parameters map to."""

    config: DenseConfig
    where: Path  # the file or directory, for messages

    def names(self, model_names: Iterable[str]) -> dict[str, str]:
        """Module parameter name -> checkpoint tensor name."""

    def load(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A checkpoint tensor in the model's layout, checked against ``shape``."""

    def tensor_names(self) -> list[str]:
        """Every tensor the checkpoint holds that the model must consume."""


# ---------------------------------------------------------------------------------------------- GGUF


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for its interleaved RoPE.

    llama.cpp's converter stores each head's rows as (pair index, half) instead of (half, pair
    index), so that adjacent rows form rotation pairs; rotate-half RoPE wants the halves apart.
    """
    per_head = w.shape[0] // heads
    return w.reshape(heads, per_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _GGUFSource:
    def __init__(self, f: GGUFFile, device: torch.device | str = "cpu") -> None:
        self.file, self.where, self.device = f, f.path, device
        self.config = dense_config_from_gguf(f)

    def names(self, model_names):
        return {name: gguf_name(name) for name in model_names}

    def load(self, name, shape):
        return dequantize(*self.load_raw(name, shape), shape)

    def load_raw(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, Q]:
        """Packed rows in the model's row order: a row is whole blocks, so permuting rows of
        bytes equals permuting rows of values."""
        raw, qtype = load_gguf_raw(self.file, name, shape, self.device)
        c = self.config
        if c.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            raw = _unpermute_rows(raw, c.num_heads if ".attn_q." in name else c.num_kv_heads)
        return raw, qtype

    def tensor_names(self):
        return [n for n in self.file.tensor_names() if n != "rope_freqs.weight"]


def dense_config_from_gguf(f: GGUFFile) -> DenseConfig:
    arch = f.architecture
    if arch not in SUPPORTED_TARGET_ARCHS:
        supported = ", ".join(SUPPORTED_TARGET_ARCHS + QWEN35_ARCHS)
        raise ModelFileError(f"{f.path}: unsupported architecture {arch!r} (supported: {supported})")
    vocab_size, hidden = f.tensor_shape("token_embd.weight")
    heads = int(f.get(f"{arch}.attention.head_count"))
    head_dim = int(f.get(f"{arch}.attention.key_length", hidden // heads))
    return DenseConfig(
        vocab_size=vocab_size,
        hidden_size=int(f.get(f"{arch}.embedding_length")),
        intermediate_size=int(f.get(f"{arch}.feed_forward_length")),
        num_layers=int(f.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_context=int(f.get(f"{arch}.context_length")),
        tie_word_embeddings=not f.has_tensor("output.weight"),
        qk_norm=arch == "qwen3",
        attention_bias=f.has_tensor("blk.0.attn_q.bias"),
        rope_freq_factors=_gguf_rope_factors(f, arch, head_dim),
        architecture=arch,
    )


def _gguf_rope_factors(f: GGUFFile, arch: str, head_dim: int) -> tuple[float, ...] | None:
    """RoPE scaling: a ``rope_freqs`` tensor (how llama.cpp stores Llama 3.1 scaling) and/or
    ``rope.scaling.type`` = linear with ``rope.scaling.factor``."""
    factors = np.ones(head_dim // 2, np.float64)
    scaled = False
    if f.has_tensor("rope_freqs.weight"):
        factors *= f.tensor("rope_freqs.weight", (head_dim // 2,))
        scaled = True
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factors *= float(f.get(f"{arch}.rope.scaling.factor"))
        scaled = True
    elif kind != "none":
        raise ModelFileError(f"{f.path}: {arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear)")
    return tuple(float(x) for x in factors) if scaled else None


# -------------------------------------------------------------------------------- Hugging Face dirs


class _HFSource:
    def __init__(self, d: HFDirectory) -> None:
        self.dir, self.where = d, d.path
        self.config = dense_config_from_hf(d)

    def names(self, model_names):
        return {name: name if name == "lm_head.weight" else f"model.{name}" for name in model_names}

    def load(self, name, shape):
        return self.dir.tensor(name, shape)

    def tensor_names(self):
        return [n for n in self.dir.tensor_names() if not n.endswith(_IGNORED_HF_TENSORS)]


def dense_config_from_hf(d: HFDirectory) -> DenseConfig:
    architectures = d.get("architectures")
    known = [HF_ARCHITECTURES[a] for a in architectures or () if a in HF_ARCHITECTURES]
    if not known:
        raise ModelFileError(
            f"{d.config_path}: unsupported architectures {architectures} (supported: {', '.join(HF_ARCHITECTURES)})"
        )
    arch = known[0]
    heads = int(d.get("num_attention_heads"))
    hidden = int(d.get("hidden_size"))
    head_dim = int(d.get("head_dim", None) or hidden // heads)
    # Qwen2 always has q/k/v biases; elsewhere `attention_bias` also puts one on o_proj, unsupported.
    if arch != "qwen2" and d.get("attention_bias", False):
        raise ModelFileError(f"{d.config_path}: attention_bias = true (a bias on o_proj) is not supported for {arch}")
    for flag in ("mlp_bias", "use_sliding_window"):
        if d.get(flag, False):
            raise ModelFileError(f"{d.config_path}: {flag} = true is not supported")
    # transformers 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
    rope = d.get("rope_parameters", None) or d.get("rope_scaling", None) or {}
    theta = float(d.get("rope_theta", None) or rope.get("rope_theta", 10_000.0))
    return DenseConfig(
        vocab_size=int(d.get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(d.get("intermediate_size")),
        num_layers=int(d.get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(d.get("rms_norm_eps")),
        max_context=int(d.get("max_position_embeddings")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        rope_freq_factors=_hf_rope_factors(d, rope, head_dim, theta),
        architecture=arch,
    )


def _hf_rope_factors(d: HFDirectory, rope: dict, head_dim: int, theta: float) -> tuple[float, ...] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return (float(rope["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        try:
            return tuple(llama3_freq_factors(
                head_dim, theta, float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            ))
        except KeyError as exc:
            raise ModelFileError(f"{d.config_path}: llama3 RoPE scaling is missing key {exc.args[0]!r}") from exc
    raise ModelFileError(f"{d.config_path}: RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")


# ------------------------------------------------------------------------------------------ targets


def _open_target(path: str | os.PathLike, device: torch.device | str = "cpu") -> _Source:
    local = resolve_model(path)
    if local.is_dir():
        return _HFSource(HFDirectory(local))
    return _GGUFSource(GGUFFile(local), device)


def _hybrid(path: str | os.PathLike):
    """The qwen35 loader module when ``path`` holds that family, else None."""
    local = resolve_model(path)
    return (qwen35_loader, local) if qwen35_loader.is_qwen35(local) else None


def read_target_config(path: str | os.PathLike) -> DenseConfig | Qwen35Config:
    """The geometry of a target checkpoint, whatever its family, without reading its weights."""
    hybrid = _hybrid(path)
    if hybrid:
        module, local = hybrid
        return module.qwen35_config_from_hf(local) if local.is_dir() else module.qwen35_config_from_gguf(GGUFFile(local))
    return _open_target(path).config


def load_target(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None,
    keep_quantized: bool = False,
) -> tuple[DenseForCausalLM | Qwen35ForCausalLM, DenseConfig | Qwen35Config]:
    """``state_dtype``: storage of recurrent states (hybrid family only; see ``Qwen35ForCausalLM``).
    ``keep_quantized`` (GGUF files of either family): linear layers whose weights have a matmul
    kernel type (``native.gguf_matmul.KERNEL_TYPES``) stay in their blocks (``QuantLinear``), and
    so does a quantized token embedding (``QuantEmbedding``; see ``quantized.keeps_embedding``);
    the rest dequantize as usual."""
    hybrid = _hybrid(path)
    if hybrid:
        module, local = hybrid
        model, config = module.load_qwen35(local, device, dtype, state_dtype, keep_quantized=keep_quantized)
    else:
        model, config = _load_dense(path, device, dtype, keep_quantized)
    if keep_quantized:
        logger.info("keep-quantized target: %s", kept_summary(model))
    return model, config


def _load_dense(
    path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype, keep_quantized: bool
) -> tuple[DenseForCausalLM, DenseConfig]:
    source = _open_target(path, device)
    config = source.config
    with torch.device("meta"):
        model = DenseForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    names = source.names(expected)
    skip_other_tensors(source.where, source.tensor_names(), names.values(), config.architecture)
    quantized = _quantized_modules(model, source, names, dtype) if keep_quantized else {}
    state = {}
    for dst, src in progress(list(names.items()), f"loading {source.where.name}"):
        if dst in quantized:
            state[quantized[dst]] = source.load_raw(src, expected[dst])[0]
        else:
            state[dst] = source.load(src, expected[dst]).to(device=device, dtype=dtype)
    if config.tie_word_embeddings:  # one tensor for both: the blocks, where kept quantized
        part = "raw" if isinstance(model.lm_head, QuantLinear) else "weight"
        state[f"lm_head.{part}"] = state[f"embed_tokens.{part}"]
    model.load_state_dict(state, assign=True, strict=True)
    interleave_layers(model, dtype)
    model.fuse_projections()
    link_producers(model)
    return model.eval(), config


def _quantized_modules(model: DenseForCausalLM, source: _Source, names: dict[str, str], dtype: torch.dtype) -> dict[str, str]:
    """Keep-quantized's swap (``quantized.swap_quant_modules``) of ``model`` (on the meta device)
    for a GGUF source; returns weight name -> the name of its packed bytes."""
    if not isinstance(source, _GGUFSource):
        return {}
    types = {weight: source.file.raw(src)[1] for weight, src in names.items()}
    return swap_quant_modules(model, types, dtype, source.config.tie_word_embeddings)


def load_target_head(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> tuple[torch.Tensor | QuantEmbedding, torch.Tensor | QuantLinear, DenseConfig | Qwen35Config]:
    """The target's token embedding [vocab, hidden] and LM head [vocab, hidden], for the draft.

    ``keep_quantized`` (a GGUF target of either family): the embedding comes as a ``QuantEmbedding``
    where ``quantized.keeps_embedding`` says so and the head as a ``QuantLinear`` where its type has
    a kernel (a tied head shares the embedding's blocks); each other one as a tensor, as without it."""
    local = resolve_model(path)
    if keep_quantized and not local.is_dir():
        config = read_target_config(local)
        return (*_kept_head(GGUFFile(local), config, device, dtype), config)
    hybrid = _hybrid(path)
    if hybrid:
        module, local = hybrid
        if local.is_dir():
            return module.load_qwen35_hf_head(local, device, dtype)
        f = GGUFFile(local)
        config = module.qwen35_config_from_gguf(f)
        embed = load_gguf_tensor(f, "token_embd.weight", (config.vocab_size, config.hidden_size), device).to(dtype)
        head = embed if config.tie_word_embeddings else load_gguf_tensor(f, "output.weight", (config.vocab_size, config.hidden_size), device).to(dtype)
        return embed, head, config
    source = _open_target(path, device)
    config = source.config
    shape = (config.vocab_size, config.hidden_size)
    wanted = ["embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    names = source.names(wanted)
    embed = source.load(names["embed_tokens.weight"], shape).to(device=device, dtype=dtype)
    head = embed if config.tie_word_embeddings else source.load(names["lm_head.weight"], shape).to(device=device, dtype=dtype)
    return embed, head, config


def _kept_head(
    f: GGUFFile, config: DenseConfig | Qwen35Config, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor | QuantEmbedding, torch.Tensor | QuantLinear]:
    """``load_target_head(keep_quantized=True)``'s embedding and head: both families store them
    as ``token_embd`` and ``output`` with rows in the model's order."""
    hidden, tied = config.hidden_size, config.tie_word_embeddings
    shape = (config.vocab_size, hidden)
    raw, qtype = load_gguf_raw(f, "token_embd.weight", shape, device)
    kept = keeps_embedding(qtype, tied)
    embed = QuantEmbedding.of(raw, qtype, hidden, dtype) if kept else dequantize(raw, qtype, shape).to(dtype)
    if tied:
        return embed, quant_linear(raw, qtype, hidden) if kept else embed
    raw, qtype = load_gguf_raw(f, "output.weight", shape, device)
    return embed, quant_linear(raw, qtype, hidden) if qtype in KERNEL_TYPES else dequantize(raw, qtype, shape).to(dtype)


# ------------------------------------------------------------------------------------------- drafts

def read_draft_config(path: str | os.PathLike, num_target_layers: int | None = None) -> DFlashConfig:
    """A DFlash draft's config (its taps among them), without its weights; ``num_target_layers``
    picks the default taps when the file does not list them (as :func:`load_dflash_draft`)."""
    local = resolve_model(path)
    if local.is_dir():
        d = HFDirectory(local)
        kind = DFlash2Config if is_dflash2(d.config) else DFlashConfig
        try:
            return kind.from_dict(d.config, source=str(d.config_path))
        except ValueError as exc:
            raise ModelFileError(str(exc)) from exc
    return dflash_config_from_gguf(GGUFFile(local), num_target_layers)


def load_dflash_draft(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_target_layers: int | None = None,
    keep_quantized: bool = False,
) -> tuple[DFlashDraft, DFlashConfig]:
    """A DFlash draft from a z-lab directory (``config.json`` + ``model.safetensors``) or a GGUF
    file. ``num_target_layers`` picks the default taps when the file does not list them.
    ``keep_quantized``: a GGUF draft's linears whose weights have a kernel type stay in their
    blocks (``QuantLinear``), as the target's do."""
    local = resolve_model(path)
    config = read_draft_config(local, num_target_layers)
    if local.is_dir():
        d = HFDirectory(local)
        names = {name: name for name in _draft_param_names(config)}
        read = d.tensor
        where, available = d.path, d.tensor_names()
        types = {}  # safetensors: no blocks to keep
    else:
        f = GGUFFile(local)
        global_names = draft_gguf.GLOBAL_NAMES if draft_gguf.is_llama_dflash(f) else GGUF_DRAFT_GLOBAL_NAMES
        names = {name: gguf_name(name, global_names) for name in _draft_param_names(config)}

        def read(name, shape):
            return load_gguf_tensor(f, name, shape, device)

        def read_raw(name, shape):
            return load_gguf_raw(f, name, shape, device)[0]

        where, available = f.path, f.tensor_names()
        types = {name: f.raw(src)[1] for name, src in names.items()} if keep_quantized else {}
    with torch.device("meta"):
        model = draft_model(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    unexpected = sorted(set(available) - set(names.values()))
    if unexpected:
        raise ModelFileError(f"{where}: unexpected tensor {unexpected[0]!r} for a DFlash draft")
    kernel_typed = {
        m: types[f"{m}.weight"] for m, module in model.named_modules()
        if isinstance(module, nn.Linear) and types.get(f"{m}.weight") in KERNEL_TYPES
    }
    kept = swap_quant_linears(model, kernel_typed)  # weight name -> the state name of its blocks
    state = {}
    for name, src in names.items():
        if name in kept:
            state[kept[name]] = read_raw(src, expected[name])
        else:
            state[name] = read(src, expected[name]).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    interleave_layers(model, dtype)
    model.fuse_projections()
    return model.eval(), config


def is_dflash2(raw: dict) -> bool:
    """Whether a draft's ``config.json`` is a DFlash2 one (its architecture, or a candidate selector)."""
    return "DFlash2DraftModel" in (raw.get("architectures") or []) or bool((raw.get("dflash_config") or {}).get("selector_top_k"))


def draft_model(config: DFlashConfig) -> DFlashDraft:
    """The draft module of a config: DFlash2 for a ``DFlash2Config``, else DFlash."""
    return DFlash2Draft(config) if isinstance(config, DFlash2Config) else DFlashDraft(config)


def _draft_param_names(config: DFlashConfig) -> list[str]:
    with torch.device("meta"):
        return [name for name, _ in draft_model(config).named_parameters()]


def dflash_config_from_gguf(f: GGUFFile, num_target_layers: int | None) -> DFlashConfig:
    """A draft GGUF's config, in either converter's layout (``splitspec.models.draft_gguf``)."""
    if draft_gguf.is_llama_dflash(f):
        return draft_gguf.llama_dflash_config(f)
    arch = f.architecture
    if not f.has_tensor("dflash.fc.weight"):
        raise ModelFileError(f"{f.path}: architecture {arch!r} is not a DFlash draft (no tensor 'dflash.fc.weight')")
    shape = draft_gguf.shape_fields(f, arch)
    taps = f.get(f"{arch}.dflash.target_layer_ids", None)
    if taps is None:
        fc_in = f.tensor_shape("dflash.fc.weight")[1]
        num_taps = int(f.get(f"{arch}.dflash.n_target_layers", fc_in // shape["hidden_size"]))
        if num_target_layers is None:
            raise ModelFileError(f"{f.path}: no {arch}.dflash.target_layer_ids and the target's layer count is unknown")
        taps = default_target_layer_ids(num_target_layers, num_taps)
    vocab = f.get(f"{arch}.vocab_size", None)
    return DFlashConfig(
        **shape,
        block_size=int(f.get(f"{arch}.dflash.block_size")),
        mask_token_id=int(f.get(f"{arch}.dflash.mask_token_id")),
        target_layer_ids=tuple(int(t) for t in taps),
        vocab_size=None if vocab is None else int(vocab),
    )


def check_draft_fits(draft: DFlashConfig, target: DenseConfig, draft_path: str, target_path: str) -> None:
    """Refuse a draft built for another target, naming every mismatch."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {draft.hidden_size} (draft) vs {target.hidden_size} (target)")
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {draft.vocab_size} (draft) vs {target.vocab_size} (target)")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {draft.mask_token_id} outside the target vocabulary of {target.vocab_size}")
    bad = [t for t in draft.target_layer_ids if not 0 <= t < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if problems:
        raise ModelFileError(f"{draft_path}: draft does not fit target {target_path}: " + "; ".join(problems))
