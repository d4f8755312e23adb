"""DFlash2 block drafter: DFlash plus two-tap dynamic convolutions and a candidate path selector.

DFlash2 (z-lab / Inco AI, 2026; checkpoints ``DFlash2DraftModel``) keeps DFlash's block pass
(``splitspec.models.dflash``) and adds two parts. The equations below are the ones this file
implements; docs/dflash2.md says where each was pinned from.

Terms
-----
block row t
    Row ``t`` of the block ``[anchor, MASK × (B-1)]`` (``0 <= t < B``); row ``t >= 1`` predicts the
    token at depth ``t``. Context rows (projected target features) are never convolved.
dynamic convolution (``DynamicConv``)
    Around every attention and MLP sublayer. From the sublayer's normed input ``u`` one projection
    gives per row coefficients ``D = kernel_projection(u)`` [2, taps, H / G] (side, tap, group; G =
    ``conv_group_size`` channels share a coefficient). Side s's kernel is
    ``k[t, s, j, c] = base_kernel[s, j, c] + D[t, s, j, c // G]`` and
    ``conv_s(x)_t = sum_j k[t, s, j] * x_{t-j}`` with ``x_{t-j} = 0`` before the block's row 0.
    Side 0 convolves the sublayer's input, side 1 its output (after ``o_proj`` / ``down_proj``,
    before the residual add), both with the same ``D``. No bias, no activation; float32 arithmetic.
candidates
    The top-K tokens of each depth's logits ``z_t = softcap(output_multiplier * head(h_t))``
    (``K = selector_top_k`` in the published drafts).
pair score
    ``S_t(a, b) = U_t(b) + <A[a] * gate_t, B[b]>`` for a candidate ``b`` of depth ``t`` after a
    predecessor ``a``: the anchor at depth 1, a candidate of depth ``t - 1`` deeper.
    ``U_t(b) = z_t(b)``; ``A``, ``B`` are token-indexed codebooks [vocab, rank];
    ``gate_t = hidden_projection(h_t)`` [rank], linear. The draft worker sends ``S`` with
    ``log_softmax(z_t)`` as the unary term: that is ``U`` minus a constant per depth, so every
    argmax and every softmax over a depth's candidates is the same.
selector path
    The greedy walk: ``d_1 = argmax_b S_1(anchor, b)``, ``d_t = argmax_b S_t(d_{t-1}, b)``, ties to
    the better-ranked candidate (``splitspec.spec.lattice``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from native import dynamic_conv, selector, use_triton
from splitspec.models.dflash import (
    ConfigKeys,
    DFlashConfig,
    DFlashDraft,
    DFlashLayer,
    PooledAttention,
    attend_pooled,
    project_write,
)
from splitspec.models.layers import RMSNorm


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2  # taps of the dynamic convolution
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = 16
    sliding_window: int = 0  # a block row at position p sees context positions > p - window (0: all)
    output_multiplier: float = 1.0  # draft logits are scaled by it, then soft-capped
    final_logit_softcapping: float = 0.0  # cap * tanh(z / cap); 0 = none

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> DFlash2Config:
        """Parse a published DFlash2 ``config.json`` (a Qwen3 config, ``dflash_config`` holding the
        DFlash2 keys; a key is read there first, then at the top level)."""
        keys = ConfigKeys(raw, source)
        num_layers = int(keys.need("num_hidden_layers"))
        layer_types = list(raw.get("layer_types") or ["full_attention"] * num_layers)
        if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"{source}: layer_types {layer_types} must name full_attention or sliding_attention for each of {num_layers} layers")
        if len(set(layer_types)) > 1:
            raise ValueError(f"{source}: layer_types {layer_types} mix sliding and full attention; one kind for every layer is supported")
        if raw.get("is_causal"):
            raise ValueError(f"{source}: is_causal is true; DFlash2 blocks are non-causal")
        config = cls(**{
            **DFlashConfig.shared_fields(keys),
            "vocab_size": int(keys.need("vocab_size")),
            "conv_kernel_size": int(keys.need("conv_kernel_size")),
            "conv_group_size": int(keys.need("conv_group_size")),
            "selector_rank": int(keys.need("selector_rank")),
            "selector_top_k": int(keys.need("selector_top_k")),
            "sliding_window": int(keys.need("sliding_window")) if layer_types[0] == "sliding_attention" else 0,
            "output_multiplier": float(keys.get("output_multiplier", 1.0)),
            "final_logit_softcapping": float(keys.get("final_logit_softcapping", 0.0)),
        })
        config.check(source)
        return config

    def check(self, source: str) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if self.block_size < 2:
            raise ValueError(f"{source}: block_size must be at least 2, got {self.block_size}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{source}: {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"{source}: conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"{source}: selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")
        if self.sliding_window and self.sliding_window < self.block_size:
            raise ValueError(f"{source}: sliding_window {self.sliding_window} is shorter than the block ({self.block_size})")

    def to_dict(self, num_target_layers: int) -> dict[str, Any]:
        """The published ``config.json`` layout, which ``from_dict`` reads."""
        raw = super().to_dict(num_target_layers)
        sliding = bool(self.sliding_window)
        raw.update(
            architectures=["DFlash2DraftModel"],
            is_causal=False,
            layer_types=["sliding_attention" if sliding else "full_attention"] * self.num_layers,
            use_sliding_window=sliding,
            sliding_window=self.sliding_window or None,
        )
        raw["dflash_config"].update(
            block_size=self.block_size,
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size,
            selector_rank=self.selector_rank,
            selector_top_k=self.selector_top_k,
        )
        if self.output_multiplier != 1.0:
            raw["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            raw["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        return raw


class DynamicConv(nn.Module):
    """The two-tap (``taps``) grouped dynamic depthwise convolution along a block's rows (module
    docstring). Inputs are ``[..., Q, H]`` with ``Q`` a whole number of blocks of ``block_size`` rows."""

    def __init__(self, hidden: int, taps: int, group: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group, self.block_size = taps, group, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:
        """Per row dynamic coefficients [..., Q, 2, taps, H / G] of the normed sublayer input ``u``,
        in u's dtype: the convolution widens them where it reads them (one cast kernel fewer)."""
        return self.kernel_projection(u).unflatten(-1, (2, self.taps, -1))

    def forward(self, x: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        """``conv_side(x)`` [..., Q, H] in x's dtype, computed in float32 at least (one launch of
        ``native.dynamic_conv`` where kernels run)."""
        one_side, base = coefficients[..., side, :, :], self.base_kernel[side]
        if use_triton(x, "dynamic_conv", one_side, base) and dynamic_conv.supported(x, one_side, base):
            return dynamic_conv.dynamic_conv(x, one_side, base, self.group, self.block_size)
        b, wide = self.block_size, _wide(x.dtype)
        kernel = base.to(wide) + one_side.to(wide).repeat_interleave(self.group, dim=-1)  # [..., Q, taps, H]
        xs = x.to(wide).unflatten(-2, (-1, b))  # [..., Q / B, B, H]
        kernel = kernel.unflatten(-3, (-1, b))  # [..., Q / B, B, taps, H]
        out = kernel[..., 0, :] * xs
        for j in range(1, self.taps):  # x_{t-j}: rows shifted down inside each block, zeros above row 0
            out = out + kernel[..., j, :] * F.pad(xs[..., : b - j, :], (0, 0, j, 0))
        return out.flatten(-3, -2).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, coefficients: torch.Tensor, side: int, residual: torch.Tensor, norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm.forward_add(self(x, coefficients, side), residual)``: a sublayer's output side,
        residual add and the next norm, in one launch of ``native.dynamic_conv`` where kernels run."""
        one_side, base = coefficients[..., side, :, :], self.base_kernel[side]
        if use_triton(x, "dynamic_conv", one_side, base, residual, norm.weight) and dynamic_conv.add_norm_supported(
            x, one_side, base, residual, norm.weight,
        ):
            return dynamic_conv.conv_add_rms_norm(x, one_side, base, self.group, self.block_size, residual, norm.weight, norm.eps)
        return norm.forward_add(self(x, coefficients, side), residual)


class DFlash2Layer(DFlashLayer):
    """A DFlash layer with ``attention_conv`` and ``mlp_conv`` around its two sublayers."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        c = config
        self.attention_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
        self.mlp_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def _mlp_inner(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's coefficients, its output before the output side's convolution) of the normed rows ``v``."""
        d = self.mlp_conv.coefficients(v)
        return d, self.mlp(self.mlp_conv(v, d, 0))

    def _mlp(self, v: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer of the normed rows ``v``, both convolutions included."""
        d, inner = self._mlp_inner(v)
        return self.mlp_conv(inner, d, 1)

    def _mlp_add_norm(self, v: torch.Tensor, h: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``next_norm.forward_add(self._mlp(v), h)``, the output side fused with the add and norm."""
        d, inner = self._mlp_inner(v)
        return self.mlp_conv.add_norm(inner, d, 1, h, next_norm)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask=None):
        attn = self.self_attn
        u = self.input_layernorm(h)
        d = self.attention_conv.coefficients(u)
        q, k, v = attn.query_key_value(self.attention_conv(u, d, 0), cos, sin)
        keys, values = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
        h = h + self.attention_conv(attn.attend(q, keys, values, mask), d, 1)
        return h + self._mlp(self.post_attention_layernorm(h))

    def forward_cached(self, x, h, cos, sin, k_cache, v_cache, slots, mask, next_norm):
        d = self.attention_conv.coefficients(x)
        a = self.self_attn.project_attend_cached(self.attention_conv(x, d, 0), cos, sin, k_cache, v_cache, slots, mask)
        x, h = self.attention_conv.add_norm(a, d, 1, h, self.post_attention_layernorm)
        return self._mlp_add_norm(x, h, next_norm)

    def forward_pooled(self, x, h, cos, sin, k_pool, v_pool, at: PooledAttention, next_norm: RMSNorm):
        d = self.attention_conv.coefficients(x)
        q = project_write(self.self_attn, self.attention_conv(x, d, 0), cos, sin, k_pool, v_pool, at.write_slots)
        x, h = self.attention_conv.add_norm(attend_pooled(self.self_attn, q, k_pool, v_pool, at), d, 1, h, self.post_attention_layernorm)
        return self._mlp_add_norm(x, h, next_norm)


class CandidateSelector(nn.Module):
    """The pair scores of a block's candidates (module docstring: pair score)."""

    def __init__(self, hidden: int, rank: int, vocab: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))  # A
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))  # B

    def pair_scores(
        self,
        hidden: torch.Tensor,  # [..., L, H] final-normed draft rows of depths 1..L
        unary: torch.Tensor,  # [..., L, K] U_t of the candidates (or U_t minus a constant per depth)
        candidates: torch.Tensor,  # [..., L, K] token ids, best first
        anchor: torch.Tensor,  # [...] int: the depth-1 predecessor
    ) -> torch.Tensor:
        """S [..., L, K, K] float32: ``S[t-1, a, b]`` scores candidate b of depth t after candidate a
        of depth t - 1 (depth 1: after the anchor, in every row a)."""
        gate = self.hidden_projection(hidden)  # [..., L, R]
        a_book, b_book = self.predecessor_codebook, self.successor_codebook
        if use_triton(hidden, "selector", gate, a_book, b_book) and selector.supported(gate, a_book, b_book, unary, candidates):
            return selector.pair_scores(gate, a_book, b_book, unary, candidates, anchor)
        k = candidates.shape[-1]
        first = anchor[..., None, None].expand(*candidates.shape[:-2], 1, k)  # [..., 1, K]
        before = torch.cat([first, candidates[..., :-1, :]], dim=-2)  # [..., L, K] predecessors
        a = self._gated_predecessors(gate[..., None, :], before)  # [..., L, K, R]
        b = b_book[candidates.long()].to(a.dtype)  # [..., L, K, R]
        return unary.float()[..., None, :] + (a @ b.transpose(-1, -2)).float()

    def scores_after(
        self,
        hidden: torch.Tensor,  # [..., H] final-normed draft rows
        unary: torch.Tensor,  # [..., K]
        candidates: torch.Tensor,  # [..., K] token ids
        predecessor: torch.Tensor,  # [...] token ids: each row's one predecessor
    ) -> torch.Tensor:
        """``S(predecessor, b)`` [..., K] float32 of each row's candidates after its one given
        predecessor (training: the text's previous token)."""
        a = self._gated_predecessors(self.hidden_projection(hidden), predecessor)  # [..., R]
        b = self.successor_codebook[candidates.long()].to(a.dtype)  # [..., K, R]
        return unary.float() + (b @ a[..., None]).squeeze(-1).float()

    def _gated_predecessors(self, gate: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """``A[a] * gate`` [..., R] (float32 at least) for predecessor ids ``a`` [...] of rows' gates
        ``gate`` [..., R] (broadcast against each other)."""
        gate = gate.to(_wide(gate.dtype))
        return self.predecessor_codebook[predecessors.long()].to(gate.dtype) * gate


class DFlash2Draft(DFlashDraft):
    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.selector_rank, config.vocab_size)

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target head's logits of draft rows -> ``z`` (scaled, soft-capped; float32 when transformed)."""
        c: DFlash2Config = self.config
        if c.output_multiplier != 1.0:
            logits = logits.float() * c.output_multiplier
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = cap * torch.tanh(logits.float() / cap)
        return logits


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def init_dflash2_extras(model: DFlash2Draft) -> None:
    """Fresh DFlash2 parts: identity convolutions (tap 0 one, the rest zero, no dynamic part), as
    the published conversion of a DFlash draft starts them, and a selector whose pair terms are
    zero (the successor codebook at zero) while their gradients are not (a small random
    predecessor codebook and gate projection; the conversion zeroes those too)."""
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0].fill_(1.0)
                conv.kernel_projection.weight.zero_()
        s = model.candidate_selector
        s.hidden_projection.weight.normal_(0.0, s.hidden_projection.in_features ** -0.5)
        s.predecessor_codebook.normal_(0.0, 0.02)
        s.successor_codebook.zero_()
