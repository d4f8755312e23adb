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

The served path (:meth:`Qwen35ForCausalLM.forward_paged` over :class:`Qwen35Slots`) keeps less: a
tree pass keeps every row's delta-rule *inputs* (:class:`TreeRows`, ~2 MB a row at the 27B
geometry instead of 151 MB of float32 state), and :meth:`Qwen35Slots.commit` recomputes the
accepted path's state from the sequence's committed one (``splitspec.models.delta_rule``,
"Commit by recomputation"). Its passes may run at fixed, padded shapes and be captured as CUDA
graphs (``services.target.graphs``): they read no tensor value on the host, padding rows and
sequences read only (a tree pass writes no slot; a padded prompt chunk's padding rows neither
decay nor write the state), and what a tree pass keeps goes to buffers reserved once
(:meth:`Qwen35Slots.reserve`), at the addresses a captured pass writes at every replay.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from native import delta_inputs, qkv_rope, rms_norm, use_triton
from native.chunked_delta_rule import chunk_prefill
from splitspec.models.delta_rule import (
    ancestor_table,
    chain_parents,
    commit_conv_histories,
    conv_silu,
    conv_windows,
    gated_delta,
    gated_delta_chunked,
    l2_normalize,
    path_gated_delta,
    reloaded_rows,
    tree_outputs,
)
from splitspec.models.layers import FusedLinear, QKVProjection, RMSNorm, SwiGLU, apply_rope, embedding, fuse_linears, rope_cos_sin
from splitspec.models.paged import KVBlockPool, PagedState, PassAttention, PassInputs
from splitspec.spec.acceptance import compact_rows

QWEN35_ARCHS = ("qwen35",)  # GGUF general.architecture values of this family
L2_EPS = 1e-6  # q/k L2 norm epsilon (the FLA convention: delta_rule.l2_normalize)

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


@dataclass
class DeltaInputs:
    """One block's Gated DeltaNet inputs to the delta rule, per row (:meth:`GatedDeltaNet.project`)."""

    conv_inputs: torch.Tensor  # [T, C] in_proj_qkv's output, the conv's inputs (compute dtype)
    q: torch.Tensor  # [T, Hk, Dk] L2-normalised and scaled by 1/sqrt(Dk) (math dtype)
    k: torch.Tensor  # [T, Hk, Dk] L2-normalised (math dtype)
    v: torch.Tensor  # [T, Hv, Dv] the conv's output (compute dtype)
    g: torch.Tensor  # [T, Hv] log-decay (math dtype)
    beta: torch.Tensor  # [T, Hv] write strength (math dtype)
    z: torch.Tensor  # [T, Hv * Dv] the output gate before its SiLU (compute dtype; not kept by TreeRows)


