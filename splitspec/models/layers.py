"""Building blocks shared by the dense targets and the DFlash draft: RMSNorm, RoPE, SwiGLU, attention.

Shapes use T for tokens in the current pass, S for key positions, D for head_dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn
from torch.nn import functional as F

from native import gguf_mma, paged_attention, qkv_rope, rms_norm, silu_mul, tree_attention, use_triton
from native.gguf_matmul import INTERLEAVE, QuantLinear, quant_linear
from splitspec.models.paged import PassAttention

# cuDNN's attention builds a plan for every new shape: ~1.3 ms of host time per call measured on
# an H200 when the key length grows by one each decode step. The flash / memory-efficient kernels
# have no such cost, so splitspec never asks for cuDNN's.
torch.backends.cuda.enable_cudnn_sdp(False)
SMALL_ATTENTION = 1 << 20  # query rows x key slots up to which attention runs as plain matmuls
TREE_ATTENTION_ROWS = 2048  # query rows (heads x tokens) up to which the native kernel runs: decode and verify


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, dim)``, left uninitialised when built on the meta device, as the
    loaders build models before filling in the file's weights: there its N(0, 1) initialisation runs
    in torch's Python reference kernels, whose first call imports ``torch._dynamo`` (1.1 s of a
    worker's start on a CPU, half the built-in target's load)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w`` with a plain weight (Qwen3/Llama convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The block type of the quantized matmuls that read this norm's output, where the norm runs
        # inside their x preparation (``quantized.link_producers``, ``native.gguf_mma.produce``).
        self.consumer: Q | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.consumer is not None and gguf_mma.produces(gguf_mma.NORM, x, self.weight):
            producer = gguf_mma.Producer(gguf_mma.NORM, x, lambda: (self.plain(x), None), weight=self.weight, eps=self.eps)
            return gguf_mma.produce(producer, self.consumer)[0]
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The norm by its own launch (or its torch reference)."""
        if use_triton(x, "rms_norm", self.weight) and rms_norm.supported(x, self.weight):
            return rms_norm.rms_norm(x, self.weight, self.eps)
        if x.is_cuda and x.dtype == self.weight.dtype:
            # One fused kernel (statistics in float32) instead of seven: a decode step runs ~150 norms.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 like the reference implementations, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def forward_add(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual step and the norm after it: ``(norm(residual + delta), residual + delta)``,
        one kernel where the native kernels run."""
        if (self.consumer is not None and residual.shape == delta.shape
                and gguf_mma.produces(gguf_mma.ADD_NORM, delta, self.weight, residual)):
            producer = gguf_mma.Producer(gguf_mma.ADD_NORM, delta, lambda: self.plain_add(delta, residual), residual,
                                         self.weight, self.eps)
            return gguf_mma.produce(producer, self.consumer)
        return self.plain_add(delta, residual)

    def plain_add(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_add` by the norm's own launch (or its torch reference)."""
        if use_triton(delta, "rms_norm", self.weight, residual) and rms_norm.supported(delta, self.weight) and residual.is_contiguous() and residual.dtype == delta.dtype:
            return rms_norm.add_rms_norm(delta, residual, self.weight, self.eps)
        residual = residual + delta
        return self.plain(residual), residual


