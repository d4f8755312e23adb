"""Linear layers kept in GGUF blocks: the module swap, and which type llama.cpp's Q4_K_M gives each.

``swap_quant_linears`` replaces ``nn.Linear`` modules (of a model on the meta device) with
``native.gguf_matmul.QuantLinear``; it works for every family, since the models call their
linears as modules. ``q4_k_m_types`` is llama.cpp's Q4_K_M recipe (``llama_tensor_get_type`` in
``src/llama-quant.cpp``) for the linears that have a kernel type, with one stated simplification.
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


def q4_k_m_types(model: nn.Module) -> dict[str, Q]:
    """Module name -> block type of every linear layer of a decoder ``model`` (``layers``, ``lm_head``)
    under Q4_K_M: the LM head Q6_K; attention ``v_proj`` Q6_K where ``use_more_bits`` of its index
    among the attention layers, ``mlp.down_proj`` Q6_K where ``use_more_bits`` of its layer; every
    other linear Q4_K (the token embedding too, which the loaders dequantize: it is no linear here).

    Simplification: llama.cpp gives a fused ``attn_qkv`` (Gated DeltaNet's ``in_proj_qkv``) Q5_K,
    for which there is no kernel; it gets Q6_K here (210 bytes per 256 values instead of 176, about
    2% more weight bytes for Qwen3.5-27B), so the benchmark errs on the slow side.
    """
    layers = list(model.layers)
    attention = [i for i, layer in enumerate(layers) if hasattr(layer, "self_attn")]
    types = {"lm_head": Q.Q6_K}
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            full = f"layers.{i}.{name}"
            if name == "self_attn.v_proj":
                more = use_more_bits(attention.index(i), len(attention))
            elif name == "mlp.down_proj":
                more = use_more_bits(i, len(layers))
            else:
                more = name == "linear_attn.in_proj_qkv"
            types[full] = Q.Q6_K if more else Q.Q4_K
    return types
