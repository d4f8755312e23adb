"""Qwen3.5 / Qwen3.6 hybrid decoder (``qwen35`` in GGUF, ``qwen3_5_text`` in HF), spec 4.1.

Layer ``i`` is gated full attention when ``(i + 1) % full_attention_interval == 0`` and Gated
DeltaNet otherwise (the 27B model: 48 DeltaNet + 16 attention layers). Both mixers sit in the
usual pre-norm residual block with a SwiGLU MLP.

- Gated attention: ``q_proj`` packs ``[q_h | gate_h]`` per head; per-head q/k RMSNorm; RoPE on
  the first ``rotary_dim`` of ``head_dim`` dims (text-only M-RoPE is ordinary RoPE); the head
  outputs are scaled by ``sigmoid(gate)`` before ``o_proj``.
- Gated DeltaNet: ``in_proj_qkv`` -> short causal depthwise conv (SiLU) -> q, k, v; L2-normalised
  q/k; log-decay ``g = ssm_a * softplus(in_proj_a x + dt_bias)`` with ``ssm_a = -exp(A_log)``;
  ``beta = sigmoid(in_proj_b x)``; the delta rule of :mod:`splitspec.models.delta_rule`; a
  per-head RMSNorm gated by ``SiLU(in_proj_z x)``; ``out_proj``. Value head ``h`` reads key head
  ``h // (value heads / key heads)`` (HF's grouped order; the GGUF loader undoes the tiling).

Norm weights are held *plain* (``x * rsqrt(mean(x^2) + eps) * w``): HF stores the zero-centred
``w - 1`` and the GGUF converter stores ``w`` already, so only the HF loader adds 1. The gated
norm is plain in both formats.

Sequence state (:class:`Qwen35Cache`): K/V of the attention layers, and per DeltaNet layer the
last ``K - 1`` conv inputs and the recurrent state. A chain pass (prefill, ``parents=None``)
advances it; a tree pass (verify) leaves it alone and keeps every row's candidate state, of which
:meth:`Qwen35Cache.commit` adopts the deepest accepted row's: one pass per step, with no second pass over the accepted tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from native.chunked_delta_rule import chunk_prefill
from splitspec.models.delta_rule import (
    ancestor_table,
    chain_parents,
    committed_history,
    conv_silu,
    conv_windows,
    gated_delta,
    gated_delta_chunked,
    l2_normalize,
)
from splitspec.models.layers import QKVProjection, RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from splitspec.models.paged import KVBlockPool, PagedState, PassInputs
from splitspec.spec.acceptance import compact_rows

QWEN35_ARCHS = ("qwen35",)  # GGUF general.architecture values of this family

@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of a head that RoPE rotates (64 of 256)
    linear_num_key_heads: int  # Gated DeltaNet
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    max_context: int = 262144
    tie_word_embeddings: bool = False
    architecture: ClassVar[str] = "qwen35"

    def __post_init__(self) -> None:
        checks = [
            (self.num_heads % self.num_kv_heads == 0, f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"),
            (
                self.linear_num_value_heads % self.linear_num_key_heads == 0,
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of linear_num_key_heads {self.linear_num_key_heads}",
            ),
            (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]"),
            (self.conv_kernel >= 2, f"conv_kernel {self.conv_kernel} must be >= 2"),
            (self.full_attention_interval >= 1, f"full_attention_interval {self.full_attention_interval} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def num_full_layers(self) -> int:
        return sum(self.is_full_attention(i) for i in range(self.num_layers))

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_full_layers

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the DeltaNet conv: ``[q | k | v]``."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class TreeNodeBytes:
    """Memory a verify pass holds per tree row until acceptance, over all layers."""

    recurrent: int  # the state after the row, every DeltaNet layer
    conv: int  # the row's conv input, every DeltaNet layer
    kv: int  # the row's K and V, every attention layer

    @property
    def total(self) -> int:
        return self.recurrent + self.conv + self.kv


def tree_node_bytes(config: Qwen35Config, dtype: torch.dtype, state_dtype: torch.dtype) -> TreeNodeBytes:
    """Bytes per tree row for compute ``dtype`` (conv inputs, K/V) and ``state_dtype``."""
    c = config
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return TreeNodeBytes(
        recurrent=c.num_linear_layers * state * state_dtype.itemsize,
        conv=c.num_linear_layers * c.conv_channels * dtype.itemsize,
        kv=c.num_full_layers * 2 * c.num_kv_heads * c.head_dim * dtype.itemsize,
    )


@dataclass
class PendingBlock:
    """Every row's candidate DeltaNet state from a tree pass, until :meth:`Qwen35Cache.commit`."""

    ancestors: torch.Tensor  # [T, K] the rows' ancestor table (see delta_rule)
    inputs: list[torch.Tensor] = field(default_factory=list)  # per DeltaNet layer [T, C] conv inputs
    states: list[torch.Tensor] = field(default_factory=list)  # per DeltaNet layer [T, Hv, Dk, Dv]