@dataclass
class TreeRows:
    """What a tree pass over paged sequences keeps of each of its ``T`` rows until
    :meth:`Qwen35Slots.commit`, per DeltaNet layer: the conv inputs (the committed conv history is
    the accepted path's last ``K - 1``) and the delta rule's inputs, from which the commit
    recomputes the accepted path's recurrent state (``delta_rule.path_gated_delta``). Each is kept
    in the dtype the pass computed it in, so the recomputation reads exactly what the pass read."""

    conv_inputs: torch.Tensor  # [L, T, C] compute dtype
    keys: torch.Tensor  # [L, T, Hk, Dk] math dtype, normalised
    values: torch.Tensor  # [L, T, Hv, Dv] compute dtype
    decays: torch.Tensor  # [L, T, Hv] math dtype
    betas: torch.Tensor  # [L, T, Hv] math dtype

    @classmethod
    def empty(cls, config: Qwen35Config, rows: int, device: torch.device, dtype: torch.dtype) -> TreeRows:
        c, math = config, torch.promote_types(dtype, torch.float32)
        layers, hv = c.num_linear_layers, c.linear_num_value_heads
        return cls(
            torch.empty(layers, rows, c.conv_channels, device=device, dtype=dtype),
            torch.empty(layers, rows, c.linear_num_key_heads, c.linear_key_head_dim, device=device, dtype=math),
            torch.empty(layers, rows, hv, c.linear_value_head_dim, device=device, dtype=dtype),
            torch.empty(layers, rows, hv, device=device, dtype=math),
            torch.empty(layers, rows, hv, device=device, dtype=math),
        )

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def head(self, rows: int) -> TreeRows:
        """Views of the first ``rows`` rows."""
        return TreeRows(*(x[:, :rows] for x in (self.conv_inputs, self.keys, self.values, self.decays, self.betas)))

    def gate_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys, decays and betas: where ``GatedDeltaNet.gates`` may write them
        straight away (``record`` then has nothing to copy)."""
        return self.keys[layer], self.decays[layer], self.betas[layer]

    def conv_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s conv inputs ``[T, C]`` and values ``[T, Hv * Dv]``: where the conv
        writes them as it runs (``GatedDeltaNet.project``'s ``keep``)."""
        return self.conv_inputs[layer], self.values[layer].flatten(1)

    def record(self, layer: int, d: DeltaInputs) -> None:
        """Keep DeltaNet layer ``layer``'s rows (copies: the buffers may be a captured pass's),
        but for those already written in place."""
        for kept, row in ((self.conv_inputs, d.conv_inputs), (self.keys, d.k), (self.values, d.v), (self.decays, d.g), (self.betas, d.beta)):
            if kept[layer].data_ptr() != row.data_ptr():
                kept[layer].copy_(row)


def tree_row_bytes(config: Qwen35Config, dtype: torch.dtype) -> int:
    """Bytes :class:`TreeRows` keeps per tree row over all DeltaNet layers, for compute ``dtype``."""
    c, math = config, torch.promote_types(dtype, torch.float32).itemsize
    per_layer = (
        c.conv_channels * dtype.itemsize + c.key_dim * math + c.value_dim * dtype.itemsize + 2 * c.linear_num_value_heads * math
    )
    return c.num_linear_layers * per_layer


