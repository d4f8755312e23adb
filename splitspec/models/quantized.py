"""Linear layers kept in GGUF blocks: the module swap, and which type llama.cpp's Q4_K_M gives each.

``swap_quant_linears`` replaces ``nn.Linear`` modules (of a model on the meta device) with
``native.gguf_matmul.QuantLinear``; it works for every family, since the models call their
linears as modules. ``q4_k_m_types`` is llama.cpp's Q4_K_M recipe (``llama_tensor_get_type`` in
``src/llama-quant.cpp``) for the linear layers.
``QuantEmbedding`` keeps a token embedding in its blocks too, and ``swap_quant_modules`` is the
whole keep-quantized swap of a decoder the loaders make (linears, embedding, tied head), and
``interleave_layers`` the layout its Q4_K and Q6_K blocks take on a GPU.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from native import gguf_mma, switched_off
from native.gguf_dequant import dequantize
from native.gguf_matmul import KERNEL_TYPES, QuantLinear, interleavable, row_bytes

logger = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------- embeddings and heads

# Types a bf16 copy is no larger than: an embedding in one of these is dequantized as before.
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


class QuantEmbedding(nn.Module):
    """A token embedding [num_embeddings, embedding_dim] whose rows stay in GGUF blocks.

    ``raw`` (buffer, uint8 [num_embeddings, row_bytes]): row ``t`` is token ``t``'s blocks exactly
    as the file stores them (a row is whole blocks, since GGUF blocks run along the hidden size). A
    lookup gathers the asked rows and dequantizes those alone (``native.gguf_dequant``) into
    ``dtype``, the compute dtype: the values indexing the dequantized table would give, bit for bit,
    without the table (2.5 GB in bf16 for a 248K-token vocabulary at hidden 5120).
    """

    def __init__(self, qtype: Q, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim, self.dtype = qtype, num_embeddings, embedding_dim, dtype
        raw = torch.empty(num_embeddings, row_bytes(qtype, embedding_dim), dtype=torch.uint8, device=device)
        self.register_buffer("raw", raw)

    @classmethod
    def of(cls, raw: torch.Tensor, qtype: Q, embedding_dim: int, dtype: torch.dtype) -> QuantEmbedding:
        """The embedding holding ``raw`` (uint8 [vocab, row_bytes], not copied)."""
        module = cls(qtype, raw.shape[0], embedding_dim, dtype, device="meta")
        module.raw = raw
        return module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (int64) -> [..., embedding_dim] in ``dtype``."""
        rows = self.raw.index_select(0, ids.reshape(-1))  # [N, row_bytes]
        values = dequantize(rows, self.qtype, (rows.shape[0], self.embedding_dim))  # [N, dim] float32
        return values.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, {self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"


def quant_linear(raw: torch.Tensor, qtype: Q, in_features: int) -> QuantLinear:
    """A bias-free ``QuantLinear`` holding ``raw`` (uint8 [out_features, row_bytes], not copied)."""
    linear = QuantLinear(qtype, in_features, raw.shape[0], device="meta")
    linear.raw = raw
    return linear


def keeps_embedding(qtype: Q, tied: bool) -> bool:
    """Whether a token embedding stored as ``qtype`` stays in its blocks under keep-quantized: a
    block type (a float type is no smaller than its dequantized copy), and, when the LM head is the
    same tensor (``tied``), one with a matmul kernel, so that both read one copy of the blocks
    (otherwise both share one dequantized tensor, as without keep-quantized)."""
    return qtype not in FLOAT_TYPES and (not tied or qtype in KERNEL_TYPES)


def swap_quant_modules(model: nn.Module, types: dict[str, Q], dtype: torch.dtype, tied: bool) -> dict[str, str]:
    """Keep-quantized for a decoder ``model`` (``embed_tokens``, ``lm_head``) on the meta device:
    ``types`` is module weight name -> the GGUF type of the tensor it loads from (a tied
    ``lm_head.weight`` is absent). Every ``nn.Linear`` whose type has a kernel becomes a
    ``QuantLinear`` (``swap_quant_linears``) and the embedding a ``QuantEmbedding`` where
    ``keeps_embedding``; a tied head follows the embedding. Returns weight name -> the state name
    of its packed bytes (``NAME.raw``); a tied head's bytes are the embedding's, which the caller
    shares (``lm_head.raw``)."""
    linears = {}
    for name, module in model.named_modules():
        qtype = types.get(f"{name}.weight")
        if isinstance(module, nn.Linear) and qtype in KERNEL_TYPES:
            linears[name] = qtype
    embed_type = types["embed_tokens.weight"]
    keep_embed = keeps_embedding(embed_type, tied)
    if tied and keep_embed:
        linears["lm_head"] = embed_type
    swapped = swap_quant_linears(model, linears)
    if keep_embed:
        embed = model.embed_tokens
        model.embed_tokens = QuantEmbedding(embed_type, embed.num_embeddings, embed.embedding_dim, dtype, device="meta")
        swapped["embed_tokens.weight"] = "embed_tokens.raw"
    if tied:
        swapped.pop("lm_head.weight", None)  # its bytes are the embedding's, not a tensor of the file
    return swapped


def embedding_rows(embed: torch.Tensor | QuantEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a token embedding held as a tensor [vocab, hidden] or a ``QuantEmbedding``
    (the draft worker takes either: keep-quantized or not)."""
    return embed(ids) if isinstance(embed, QuantEmbedding) else embed[ids]


def head_logits(hidden: torch.Tensor, head: torch.Tensor | nn.Module) -> torch.Tensor:
    """hidden [..., hidden] -> logits [..., vocab] in hidden's dtype, for an LM head held as a
    tensor [vocab, hidden] or a module (a ``QuantLinear``)."""
    return head(hidden) if isinstance(head, nn.Module) else hidden @ head.T.to(hidden.dtype)


def kept_summary(model: nn.Module) -> str:
    """What a keep-quantized load holds in GGUF blocks, for the log: e.g. ``24 linears in blocks
    (Q4_K 16, Q6_K 8), 1 dequantized; embedding in blocks (Q4_K)``."""
    kept: dict[str, int] = {}
    plain = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            kept[module.qtype.name] = kept.get(module.qtype.name, 0) + 1
        elif isinstance(module, nn.Linear):
            plain += 1
    types = ", ".join(f"{name} {count}" for name, count in sorted(kept.items()))
    text = f"{sum(kept.values())} linears in blocks ({types or 'none'}), {plain} dequantized"
    embed = getattr(model, "embed_tokens", None)
    if embed is not None:
        text += f"; embedding in blocks ({embed.qtype.name})" if isinstance(embed, QuantEmbedding) else "; embedding dequantized"
    return text


def head_summary(embed: torch.Tensor | nn.Module, head: torch.Tensor | nn.Module) -> str:
    """The draft's borrowed embedding and LM head, for the log: e.g. ``embedding in blocks (Q4_K),
    LM head in blocks (Q6_K)``."""
    parts = []
    for what, module in (("embedding", embed), ("LM head", head)):
        kept = isinstance(module, (QuantEmbedding, QuantLinear))
        parts.append(f"{what} in blocks ({module.qtype.name})" if kept else f"{what} dequantized")
    return ", ".join(parts)


def interleave_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold the Q4_K and Q6_K blocks of ``model.layers``' linears in the layout ``native.gguf_mma``'s
    kernels read fastest (``native.gguf_matmul.interleave``), where those kernels run: on their
    device, for a model computing in ``dtype`` bfloat16 (the kernel's; in other dtypes the Triton
    kernels would read a de-interleaved copy at every call). Returns how many changed. Call it
    before ``fuse_projections`` (a fused weight keeps its parts' layout). The embedding and the
    head keep the file's layout: an embedding's rows are looked up by token id, and a head may be
    handed to the draft as it is. ``SPLITSPEC_NATIVE_OFF=interleave`` keeps the file's layout
    (comparisons: ``native.switched_off``)."""
    if dtype != torch.bfloat16 or switched_off("interleave"):
        return 0
    linears = [m for m in model.layers.modules() if isinstance(m, QuantLinear) and interleavable(m.raw, m.qtype)]
    runs = {device: gguf_mma.runs_on(device) for device in {m.raw.device for m in linears}}  # once a device: it may build the extension
    changed = 0
    for module in linears:
        if runs[module.raw.device]:
            module.interleave()
            changed += 1
    if changed:
        logger.info("%d Q4_K and Q6_K weights interleaved for the GPU's quantized matmul", changed)
    return changed


def _reader_type(readers: tuple[nn.Module, ...]) -> Q | None:
    """The block type a producer whose output ``readers`` read is best run for: the most common of
    their Q4_K/Q6_K types (the others prepare x again from the producer's inputs), or None where a
    reader is no ``QuantLinear`` (it would read x's values) or none is Q4_K/Q6_K."""
    if not all(isinstance(m, QuantLinear) for m in readers):
        return None
    types = [m.qtype for m in readers if m.qtype in gguf_mma.A_OPERAND_TYPES]
    return max(types, key=types.count) if types else None


def link_producers(model: nn.Module) -> int:
    """Run each decoder layer's RMSNorms and SwiGLU activation inside the x preparation of the
    quantized matmuls that read their output (``native.gguf_mma.produce``): one launch fewer each,
    where the kernels run. Links ``model.layers``' input norms (read by the mixer's
    ``input_projections``), post-attention norms (read by the MLP's) and MLP activations (read by
    ``down_proj``); the final norm stays apart (the logits' rows are picked from its output).
    Returns how many were linked: none unless the model's weights lie where ``produce`` runs.
    Call it after ``fuse_projections``."""
    if not any(gguf_mma.prepares_on(m.raw.device) for m in model.layers.modules() if isinstance(m, QuantLinear)):
        return 0
    linked = 0
    for layer in model.layers:
        mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        for producer, readers in ((layer.input_layernorm, mixer.input_projections()),
                                  (layer.post_attention_layernorm, layer.mlp.input_projections())):
            producer.consumer = _reader_type(readers)
            linked += producer.consumer is not None
        layer.mlp.produced = _reader_type((layer.mlp.down_proj,))
        linked += layer.mlp.produced is not None
    if linked:
        logger.info("%d norms and activations run inside their quantized matmuls' x preparation", linked)
    return linked
