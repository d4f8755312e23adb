"""Loading the Qwen3.5 / Qwen3.6 hybrid family (Gated DeltaNet + gated attention).

From GGUF (architecture ``qwen35``: the converter's transforms are undone here — value heads
tiled back to HF's grouped order; the stored ``1 + w`` norms and ``ssm_a = -exp(A_log)`` are
already what the modules hold) or from a Hugging Face directory (``Qwen3_5ForCausalLM``, or the
text model of ``Qwen3_5ForConditionalGeneration``).

Keep-quantized (GGUF only): the linears whose weights have a matmul kernel and the token embedding
keep the file's blocks (``models.quantized.swap_quant_modules``). Untiling the value heads of such
a weight: where they run along its output features (rows: ``attn_qkv``, ``attn_gate``,
``ssm_beta``, ``ssm_alpha``) whole rows of blocks move, exactly as rows of values would; where
they run along its input features (``ssm_out``'s columns), which blocks span, the weight stays in
the file's order and its input is put in that order instead (``PermutedInputs``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from native.gguf_matmul import QuantLinear
from splitspec.models.gguf_file import GGUFFile, ModelFileError, skip_other_tensors
from splitspec.models.hf_dir import HFDirectory
from splitspec.models.quantized import interleave_layers, link_producers, swap_quant_modules
from splitspec.models.qwen35 import QWEN35_ARCHS, Qwen35Config, Qwen35ForCausalLM
from splitspec.models.weights import load_gguf_raw, progress

QWEN35_HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

# GGUF tensor name (after ``blk.N.``) -> module parameter name (after ``layers.N.``), per layer kind.
QWEN35_SHARED_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QWEN35_ATTENTION_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",  # [q_h | gate_h] per head, as in HF
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
QWEN35_DELTANET_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.ssm_a",  # stored as -exp(A_log), which is what the module holds
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv_weight",  # [C, K], HF's [C, 1, K] squeezed
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# DeltaNet tensors whose value heads the converter tiles: (axis, head width is Dv, heads start after q|k).
QWEN35_TILED_V_HEADS = {
    "attn_qkv.weight": (0, True, True),
    "ssm_conv1d.weight": (0, True, True),
    "attn_gate.weight": (0, True, False),
    "ssm_out.weight": (1, True, False),
    "ssm_beta.weight": (0, False, False),
    "ssm_alpha.weight": (0, False, False),
    "ssm_a": (0, False, False),
    "ssm_dt.bias": (0, False, False),
}


def tiled_v_head_order(num_key_heads: int, num_value_heads: int) -> np.ndarray:
    """``[Hv]``: the GGUF converter's value-head order, as HF (grouped) head indices.

    HF groups value heads by key head (head ``k * R + r`` reads key head ``k``, ``R = Hv / Hk``);
    the converter tiles them so that ggml's broadcast pairs position ``p`` with key head ``p % Hk``:
    position ``r * Hk + k`` holds HF head ``k * R + r``. E.g. ``Hk = 2, Hv = 6`` -> ``[0, 3, 1, 4, 2, 5]``.
    """
    return np.arange(num_value_heads).reshape(num_key_heads, num_value_heads // num_key_heads).T.reshape(-1)


def v_head_index(size: int, name: str, order: np.ndarray, config: Qwen35Config) -> np.ndarray:
    """``[size]``: the gather along the value-head axis (``QWEN35_TILED_V_HEADS``) of the DeltaNet
    tensor ``name`` that makes head ``i`` out of head ``order[i]``; the q and k channels before the
    value heads of ``attn_qkv`` and the conv stay where they are."""
    _, per_dim, after_qk = QWEN35_TILED_V_HEADS[name]
    width = config.linear_value_head_dim if per_dim else 1
    offset = 2 * config.key_dim if after_qk else 0
    index = np.arange(size)
    index[offset:] = offset + (order[:, None] * width + np.arange(width)).reshape(-1)
    return index


def permute_v_heads(array: np.ndarray, name: str, order: np.ndarray, config: Qwen35Config) -> np.ndarray:
    """Reorder the value heads of the DeltaNet tensor ``name`` (GGUF naming): head ``i`` of the
    result is head ``order[i]`` of ``array``. Tensors without value heads come back unchanged."""
    if name not in QWEN35_TILED_V_HEADS:
        return array
    axis = QWEN35_TILED_V_HEADS[name][0]
    return np.take(array, v_head_index(array.shape[axis], name, order, config), axis=axis)


class PermutedInputs(nn.Module):
    """``linear(x[..., index])``: a linear layer whose weight holds its input features in another
    order than the activations it is given; stored feature ``j`` is activation feature
    ``index[j]`` (``index``: int64 buffer [in_features], not part of the state dict).

    For a quantized weight whose columns would need permuting: blocks run along the input
    features, so its rows of bytes cannot be re-ordered that way, while one gather of the
    [T, in_features] activations per call costs little next to the matmul."""

    def __init__(self, linear: nn.Module, index: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("index", index, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.index))


def is_qwen35(path: Path) -> bool:
    """Whether a local GGUF file or Hugging Face directory holds this family."""
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type") in QWEN35_HF_MODEL_TYPES
        except (OSError, ValueError):
            return False  # the dense loader reports what is wrong with the directory
    return GGUFFile(path).architecture in QWEN35_ARCHS


def _kv_head_count(value, source: str) -> int:
    """``attention.head_count_kv`` is a scalar or a per-layer array with 0 for DeltaNet layers."""
    counts = {int(v) for v in (value if isinstance(value, list) else [value])} - {0}
    if len(counts) != 1:
        raise ModelFileError(f"{source}: attention.head_count_kv {value!r} has no single attention KV head count")
    return counts.pop()


def qwen35_config_from_gguf(f: GGUFFile) -> Qwen35Config:
    a = f.architecture
    vocab_size, _ = f.tensor_shape("token_embd.weight")
    value_heads = int(f.get(f"{a}.ssm.time_step_rank"))
    heads = int(f.get(f"{a}.attention.head_count"))
    try:
        return Qwen35Config(
            vocab_size=vocab_size,
            hidden_size=int(f.get(f"{a}.embedding_length")),
            intermediate_size=int(f.get(f"{a}.feed_forward_length")),
            num_layers=int(f.get(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=_kv_head_count(f.get(f"{a}.attention.head_count_kv"), str(f.path)),
            head_dim=int(f.get(f"{a}.attention.key_length")),
            rotary_dim=int(f.get(f"{a}.rope.dimension_count")),
            linear_num_key_heads=int(f.get(f"{a}.ssm.group_count")),
            linear_num_value_heads=value_heads,
            linear_key_head_dim=int(f.get(f"{a}.ssm.state_size")),
            linear_value_head_dim=int(f.get(f"{a}.ssm.inner_size")) // value_heads,
            conv_kernel=int(f.get(f"{a}.ssm.conv_kernel")),
            full_attention_interval=int(f.get(f"{a}.full_attention_interval")),
            rope_theta=float(f.get(f"{a}.rope.freq_base", 10_000_000.0)),
            rms_norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_context=int(f.get(f"{a}.context_length", 262144)),
            tie_word_embeddings=not f.has_tensor("output.weight"),
        )
    except ValueError as exc:
        raise ModelFileError(f"{f.path}: {exc}") from exc


def _load_qwen35_state(
    model: Qwen35ForCausalLM, read, source: str, device, dtype, packed: dict[str, torch.Tensor] | None = None
) -> Qwen35ForCausalLM:
    """Fill ``model`` (on the meta device) from ``read(param_name, shape) -> float32 array/tensor``
    and ``packed``, the raw blocks of the modules kept quantized (state name -> uint8 tensor)."""
    state = dict(packed or {})
    for name, param in progress(list(model.named_parameters()), f"loading {source}"):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        value = torch.as_tensor(read(name, tuple(param.shape)))
        state[name] = value.to(device=device, dtype=dtype)
    if model.config.tie_word_embeddings:  # one tensor for both: the blocks, where kept quantized
        part = "raw" if isinstance(model.lm_head, QuantLinear) else "weight"
        state[f"lm_head.{part}"] = state[f"embed_tokens.{part}"]
    model.load_state_dict(state, assign=True, strict=True)
    interleave_layers(model, dtype)
    model.fuse_projections()
    link_producers(model)
    return model.eval()


def _keep_blocks(model: Qwen35ForCausalLM, f: GGUFFile, names: dict[str, str], device, dtype) -> dict[str, torch.Tensor]:
    """Swap the modules of ``model`` (on the meta device) that keep-quantized keeps in blocks and
    read their blocks, value heads untiled (module docstring): state name -> uint8 [rows, row bytes]."""
    c = model.config
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = c.tie_word_embeddings
    types = {name: f.raw(gguf)[1] for name, gguf in names.items() if name in shapes and not (tied and name == "lm_head.weight")}
    swapped = swap_quant_modules(model, types, dtype, tied)
    tile = tiled_v_head_order(c.linear_num_key_heads, c.linear_num_value_heads)
    untile = np.argsort(tile)
    packed = {}
    for weight, raw_name in progress(list(swapped.items()), f"loading {f.path.name} (blocks)"):
        gguf_name = names[weight]
        raw, _ = load_gguf_raw(f, gguf_name, shapes[weight], device)  # [out, row bytes]
        short = gguf_name.split(".", 2)[-1]
        axis = QWEN35_TILED_V_HEADS[short][0] if short in QWEN35_TILED_V_HEADS else None
        if axis == 0:  # value heads along the output features: whole rows of blocks move
            raw = raw[torch.as_tensor(v_head_index(raw.shape[0], short, untile, c), device=raw.device)]
        elif axis == 1:  # along the input features: the weight keeps the file's order, its input takes it
            module = weight.removesuffix(".weight")
            index = v_head_index(shapes[weight][1], short, tile, c)
            model.set_submodule(module, PermutedInputs(model.get_submodule(module), torch.as_tensor(index, device=device)))
            raw_name = f"{module}.linear.raw"
        packed[raw_name] = raw
    return packed


def qwen35_gguf_names(config: Qwen35Config) -> dict[str, str]:
    """Module parameter name -> GGUF tensor name."""
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(config.num_layers):
        kind = QWEN35_ATTENTION_NAMES if config.is_full_attention(i) else QWEN35_DELTANET_NAMES
        for src, dst in {**QWEN35_SHARED_NAMES, **kind}.items():
            names[f"layers.{i}.{dst}"] = f"blk.{i}.{src}"
    return names


def load_qwen35(
    path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype, state_dtype: torch.dtype | None,
    keep_quantized: bool = False,
) -> tuple[Qwen35ForCausalLM, Qwen35Config]:
    """``keep_quantized``: a GGUF's kernel-typed linears and quantized embedding stay in their
    blocks (module docstring); a Hugging Face directory has no blocks to keep."""
    path = Path(path)
    if path.is_dir():
        return load_qwen35_hf(path, device, dtype, state_dtype)
    f = GGUFFile(path)
    config = qwen35_config_from_gguf(f)
    names = qwen35_gguf_names(config)
    read_names = [n for n in names.values() if not (n == "output.weight" and config.tie_word_embeddings)]
    skip_other_tensors(f.path, f.tensor_names(), read_names, "qwen35")
    untile = np.argsort(tiled_v_head_order(config.linear_num_key_heads, config.linear_num_value_heads))

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        gguf_name = names[name]
        # GGUF has no per-tensor layout flag: tiled value heads are a property of the architecture.
        array = f.tensor(gguf_name, shape)
        return permute_v_heads(array, gguf_name.split(".", 2)[-1], untile, config)

    with torch.device("meta"):
        model = Qwen35ForCausalLM(config, state_dtype)
    packed = _keep_blocks(model, f, names, device, dtype) if keep_quantized else {}
    return _load_qwen35_state(model, read, path.name, device, dtype, packed), config


# --- qwen35 from a Hugging Face directory (Qwen3_5ForCausalLM, or the text model of Qwen3_5ForConditionalGeneration)


def _text_prefix(d: HFDirectory) -> str:
    """Where the text model's tensors live: ``model.language_model.`` (multimodal) or ``model.``."""
    return "model.language_model." if d.has_tensor("model.language_model.embed_tokens.weight") else "model."