class Qwen35Slots:
    """Every sequence's DeltaNet state in fixed slots (a :class:`splitspec.models.paged.StateSlots`):
    ``conv`` [num_linear, slots, K-1, C] (compute dtype) and ``recurrent`` [num_linear, slots, Hv, Dk,
    Dv] (state dtype). Slot 0 is the pad slot, never given out: it stays zero. A tree pass leaves the
    slots alone and keeps every row's delta-rule inputs (``pending``, :class:`TreeRows`) until
    :meth:`commit` recomputes the accepted path's state from them."""

    def __init__(self, config: Qwen35Config, slots: int, device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
        c = config
        self.config, self.dtype = config, dtype
        self.conv = torch.zeros(c.num_linear_layers, slots + 1, c.conv_kernel - 1, c.conv_channels, device=device, dtype=dtype)
        shape = (c.num_linear_layers, slots + 1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.recurrent = torch.zeros(shape, device=device, dtype=state_dtype)
        self._pending: TreeRows | None = None
        self._committed: set[int] = set()  # slots committed from the pending rows (each once)
        self._reserved: TreeRows | None = None
        self._free = list(range(slots, 0, -1))
        self._lock = threading.Lock()  # slots come back from whichever thread drops a sequence

    @property
    def pending(self) -> TreeRows | None:
        """The last tree pass's rows (None after a prompt chunk). A replayed CUDA graph rewrites
        them without running Python, so the pass runner sets this after a replay."""
        return self._pending

    @pending.setter
    def pending(self, rows: TreeRows | None) -> None:
        self._pending, self._committed = rows, set()

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

    def reserve(self, rows: int) -> None:
        """Buffers for the rows of tree passes of up to ``rows`` rows, at addresses that never change:
        a captured pass writes there at every replay. Reserved once (the addresses are captured);
        passes of more rows get their own."""
        if self._reserved is not None:
            if self._reserved.rows < rows:
                raise RuntimeError(f"tree rows are reserved once ({self._reserved.rows} rows): captured passes hold their addresses")
            return
        self._reserved = TreeRows.empty(self.config, rows, self.conv.device, self.dtype)

    def tree_rows(self, rows: int) -> TreeRows:
        """Where a tree pass of ``rows`` rows keeps them: the reserved buffers' first rows where they
        fit (one pass's rows are live at a time: committed before the next pass), else new ones."""
        if self._reserved is not None and rows <= self._reserved.rows:
            return self._reserved.head(rows)
        return TreeRows.empty(self.config, rows, self.conv.device, self.dtype)

    def commit(self, slot: int, path: Sequence[int]) -> None:
        self.commit_paths([(slot, path)])

    def commit_paths(self, paths: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Advance each ``(slot, path)``'s state along its accepted path (ragged rows of the last
        tree pass, root first), all sequences and layers at once: the recurrent state by
        recomputation, the conv history as the path's last ``K - 1`` conv inputs."""
        rows = self.pending
        if rows is None:
            raise RuntimeError("commit without a tree pass to commit")
        if not paths:
            return
        slots = [slot for slot, _ in paths]
        if len(set(slots)) < len(slots) or self._committed.intersection(slots) or 0 in slots:
            raise RuntimeError(f"slots {slots}: each real slot is committed at most once per tree pass")
        self._committed.update(slots)
        before = self.conv.shape[2]  # K - 1
        width = max(len(path) for _, path in paths)
        # Per sequence, one int64 row: its path (padded), length, slot and new conv window (each
        # entry a row of the pass or -i, the i-th latest old history input): one copy to the device.
        packed = np.zeros((len(paths), width + 2 + before), dtype=np.int64)
        for b, (slot, path) in enumerate(paths):
            packed[b, : len(path)] = path
            packed[b, width : width + 2] = len(path), slot
            packed[b, width + 2 :] = ([*range(-before, 0)] + list(path))[-before:]
        packed_t = torch.from_numpy(packed)
        if self.conv.is_cuda:  # pinned: the copy waits for nothing on the host
            packed_t = packed_t.pin_memory().to(self.conv.device, non_blocking=True)
        paths_t, lengths_t, slots_t, windows_t = (
            packed_t[:, :width], packed_t[:, width], packed_t[:, width + 1], packed_t[:, width + 2 :]
        )
        path_gated_delta(self.recurrent, slots_t, paths_t, lengths_t, rows.keys, rows.values, rows.decays, rows.betas)
        commit_conv_histories(self.conv, slots_t, windows_t, rows.conv_inputs)

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
        return self._heads_q_gate(self.q_proj(x), cos, sin)

    def _heads_q_gate(self, packed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_proj``'s output [T, H * 2D] -> RoPE'd queries [H, T, D] and the gate [T, H * D]."""
        q = self.q_norm(self._halves(packed)[..., : self.head_dim])
        return apply_rope(q.transpose(0, 1), cos, sin), self._gate(packed)

    def _halves(self, packed: torch.Tensor) -> torch.Tensor:
        return packed.unflatten(-1, (self.num_heads, 2 * self.head_dim))  # [T, H, 2D]: [q_h | gate_h]

    def _gate_heads(self, packed: torch.Tensor) -> torch.Tensor:
        return self._halves(packed)[..., self.head_dim :]  # [T, H, D], a strided view

    def _gate(self, packed: torch.Tensor) -> torch.Tensor:
        return self._gate_heads(packed).reshape(packed.shape[0], -1)  # [T, H * D], a copy

    def project_attend_paged(
        self,
        x: torch.Tensor,  # [N, hidden] normed input of the pass's rows
        cos: torch.Tensor,  # [N, R] (R = rotary_dim)
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [H_kv, slots, D] this layer's paged keys
        v_pool: torch.Tensor,
        at: PassAttention,
    ) -> torch.Tensor:
        """Project, write the rows' K/V to their pool slots, attend, gate: :meth:`query_and_gate` +
        :meth:`key_value` + :meth:`write_and_attend_paged`, with the q/k norms, partial RoPE and
        pool writes as one ``qkv_rope`` launch where the native kernels run (the norms and RoPE
        alone are ~20 small kernels a layer). Returns ``[N, hidden]``."""
        packed, k, v = self._projections(x)  # strided views of one matmul's output once fused
        if not use_triton(x, "qkv_rope"):  # the kernel's reference
            q, gate = self._heads_q_gate(packed, cos, sin)
            return self.write_and_attend_paged(q, *self._heads_kv(k, v, cos, sin), k_pool, v_pool, at, gate)
        q = qkv_rope.gated_qkv_rope(packed, k, v, cos, sin, *self._norm_args(), k_pool, v_pool, at.write_slots)
        return self.attend_paged(q, k_pool, v_pool, at, self._gate_heads(packed))


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
        self._in_proj: FusedLinear | None = None
        self._in_proj_zba: FusedLinear | None = None

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The layers that read the mixer's input (``quantized.link_producers``)."""
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def fuse(self) -> None:
        """The four input projections as one matmul (inference; see ``layers.fuse_linears``). A
        kept-quantized ``in_proj_qkv`` of another block type than the rest (Q4_K_M gives it Q6_K in
        some layers) stays alone, and z, b and a, alike, are one matmul."""
        self._in_proj = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        if self._in_proj is None:
            self._in_proj_zba = fuse_linears(self.in_proj_z, self.in_proj_b, self.in_proj_a)

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.config.linear_num_value_heads // self.config.linear_num_key_heads

    def project(
        self, x: torch.Tensor, history: torch.Tensor, ancestors: torch.Tensor, into: tuple[torch.Tensor, ...] | None = None,
        keep: tuple[torch.Tensor, torch.Tensor] | None = None, history_index: torch.Tensor | None = None,
    ) -> DeltaInputs:
        """The delta rule's inputs of rows ``x`` [T, hidden] (normed), the conv reading ``history``
        [(S,) K-1, C] (with ``history_index`` [S]: a table, sequence s's at row ``history_index[s]``)
        and the rows' ``ancestors`` [T, K]. q and k keep their key heads. ``into``:
        where ``gates`` writes k, g and beta (``TreeRows.gate_buffers``); ``keep``: where the conv
        writes the conv inputs and v (``TreeRows.conv_buffers``), which the result then holds."""
        c, t = self.config, x.shape[0]
        nv = c.linear_num_value_heads
        if self._in_proj is not None:
            inputs, z, b, a = self._in_proj(x).split([c.conv_channels, c.value_dim, nv, nv], dim=-1)  # [T, C], ...
        elif self._in_proj_zba is not None:
            inputs = self.in_proj_qkv(x)
            z, b, a = self._in_proj_zba(x).split([c.value_dim, nv, nv], dim=-1)
        else:
            inputs, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        mixed = conv_silu(history, inputs, ancestors, self.conv_weight, keep, history_index)  # [T, C] compute dtype
        q, k, beta, g = self.gates(mixed, b, a, into)
        if keep is not None:
            inputs, v = keep
        else:
            v = mixed[:, 2 * c.key_dim:]
        return DeltaInputs(inputs, q, k, v.view(t, -1, c.linear_value_head_dim), g, beta, z)

    def gates(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, into: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """From the conv output ``mixed`` [T, C] and the projections ``b``, ``a`` [T, Hv]: q and k
        [T, Hk, Dk] L2-normalised (q scaled by Dk^-0.5), ``beta`` and the log-decay ``g`` [T, Hv], in
        float32 (float64 for float64 inputs); by ``native.delta_inputs`` where it runs. ``into``:
        (k, g, beta) tensors of those shapes and dtype to hold the results."""
        c, t = self.config, mixed.shape[0]
        if use_triton(mixed, "delta_inputs") and delta_inputs.supported(mixed, b, a) and (into is None or into[0].dtype == torch.float32):
            return delta_inputs.delta_inputs(
                mixed, b, a, self.ssm_a, self.dt_bias, c.linear_num_key_heads, c.linear_key_head_dim, L2_EPS, into,
            )
        math = torch.promote_types(mixed.dtype, torch.float32)
        q, k = mixed[:, : 2 * c.key_dim].to(math).view(t, 2, -1, c.linear_key_head_dim).unbind(1)
        q = l2_normalize(q, L2_EPS) * c.linear_key_head_dim**-0.5
        k = l2_normalize(k, L2_EPS)
        beta = torch.sigmoid(b.to(math))  # [T, Hv]
        g = self.ssm_a.to(math) * F.softplus(a.to(math) + self.dt_bias.to(math))  # [T, Hv]
        if into is not None:
            k, g, beta = (dst.copy_(x) for dst, x in zip(into, (k, g, beta)))
        return q, k, beta, g

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, Hk, D]`` -> ``[T, Hv, D]``: value head ``h`` reads key head ``h // group``."""
        return x.repeat_interleave(self.group, 1)

    def output(self, d: DeltaInputs, out: torch.Tensor) -> torch.Tensor:
        """The mixer output [T, hidden] of the delta rule's ``out`` [T, Hv, Dv]: gated norm, out_proj."""
        t = out.shape[0]
        z = d.z.view(t, -1, self.config.linear_value_head_dim)
        if use_triton(out, "gated_rms_norm") and rms_norm.gated_supported(out, z, self.norm.weight):
            y = rms_norm.gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        else:  # the kernel's reference
            y = self.norm(out.to(z.dtype)) * F.silu(z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(t, -1))

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
        t = x.shape[0]
        d = self.project(x, history, ancestors)
        q, k = self.heads(d.q), self.heads(d.k)
        if parents is None and t > 1:
            out, final = chunk_prefill(q, k, d.v, d.g, d.beta, state, fallback=gated_delta_chunked)
            states = final[None].to(state.dtype)
        else:
            tree = parents if parents is not None else chain_parents(1, x.device)
            out, states = gated_delta(q, k, d.v, d.g, d.beta, state, tree, state.dtype, offsets)
        return self.output(d, out), d.conv_inputs, states


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
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(config, config.is_full_attention(i)) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Layer i's index into the cache tensors of its kind.
        kinds = [layer.full_attention for layer in self.layers]
        self.slots = [sum(1 for k in kinds[:i] if k == kinds[i]) for i in range(len(kinds))]

    def fuse_projections(self) -> None:
        """Inference: gate/up, each DeltaNet layer's input projections and each attention layer's
        q/k/v (where their block types agree) become one matmul each (fewer, fuller kernels per
        step; see ``layers.fuse_linears``)."""
        for layer in self.layers:
            layer.mlp.fuse()
            if layer.full_attention:
                layer.self_attn.fuse()
            else:
                layer.linear_attn.fuse()

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
        alone and keeps every row's delta-rule inputs in ``state.slots.pending`` (:class:`TreeRows`);
        a prompt chunk advances its sequence's slot to its last row (``inputs.last_row``). Returns
        logits [R, vocab] (float32) and tap features [N, taps * hidden].

        Nothing reads a tensor's value on the host: with ``inputs.static`` (a fixed-shape pass,
        maybe captured) neither does the torch delta rule, which then walks every depth a block of
        ``T`` rows can have. Padding is harmless: a padding row of a tree pass starts from sequence
        0's state and history and writes nothing of any sequence (its K/V go to the pad block; the
        delta rule keeps no state of it; its kept inputs are never on a path); a padding sequence
        reads the pad slot 0; a prompt chunk's padding rows after its last row neither decay nor
        write the state (``g = 0``, ``beta = 0``: the recurrence leaves it exactly as it is) and
        are not in the conv window it keeps."""
        c, slots = self.config, state.slots
        at = inputs.attention()
        ancestors = ancestor_table(inputs.parents, c.conv_kernel)  # [N, K]
        pending = None if chain else slots.tree_rows(inputs.shape[0])
        delta = self._chunk_mixer(inputs, slots, ancestors) if chain else self._tree_mixer(inputs, slots, ancestors, pending)

        def mix(i: int, layer: Qwen35DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            slot = self.slots[i]
            if layer.full_attention:
                return layer.self_attn.project_attend_paged(x, cos, sin, state.kv.k[slot], state.kv.v[slot], at)
            return delta(slot, layer.linear_attn, x)

        result = self._decode(inputs.tokens, inputs.positions, mix, taps, logit_rows)
        slots.pending = pending
        return result

    def _tree_mixer(self, inputs: PassInputs, slots: Qwen35Slots, ancestors: torch.Tensor, pending: TreeRows):
        """``delta(layer, net, x)``: DeltaNet layer ``layer``'s output over a tree pass's rows, keeping
        their inputs in ``pending``. Per pass, once for all layers: the rows whose states the
        kernel must store, and (fixed shapes, torch path) every row's depth."""
        n, _, block_rows, _ = inputs.shape
        seq_slots = inputs.state_slots  # [B]
        # [N] the states the kernel stores (the block alone reads them), as the kernel's int8 flags once per pass
        keep = reloaded_rows(inputs.parents).to(torch.int8)
        depths = None
        if inputs.static:  # the torch path's levels as a tensor: depth = position - start; -1 for padding
            sequence = inputs.out_index // block_rows  # [N]
            real = torch.arange(n, device=inputs.tokens.device) < inputs.offsets[-1]
            depths = torch.where(real, inputs.positions - inputs.starts[sequence], -1)

        def delta(layer: int, net: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
            # the sequences' histories read in place from the layer's slots; k, g, beta, the conv
            # inputs and v written straight into what the pass keeps
            d = net.project(x, slots.conv[layer], ancestors, pending.gate_buffers(layer), pending.conv_buffers(layer), seq_slots)
            out = tree_outputs(  # q and k in key heads (the torch path repeats them per value head)
                d.q, d.k, d.v, d.g, d.beta, slots.recurrent[layer], inputs.parents,
                slots.recurrent.dtype, inputs.offsets, max_rows=block_rows, state_index=seq_slots, keep=keep,
                depths=depths, levels=block_rows if inputs.static else 0,
            )
            pending.record(layer, d)
            return net.output(d, out)

        return delta

    def _chunk_mixer(self, inputs: PassInputs, slots: Qwen35Slots, ancestors: torch.Tensor):
        """``delta(layer, net, x)``: DeltaNet layer ``layer``'s output over one sequence's prompt
        chunk, advancing its slot to the chunk's last row. The slot is indexed by a one-element
        tensor, not ``state_slots[0]``: a 0-d tensor index is read on the host."""
        c = self.config
        n = inputs.shape[0]
        device = inputs.tokens.device
        first = inputs.state_slots[:1]  # [1] the sequence's slot
        live = torch.arange(n, device=device) <= inputs.last_row  # [N] the chunk's rows; padding after them
        window = inputs.last_row + 1 + torch.arange(c.conv_kernel - 1, device=device)  # [K-1] in cat(history, inputs)

        def delta(layer: int, net: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
            history = slots.conv[layer].index_select(0, first)[0]  # [K-1, C]
            recurrent = slots.recurrent[layer].index_select(0, first)[0]  # [Hv, Dk, Dv]
            d = net.project(x, history, ancestors)
            # Padding rows neither decay (exp(0) = 1) nor write (beta = 0) the state: exactly the identity.
            g, beta = torch.where(live[:, None], d.g, 0.0), torch.where(live[:, None], d.beta, 0.0)
            q, k = net.heads(d.q), net.heads(d.k)
            if n > 1:
                out, final = chunk_prefill(q, k, d.v, g, beta, recurrent, fallback=gated_delta_chunked)
            else:
                out, states = gated_delta(q, k, d.v, g, beta, recurrent, chain_parents(1, device), recurrent.dtype)
                final = states[0]
            slots.recurrent[layer].index_copy_(0, first, final[None].to(slots.recurrent.dtype))
            slots.conv[layer].index_copy_(0, first, torch.cat([history, d.conv_inputs]).index_select(0, window)[None])
            return net.output(d, out)

        return delta

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
        x = self.layers[0].input_layernorm(h)
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            # Each residual add runs fused with the norm after it (RMSNorm.forward_add).
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer.post_attention_layernorm.forward_add(mix(i, layer, x, cos, sin), h)
            x, h = next_norm.forward_add(layer.mlp(x), h)
            if i in taps:
                tapped[i] = h
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        if logit_rows is not None:
            x = x[logit_rows]
        return self.lm_head(x).float(), features