class Qwen35Cache:
    """One sequence's state: ``k``, ``v`` [num_full, H_kv, capacity, D] for the attention layers;
    ``conv`` [num_linear, K-1, C] (compute dtype) and ``recurrent`` [num_linear, Hv, Dk, Dv]
    (``state_dtype``) for the DeltaNet layers; ``pending`` after a tree pass."""

    def __init__(
        self, config: Qwen35Config, capacity: int, device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype
    ) -> None:
        c = config
        kv_shape = (c.num_full_layers, c.num_kv_heads, capacity, c.head_dim)
        self.k = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.v = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.conv = torch.zeros(c.num_linear_layers, c.conv_kernel - 1, c.conv_channels, device=device, dtype=dtype)
        state_shape = (c.num_linear_layers, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.recurrent = torch.zeros(state_shape, device=device, dtype=state_dtype)
        self.pending: PendingBlock | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.conv.nbytes + self.recurrent.nbytes

    def commit(self, start: int, accepted: Sequence[int]) -> None:
        """Keep the accepted rows (``[AL]``, root row 0 first) of the last verify block at ``start``:
        compact their K/V, and adopt the conv window and recurrent state of the deepest one."""
        if self.pending is None:
            raise RuntimeError("commit without a tree pass to commit")
        compact_rows(self.k, start, accepted)
        compact_rows(self.v, start, accepted)
        deepest = int(accepted[-1])
        ancestors = self.pending.ancestors[deepest : deepest + 1]  # [1, K]
        for i, (inputs, states) in enumerate(zip(self.pending.inputs, self.pending.states)):
            self.conv[i] = conv_windows(self.conv[i], inputs, ancestors)[0, 1:]
            self.recurrent[i] = states[deepest]
        self.pending = None


class Qwen35Slots:
    """Every sequence's DeltaNet state in fixed slots (a :class:`splitspec.models.paged.StateSlots`):
    ``conv`` [num_linear, slots, K-1, C] (compute dtype) and ``recurrent`` [num_linear, slots, Hv, Dk,
    Dv] (state dtype). Slot 0 is the pad slot, never given out. A tree pass leaves the slots alone
    and keeps every row's candidate (``pending``) until :meth:`commit`."""

    def __init__(self, config: Qwen35Config, slots: int, device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
        c = config
        self.conv = torch.zeros(c.num_linear_layers, slots + 1, c.conv_kernel - 1, c.conv_channels, device=device, dtype=dtype)
        shape = (c.num_linear_layers, slots + 1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.recurrent = torch.zeros(shape, device=device, dtype=state_dtype)
        self.pending: PendingBlock | None = None
        self._free = list(range(slots, 0, -1))
        self._lock = threading.Lock()  # slots come back from whichever thread drops a sequence

    def allocate(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self.conv[:, slot] = 0
        self.recurrent[:, slot] = 0
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def commit(self, slot: int, row: int) -> None:
        if self.pending is None:
            raise RuntimeError("commit without a tree pass to commit")
        for i, (inputs, states) in enumerate(zip(self.pending.inputs, self.pending.states)):
            self.conv[i, slot] = committed_history(self.conv[i, slot], inputs, self.pending.ancestors, row)
            self.recurrent[i, slot] = states[row]

    def read(self, slot: int) -> dict[str, torch.Tensor]:
        return {"conv": self.conv[:, slot], "recurrent": self.recurrent[:, slot]}


class GatedAttention(QKVProjection):
    """Qwen3.5 full attention: ``q_proj`` is twice as wide and packs ``[q_h | gate_h]`` per head."""

    def __init__(self, c: Qwen35Config) -> None:
        super().__init__(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_heads * c.head_dim, bias=False)

    def query_and_gate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> RoPE'd queries [H, T, D] and the output gate [T, H * D]."""
        t = x.shape[0]
        packed = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim)
        q = self.q_norm(packed[..., : self.head_dim])
        return apply_rope(q.transpose(0, 1), cos, sin), packed[..., self.head_dim :].reshape(t, -1)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer: conv over ``[q | k | v]``, delta rule, gated RMSNorm (module docstring)."""

    def __init__(self, c: Qwen35Config) -> None:
        super().__init__()
        self.config = c
        nv = c.linear_num_value_heads
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, nv, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, nv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(c.conv_channels, c.conv_kernel))  # [C, K], oldest tap first
        self.dt_bias = nn.Parameter(torch.empty(nv))
        self.ssm_a = nn.Parameter(torch.empty(nv))  # -exp(A_log) < 0
        self.norm = RMSNorm(c.linear_value_head_dim, c.rms_norm_eps)  # gated by SiLU(z)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] normed input
        history: torch.Tensor,  # [(S,) K-1, C] conv inputs before the block, per sequence
        state: torch.Tensor,  # [(S,) Hv, Dk, Dv] recurrent state before the block, per sequence
        ancestors: torch.Tensor,  # [T, K]
        parents: torch.Tensor | None,  # [T], None = a causal chain
        offsets: torch.Tensor | None = None,  # [S + 1] rows of each sequence when the block holds several
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the mixer output [T, hidden], the conv inputs [T, C] and the recurrent states:
        after every row [T, Hv, Dk, Dv] for a tree, after the last row [1, Hv, Dk, Dv] for a chain."""
        c, t = self.config, x.shape[0]
        math = torch.promote_types(x.dtype, torch.float32)
        inputs = self.in_proj_qkv(x)  # [T, C]
        mixed = conv_silu(history, inputs, ancestors, self.conv_weight).to(math)  # [T, C]
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        group = c.linear_num_value_heads // c.linear_num_key_heads
        q = l2_normalize(q.view(t, -1, c.linear_key_head_dim)).repeat_interleave(group, 1) * c.linear_key_head_dim**-0.5
        k = l2_normalize(k.view(t, -1, c.linear_key_head_dim)).repeat_interleave(group, 1)
        v = v.view(t, -1, c.linear_value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x).to(math))  # [T, Hv]
        g = self.ssm_a.to(math) * F.softplus(self.in_proj_a(x).to(math) + self.dt_bias.to(math))  # [T, Hv]
        if parents is None and t > 1:
            out, final = chunk_prefill(q, k, v, g, beta, state, fallback=gated_delta_chunked)
            states = final[None].to(state.dtype)
        else:
            tree = parents if parents is not None else chain_parents(1, x.device)
            out, states = gated_delta(q, k, v, g, beta, state, tree, state.dtype, offsets)
        z = self.in_proj_z(x).view(t, -1, c.linear_value_head_dim)
        y = self.norm(out.to(x.dtype)) * F.silu(z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(t, -1)), inputs, states


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, full_attention: bool) -> None:
        super().__init__()
        c = config
        self.full_attention = full_attention
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if full_attention:
            self.self_attn = GatedAttention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, config: Qwen35Config, state_dtype: torch.dtype | None = None) -> None:
        """``state_dtype``: how recurrent states are stored between tokens (per sequence and per
        tree row); None = float32, or float64 when computing in float64."""
        super().__init__()
        self.config = config
        self.state_dtype = state_dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(config, config.is_full_attention(i)) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Layer i's index into the cache tensors of its kind.
        kinds = [layer.full_attention for layer in self.layers]
        self.slots = [sum(1 for k in kinds[:i] if k == kinds[i]) for i in range(len(kinds))]

    def recurrent_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """How recurrent states are stored when computing in ``dtype``."""
        return self.state_dtype or torch.promote_types(dtype, torch.float32)

    def new_cache(self, capacity: int, device: torch.device | str, dtype: torch.dtype) -> Qwen35Cache:
        return Qwen35Cache(self.config, capacity, torch.device(device), dtype, self.recurrent_dtype(dtype))

    def new_pool(self, num_blocks: int, block_size: int, max_sequences: int, device: torch.device, dtype: torch.dtype) -> PagedState:
        """KV blocks for the attention layers and ``max_sequences`` DeltaNet state slots."""
        c = self.config
        kv = KVBlockPool(c.num_full_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, device, dtype)
        return PagedState(kv, Qwen35Slots(c, max_sequences, device, dtype, self.recurrent_dtype(dtype)))

    @staticmethod
    def position_bytes(config: Qwen35Config, dtype: torch.dtype) -> int:
        """KV bytes of one position over the attention layers."""
        return 2 * config.num_full_layers * config.num_kv_heads * config.head_dim * dtype.itemsize

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute
        cache: Qwen35Cache,
        start: int,  # KV slot of tokens[0]
        mask: torch.Tensor,  # [T, start + T] bool, True = visible
        taps: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] rows to project to logits; None = all
        parents: torch.Tensor | None = None,  # [T] parent rows, -1 = before the block; None = a chain
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns logits [R, vocab] (float32) and tap features [T, len(taps) * hidden] or None.

        A chain (``parents=None``: prefill chunks, plain decoding) advances the recurrent state to
        its last row. A tree leaves it at the block start and records every row's candidate in
        ``cache.pending`` for :meth:`Qwen35Cache.commit`. K/V are written at slots ``start ..``
        either way. Tap ``i`` is the output of decoder layer ``i``, as for Qwen3.
        """
        c = self.config
        rows = parents if parents is not None else chain_parents(tokens.shape[0], tokens.device)
        ancestors = ancestor_table(rows, c.conv_kernel)  # [T, K]
        pending = PendingBlock(ancestors) if parents is not None else None

        def mix(i: int, layer: Qwen35DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            slot = self.slots[i]
            if layer.full_attention:
                attn = layer.self_attn
                q, gate = attn.query_and_gate(x, cos, sin)
                return attn.attend_cached(x, q, cos, sin, cache.k[slot], cache.v[slot], start, mask, gate)
            out, inputs, states = layer.linear_attn(x, cache.conv[slot], cache.recurrent[slot], ancestors, parents)
            if pending is None:
                cache.conv[slot] = torch.cat([cache.conv[slot], inputs])[-(c.conv_kernel - 1) :]
                cache.recurrent[slot] = states[-1]
            else:
                pending.inputs.append(inputs)
                pending.states.append(states)
            return out

        result = self._decode(tokens, positions, mix, taps, logit_rows)
        cache.pending = pending
        return result

    @torch.inference_mode()
    def forward_paged(
        self,
        inputs: PassInputs,  # the pass's rows over several sequences (splitspec.models.paged)
        state: PagedState,
        taps: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] ragged rows to project to logits; None = all
        chain: bool = False,  # a prompt chunk of one sequence: advance its state to the last row
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` over the rows of several sequences at once. Attention layers attend over
        each sequence's paged keys; DeltaNet rows start from their parent row's state or, at a
        block's start, from their sequence's slot. A tree pass (``chain`` false) leaves the slots
        alone and keeps every row's candidate state in ``state.slots.pending``; a prompt chunk
        advances its sequence's slot. Returns logits [R, vocab] (float32) and tap features [N, taps * hidden]."""
        c, slots = self.config, state.slots
        at = inputs.attention()
        seq_slots = inputs.state_slots  # [B]
        ancestors = ancestor_table(inputs.parents, c.conv_kernel)  # [N, K]
        pending = None if chain else PendingBlock(ancestors)

        def mix(i: int, layer: Qwen35DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            slot = self.slots[i]
            if layer.full_attention:
                attn = layer.self_attn
                q, gate = attn.query_and_gate(x, cos, sin)
                k, v = attn.key_value(x, cos, sin)
                return attn.write_and_attend_paged(q, k, v, state.kv.k[slot], state.kv.v[slot], at, gate)
            if chain:  # one sequence's prompt chunk: its slot advances to the last row
                history, recurrent = slots.conv[slot, seq_slots[0]], slots.recurrent[slot, seq_slots[0]]
                out, conv_inputs, states = layer.linear_attn(x, history, recurrent, ancestors, None)
                slots.conv[slot, seq_slots[0]] = torch.cat([history, conv_inputs])[-(c.conv_kernel - 1) :]
                slots.recurrent[slot, seq_slots[0]] = states[-1]
                return out
            history, recurrent = slots.conv[slot][seq_slots], slots.recurrent[slot][seq_slots]  # [B, K-1, C], [B, Hv, Dk, Dv]
            out, conv_inputs, states = layer.linear_attn(x, history, recurrent, ancestors, inputs.parents, inputs.offsets)
            pending.inputs.append(conv_inputs)
            pending.states.append(states)
            return out

        result = self._decode(inputs.tokens, inputs.positions, mix, taps, logit_rows)
        slots.pending = pending
        return result

    def _decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, mix, taps: Sequence[int], logit_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over rows ``tokens`` [T] at ``positions`` [T], layer ``i``'s mixer output
        (gated attention or Gated DeltaNet) being ``mix(i, layer, x, cos, sin)``, which keeps the
        rows' K/V and states wherever its cache does: logits [R, vocab] (float32) and tap features
        [T, len(taps) * hidden]."""
        c = self.config
        h = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, h.dtype)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = h + mix(i, layer, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in taps:
                tapped[i] = h
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        if logit_rows is not None:
            h = h[logit_rows]
        return self.lm_head(self.norm(h)).float(), features