@dataclass(frozen=True)
class FusedLinear:
    """Several linear layers over one input as one matmul (:func:`fuse_linears`). ``weight`` is
    their float weights [sum of outputs, in] or, for ``QuantLinear`` layers, their GGUF blocks
    [sum of outputs, row bytes] of type ``qtype`` (``interleaved``: in
    ``native.gguf_matmul.interleave``'s layout, as its parts were). ``fused(x, first)``: the outputs
    of rows ``first`` on, [..., out_features - first] (0: all)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    qtype: Q | None = None  # None: a float weight
    interleaved: bool = False

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[first:]
        if self.qtype is None:
            return F.linear(x, self.weight[first:], bias)
        if self.interleaved and first % INTERLEAVE:  # rows from `first` on are no whole groups of features
            return quant_linear(x, self.weight, self.qtype, self.bias, interleaved=True)[..., first:]
        return quant_linear(x, self.weight[first:], self.qtype, bias, self.interleaved)


def fuse_linears(*linears: nn.Module) -> FusedLinear | None:
    """One weight whose row blocks *are* the given layers' weights: each layer's parameter (or
    ``QuantLinear`` blocks) becomes a view into it, so one matmul replaces several at no extra
    memory. None (nothing changed) unless all are plain ``nn.Linear``, or all ``QuantLinear`` of
    one block type and input size, alike in bias. Interleaved blocks stay so where every part's
    are (each part's rows then are whole groups of the fused weight's); otherwise all are
    de-interleaved first."""
    if all(type(m) is nn.Linear for m in linears):
        attr, qtype = "weight", None
    elif all(isinstance(m, QuantLinear) for m in linears) and len({(m.qtype, m.in_features) for m in linears}) == 1:
        attr, qtype = "raw", linears[0].qtype
    else:
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None
    interleaved = qtype is not None and all(m.interleaved for m in linears)
    if qtype is not None and not interleaved:
        for m in linears:
            m.deinterleave()
    fused = []
    for name in (attr, "bias"):
        if getattr(linears[0], name) is None:
            fused.append(None)
            continue
        whole = torch.cat([getattr(m, name).detach() for m in linears])
        offset = 0
        for m in linears:
            view = whole[offset : offset + m.out_features]
            setattr(m, name, view if name == "raw" else nn.Parameter(view, requires_grad=False))  # raw: a buffer
            offset += m.out_features
        fused.append(whole)
    return FusedLinear(fused[0], fused[1], qtype, interleaved)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up: FusedLinear | None = None
        # down_proj's block type, where the activation runs inside its x preparation
        # (``quantized.link_producers``, ``native.gguf_mma.produce``).
        self.produced: Q | None = None

    def fuse(self) -> None:
        """Gate and up projections as one matmul (inference; see :func:`fuse_linears`)."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The layers that read the MLP's input (``quantized.link_producers``)."""
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self._gate_up(x)
        if self.produced is not None and gguf_mma.produces(gguf_mma.SILU_MUL, gate_up):
            producer = gguf_mma.Producer(gguf_mma.SILU_MUL, gate_up, lambda: (self.activation(gate_up), None))
            return self.down_proj(gguf_mma.produce(producer, self.produced)[0])
        return self.down_proj(self.activation(gate_up))

    @staticmethod
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused projection's output [..., 2I] -> [..., I]."""
        if use_triton(gate_up, "silu_mul") and silu_mul.supported(gate_up):
            return silu_mul.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    freq_factors: tuple[float, ...] | None = None,  # [D/2] divisors of the frequencies (RoPE scaling)
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for absolute ``positions`` [T] -> two [T, D] tensors (rotate-half layout).

    ``freq_factors`` is how llama.cpp expresses RoPE scaling (its ``rope_freqs`` tensor): frequency
    ``i`` is divided by ``freq_factors[i]``. Linear scaling is a constant factor; Llama 3 scaling is
    the per-frequency factor of :func:`llama3_freq_factors`.
    """
    angles = positions.to(torch.float32)[:, None] * _frequencies(positions.device, head_dim, theta, freq_factors)  # [T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@functools.cache
def _frequencies(device: torch.device, head_dim: int, theta: float, freq_factors: tuple[float, ...] | None) -> torch.Tensor:
    """[D] float32: the frequency of each dim of the rotate-half layout (both halves alike).

    Made once per device and geometry: every pass of a decode step used to rebuild it, five small
    kernels each time. The first call runs outside any CUDA graph capture (a capture's warm-up
    run comes first), so the cached tensor holds its values for every graph that reads it."""
    with torch.inference_mode(False):  # also read by training passes, which autograd records
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, device=device, dtype=torch.float32)
        return torch.cat([inv_freq, inv_freq])


def llama3_freq_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> list[float]:
    """Llama 3.1's RoPE scaling as per-frequency divisors: wavelengths shorter than
    ``original_context / high_freq_factor`` keep their frequency, those longer than
    ``original_context / low_freq_factor`` are divided by ``factor``, and the band between
    interpolates smoothly (in frequency, not in divisor)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_context / high_freq_factor:
            factors.append(1.0)
        elif wavelength > original_context / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return factors


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, D] by the tables [T, R] (NEOX / rotate-half convention).

    With ``R < D`` (partial RoPE, as in Qwen3.5) only the first ``R`` dims rotate, the rest pass.
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class QKVProjection(nn.Module):
    """q/k/v/o projections, with per-head q/k RMSNorm (Qwen3) or q/k/v biases (Qwen2) as configured."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        qk_norm: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self._qkv: FusedLinear | None = None
        self._qk: FusedLinear | None = None

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The layers that read the attention's input (``quantized.link_producers``)."""
        return self.q_proj, self.k_proj, self.v_proj

    def fuse(self) -> None:
        """q, k and v projections as one matmul (inference; see :func:`fuse_linears`), or q and k
        where v cannot join them (a Q4_K_M file's Q6_K v beside Q4_K q and k)."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        if self._qkv is None:
            self._qk = fuse_linears(self.q_proj, self.k_proj)

    # Every method takes an optional leading batch dimension ([B, T, hidden]): inference runs one
    # sequence, training runs a batch through the same weights.
    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [(B,) T, hidden] -> RoPE'd queries [(B,) H, T, D]."""
        return self._heads_q(self.q_proj(x), cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [(B,) T, hidden] -> RoPE'd keys and values, each [(B,) H_kv, T, D]."""
        return self._heads_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def query_key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`query` and :meth:`key_value` together, as one matmul once fused."""
        q, k, v = self._projections(x)
        return self._heads_q(q, cos, sin), *self._heads_kv(k, v, cos, sin)

    def _projections(self, x: torch.Tensor, queries: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., H * D] (no columns unless ``queries``), k and v [..., H_kv * D]: views of the
        fused matmul's output (:meth:`fuse`), else each layer's own."""
        widths = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        if self._qkv is not None:
            if queries:
                return self._qkv(x).split(widths, -1)
            k, v = self._qkv(x, widths[0]).split(widths[1:], -1)
            return k[..., :0], k, v
        if self._qk is not None:  # q and k one matmul, v its own
            q, k = self._qk(x).split(widths[:2], -1) if queries else (None, self._qk(x, widths[0]))
        else:
            q, k = self.q_proj(x) if queries else None, self.k_proj(x)
        return (k[..., :0] if q is None else q), k, self.v_proj(x)

    def _heads_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim)))
        return apply_rope(q.transpose(-3, -2), cos, sin)

    def _heads_kv(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k.transpose(-3, -2), cos, sin), v.transpose(-3, -2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        gate: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """q [(B,) H, T, D], k/v [(B,) H_kv, S, D], mask [(B,) T, S] bool (True = visible) or None
        -> [(B,) T, hidden]. ``causal`` (with no mask) is the lower-triangular mask, S == T.

        ``gate`` [T, H * D] (Qwen3.5's output gate) scales the heads by ``sigmoid(gate)`` before ``o_proj``.
        """
        out = self.attention(q, k, v, mask, causal)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        """:meth:`attend` before the gate and ``o_proj``: the heads' outputs [(B,) T, H * D]."""
        batched = q.dim() == 4
        if (
            not batched and mask is not None and mask.dim() == 2 and q.shape[0] * q.shape[1] <= TREE_ATTENTION_ROWS
            and use_triton(q, "tree_attention") and tree_attention.supported(q, k, v, mask)
        ):
            return tree_attention.tree_attention(q, k, v, mask)  # [T, H * D]
        if not batched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # one mask per sequence, shared by the heads
        b, h, t, d = q.shape
        group = h // k.shape[1]
        if causal or group == 1:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)  # [B, H, T, D]
        else:
            # The query heads of one K/V head as extra query rows of that head: plain attention, which
            # the fused kernels take with a mask (with enable_gqa and a mask torch falls back to
            # unfused math, ~2 ms per 8B step on an H200).
            rows = q.reshape(b, k.shape[1], group * t, d)  # head i uses K/V head i // group
            if mask is not None and group * t * k.shape[2] <= SMALL_ATTENTION:
                # Decode and verify shapes: plain matmuls beat the fused kernel, which splits no
                # work over the keys (H200, 36 layers, span 4096: 0.9 ms against 3.2 ms).
                mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)  # [.., group * T, S]
                acc = torch.promote_types(rows.dtype, torch.float32)  # float64 stays float64 (exact tests)
                scores = torch.matmul(rows, k.transpose(-1, -2)).to(acc) * d**-0.5  # [B, H_kv, group * T, S]
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
                out = torch.matmul(probs, v).reshape(b, h, t, d)
            elif mask is not None:
                # Prompt chunks over long contexts: the g-th query head of every group at a time,
                # so the mask stays [T, S]. All group x T rows at once would need it repeated, and
                # the fused kernel builds an additive copy of that: 144 of a 512-row chunk's 216 MiB
                # over 16K positions of the 27B (services.worker.memory_plan counts what is left).
                heads = q.unflatten(1, (k.shape[1], group))  # [B, H_kv, group, T, D]
                out = torch.stack([F.scaled_dot_product_attention(heads[:, :, g], k, v, attn_mask=mask) for g in range(group)], 2).flatten(1, 2)
            else:
                out = F.scaled_dot_product_attention(rows, k, v).reshape(b, h, t, d)
        out = out.transpose(1, 2).flatten(2)  # [B, T, H * D]
        return out if batched else out[0]

    def attend_paged(
        self,
        q: torch.Tensor,  # [H, N, D] queries of the pass's ragged rows
        k_pool: torch.Tensor,  # [H_kv, slots, D] this layer's paged keys (splitspec.models.paged)
        v_pool: torch.Tensor,
        at: PassAttention,
        gate: torch.Tensor | None = None,  # [N, H, D] (any row and head strides) or [N, H * D]
    ) -> torch.Tensor:
        """Attention of a pass over several sequences, each row over its own sequence's keys, laid
        out padded ``[B, T]``. The native kernel reads the keys through the block tables; the torch
        path gathers each sequence's keys ``[B, H_kv, S, D]`` from its blocks. ``gate``: the output
        times ``sigmoid(gate)`` (in the native kernel's own launch). Returns ``[N, hidden]``."""
        h, n, d = q.shape
        b, t = at.row_index.shape
        # One sequence, or one row a sequence (the passes of one user, and decode passes), in a pass
        # of N = B * T rows: padded place (s, j) is ragged row s * T + j, so the padded rows are a
        # view of q and the output needs no reordering (its pad rows are computed as pad places).
        # Gathering and scattering them cost an 8B AR step 144 kernels and 0.35 ms of an H200 (BENCHMARKS.md).
        in_place = n == b * t and (b == 1 or t == 1)
        q_in = q.unflatten(1, (b, t)).transpose(0, 1) if in_place else q  # [B, H, T, D] view, or the ragged [H, N, D]
        by_row = None if in_place else at.row_index
        if h * t <= TREE_ATTENTION_ROWS and use_triton(q, "paged_attention") and paged_attention.supported(q_in, k_pool, v_pool, at.visible, by_row):
            # Decode and verify shapes: keys read through the block tables, and the ragged rows
            # through row_index (no padded copy of q, no reordered output).
            gated = None if gate is None else gate.view(n, h, d) if gate.dim() == 2 else gate
            out = paged_attention.paged_tree_attention(
                q_in, k_pool, v_pool, at.tables, at.starts, at.visible, at.block_size, rows=by_row, gate=gated,
            )
            return self.o_proj(out.reshape(n, h * d))
        rows = q_in if in_place else torch.cat([q.transpose(0, 1), q.new_zeros(1, h, d)])[at.row_index].transpose(1, 2)  # [B, H, T, D]; index N is the zero row
        kv_heads, pool_slots, _ = k_pool.shape
        key_rows = at.key_rows(kv_heads, pool_slots)  # [B * H_kv * S]
        shape = (b, kv_heads, at.key_slots.shape[1], d)
        k = k_pool.flatten(0, 1).index_select(0, key_rows).view(shape)  # [B, H_kv, S, D], contiguous
        v = v_pool.flatten(0, 1).index_select(0, key_rows).view(shape)
        if b == 1:  # one sequence: the unbatched forms (the native tree kernel where it runs)
            out = self.attention(rows[0], k[0], v[0], at.visible[0])  # [T, H * D]
        else:
            out = self.attention(rows, k, v, at.visible).flatten(0, 1)  # [B * T, H * D]
        if not in_place:
            out = out[at.out_index]  # [N, H * D]
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(n, h * d))
        return self.o_proj(out)

    def write_and_attend_paged(
        self,
        q: torch.Tensor,  # [H, N, D]
        k: torch.Tensor,  # [H_kv, N, D] this pass's keys and values
        v: torch.Tensor,
        k_pool: torch.Tensor,  # [H_kv, slots, D]
        v_pool: torch.Tensor,
        at: PassAttention,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the rows' K/V to their pool slots, then :meth:`attend_paged`."""
        k_pool.index_copy_(1, at.write_slots, k)
        v_pool.index_copy_(1, at.write_slots, v)
        return self.attend_paged(q, k_pool, v_pool, at, gate)

    def project_attend_paged(
        self,
        x: torch.Tensor,  # [N, hidden] normed input of the pass's rows
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [H_kv, slots, D]
        v_pool: torch.Tensor,
        at: PassAttention,
    ) -> torch.Tensor:
        """:meth:`project_attend_cached` for a pass over paged sequences."""
        if not self._native_rope(x):
            return self.write_and_attend_paged(*self.query_key_value(x, cos, sin), k_pool, v_pool, at)
        q = qkv_rope.qkv_rope(*self._projections(x), cos, sin, *self._norm_args(), k_pool, v_pool, at.write_slots)
        return self.attend_paged(q, k_pool, v_pool, at)

    def attend_cached(
        self,
        x: torch.Tensor,  # [T, hidden] normed input of this pass
        q: torch.Tensor,  # [H, T, D] its queries
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [H_kv, capacity, D] of this layer
        v_cache: torch.Tensor,
        start: int | torch.Tensor,  # cache slot of x[0], or the slots [T] of every row
        mask: torch.Tensor,  # [T, S] bool over cache slots 0 .. S
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this pass's K/V to slots ``start ..`` (or to the slots ``start`` [T]) and attend over
        slots ``.. S``. Slot tensors keep every shape and address fixed, so the pass can be
        captured as a CUDA graph; the int form needs no index tensor on the eager path."""
        return self.write_and_attend(q, *self.key_value(x, cos, sin), k_cache, v_cache, start, mask, gate)

    def write_key_value(
        self,
        x: torch.Tensor,  # [T, hidden] rows that only give keys and values (a draft's context)
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [H_kv, capacity, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
    ) -> None:
        """:meth:`key_value` written to the cache ``slots``: one matmul over the k/v rows of the
        fused weight and the ``qkv_rope`` kernel (with no query heads) where the kernels run."""
        if self._native_rope(x):
            qkv_rope.qkv_rope(*self._projections(x, queries=False), cos, sin, *self._norm_args(), k_cache, v_cache, slots)
            return
        k, v = self.key_value(x, cos, sin)
        k_cache.index_copy_(1, slots, k)
        v_cache.index_copy_(1, slots, v)

    def _native_rope(self, x: torch.Tensor) -> bool:
        """Whether the ``qkv_rope`` kernel norms, rotates and writes the projections (both norms or
        neither), fused or not: a Q4_K_M file's layers whose v is Q6_K (q and k Q4_K) cannot fuse,
        and in plain torch their norms, RoPE and writes were ~10 small launches a layer."""
        return use_triton(x, "qkv_rope") and isinstance(self.q_norm, nn.Identity) == isinstance(self.k_norm, nn.Identity)

    def _norm_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """``qkv_rope``'s q/k norm weights and eps (None, None, 0 without q/k norm)."""
        if isinstance(self.q_norm, nn.Identity):
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def project_attend_cached(
        self,
        x: torch.Tensor,  # [T, hidden] normed input of this pass
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [H_kv, capacity, D]
        v_cache: torch.Tensor,
        start: int | torch.Tensor,
        mask: torch.Tensor,  # [T, S] bool
    ) -> torch.Tensor:
        """Project, write K/V to the cache, attend: :meth:`query_key_value` + :meth:`write_and_attend`,
        with the norms, RoPE and cache writes as one native kernel where the kernels run."""
        if not self._native_rope(x):
            return self.write_and_attend(*self.query_key_value(x, cos, sin), k_cache, v_cache, start, mask)
        slots = start if isinstance(start, torch.Tensor) else torch.arange(start, start + x.shape[0], device=x.device)
        q = qkv_rope.qkv_rope(*self._projections(x), cos, sin, *self._norm_args(), k_cache, v_cache, slots)
        span = mask.shape[-1]
        return self.attend(q, k_cache[:, :span], v_cache[:, :span], mask)

    def write_and_attend(
        self,
        q: torch.Tensor,  # [H, T, D]
        k: torch.Tensor,  # [H_kv, T, D] this pass's keys and values
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [H_kv, capacity, D]
        v_cache: torch.Tensor,
        start: int | torch.Tensor,
        mask: torch.Tensor,  # [T, S] bool
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attend_cached` for keys and values already projected."""
        if isinstance(start, torch.Tensor):
            k_cache.index_copy_(1, start, k)
            v_cache.index_copy_(1, start, v)
        else:
            k_cache[:, start : start + k.shape[1]] = k
            v_cache[:, start : start + k.shape[1]] = v
        span = mask.shape[-1]
        return self.attend(q, k_cache[:, :span], v_cache[:, :span], mask, gate)