def _hf_text_config(directory: Path) -> tuple[dict, dict]:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: cannot read config ({exc})") from exc
    if raw.get("model_type") not in QWEN35_HF_MODEL_TYPES:
        raise ModelFileError(f"{path}: model_type {raw.get('model_type')!r} is not one of {', '.join(QWEN35_HF_MODEL_TYPES)}")
    return raw, raw.get("text_config", raw)


def qwen35_config_from_hf(directory: Path) -> Qwen35Config:
    raw, text = _hf_text_config(directory)
    source = str(directory / "config.json")

    def need(key: str):
        if key not in text:
            raise ModelFileError(f"{source}: missing key {key!r}")
        return text[key]

    layers = int(need("num_hidden_layers"))
    interval = int(text.get("full_attention_interval", 4))
    layer_types = text.get("layer_types")
    if layer_types:
        interval = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else layers + 1
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if layer_types != expected:
            raise ModelFileError(f"{source}: layer_types {layer_types} is not a full_attention_interval pattern")
    rope = text.get("rope_parameters") or {}
    head_dim = int(need("head_dim"))
    try:
        return Qwen35Config(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            full_attention_interval=interval,
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_context=int(text.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )
    except ValueError as exc:
        raise ModelFileError(f"{source}: {exc}") from exc


def qwen35_from_hf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """HF tensor -> module parameter: zero-centred norms get their 1 back, ``A_log`` becomes
    ``ssm_a = -exp(A_log)`` and the conv weight loses its singleton dim (the GGUF converter's
    transforms, which the module's layout follows)."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return tensor + 1.0
    if name.endswith("linear_attn.ssm_a"):
        return -tensor.exp()
    if name.endswith("linear_attn.conv_weight"):
        return tensor.squeeze(1)
    return tensor


def qwen35_hf_name(name: str, prefix: str) -> str:
    if name == "lm_head.weight":
        return name
    return prefix + name.replace("linear_attn.conv_weight", "linear_attn.conv1d.weight").replace("linear_attn.ssm_a", "linear_attn.A_log")


def load_qwen35_hf(
    directory: Path, device: torch.device | str, dtype: torch.dtype, state_dtype: torch.dtype | None
) -> tuple[Qwen35ForCausalLM, Qwen35Config]:
    config = qwen35_config_from_hf(directory)
    weights = HFDirectory(directory)
    prefix = _text_prefix(weights)
    with torch.device("meta"):
        wanted = [qwen35_hf_name(name, prefix) for name, _ in Qwen35ForCausalLM(config).named_parameters()]
    skip_other_tensors(directory, weights.tensor_names(), wanted, "qwen35")

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = qwen35_from_hf(name, weights.tensor(qwen35_hf_name(name, prefix)).float())
        if tuple(tensor.shape) != shape:
            raise ModelFileError(f"{directory}: tensor {qwen35_hf_name(name, prefix)!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor

    with torch.device("meta"):
        model = Qwen35ForCausalLM(config, state_dtype)
    return _load_qwen35_state(model, read, directory.name, device, dtype), config


def load_qwen35_hf_head(
    directory: Path, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, Qwen35Config]:
    config = qwen35_config_from_hf(directory)
    weights = HFDirectory(directory)
    embed = weights.tensor(_text_prefix(weights) + "embed_tokens.weight").to(device=device, dtype=dtype)
    head = embed if config.tie_word_embeddings else weights.tensor("lm_head.weight").to(device=device, dtype=dtype)
    return embed, head, config
