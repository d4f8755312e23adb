"""Linear layers kept in GGUF blocks: the module swap, and which type llama.cpp's Q4_K_M gives each.

``swap_quant_linears`` replaces ``nn.Linear`` modules (of a model on the meta device) with
``native.gguf_matmul.QuantLinear``; it works for every family, since the models call their
linears as modules. ``q4_k_m_types`` is llama.cpp's Q4_K_M recipe (``llama_tensor_get_type`` in
``src/llama-quant.cpp``) for the linear layers.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from torch import nn

from native.gguf_matmul import QuantLinear


def swap_quant_linears(model: nn.Module, types: dict[str, Q]) -> dict[str, str]:
    """Replace each ``nn.Linear`` named in ``types`` (module name -> block type) by a ``QuantLinear``
    on the meta device; returns weight name -> the name of its packed bytes (``NAME.raw``)."""
    swapped = {}
    for module_name, qtype in types.items():
        module = model.get_submodule(module_name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{module_name} is a {type(module).__name__}, not an nn.Linear")
        linear = QuantLinear(qtype, module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        model.set_submodule(module_name, linear)
        swapped[f"{module_name}.weight"] = f"{module_name}.raw"
    return swapped


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits: the first and last
    eighth, and every third layer between (about half of them)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# GGUF's attn_v and attn_qkv (a fused q/k/v, here Gated DeltaNet's): llama.cpp's "attn_v-like" tensors.
ATTN_V_LIKE = ("self_attn.v_proj", "linear_attn.in_proj_qkv")


def q4_k_m_types(model: nn.Module) -> dict[str, Q]:
    """Module name -> block type of every linear layer of a decoder ``model`` (``layers``, ``lm_head``)
    under Q4_K_M, as llama.cpp's ``llama_tensor_get_type`` picks it: the LM head Q6_K; the
    ``ATTN_V_LIKE`` linears (one per layer in these families) Q6_K where ``use_more_bits`` of their
    index among all of them, ``mlp.down_proj`` Q6_K where ``use_more_bits`` of its layer; every
    other linear Q4_K (the token embedding too, which is no linear here). No Q4_K_M linear of these
    families is Q5_K: llama.cpp's Q5_K cases are 8-expert MoE models, 70B Llamas and Falcon.

    llama.cpp before its early-2026 refactor of type selection (PR #19770, which made ``attn_qkv``
    attn_v-like and so left its own Q5_K branch unreachable) gave every ``attn_qkv`` Q5_K and
    indexed only the ``attn_v`` tensors, over a count that included ``attn_qkv``: Qwen3.5 files
    quantized before March 2026 may hold that mix instead (0.05% fewer weight bytes for Qwen3.5-27B).
    """
    layers = list(model.layers)
    v_like = [f"layers.{i}.{name}" for i, layer in enumerate(layers) for name, _ in layer.named_modules() if name in ATTN_V_LIKE]
    types = {"lm_head": Q.Q6_K}
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            full = f"layers.{i}.{name}"
            if full in v_like:  # llama.cpp counts them in file order: by layer
                more = use_more_bits(v_like.index(full), len(v_like))
            elif name == "mlp.down_proj":
                more = use_more_bits(i, len(layers))
            else:
                more = False
            types[full] = Q.Q6_K if more else Q.Q4_K
    return types
