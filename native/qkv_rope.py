"""One kernel from the q/k/v projections to attention-ready tensors: per-head RMSNorm (Qwen3's
q/k norm), rotate-half RoPE, and the K/V writes into the cache slots.

In plain torch that is ~15 small kernels per layer (two norms, two RoPEs of five ops each, two
index copies), ~2 µs each on an H200 even inside a CUDA graph: about 1 ms of a 36-layer decode
step. Here it is one launch of ``T × (H + 2·H_kv)`` programs, one per (row, head), each owning a
``head_dim`` vector: norm and rotation in float32, rounded once on store.

Two layouts of the projections' output:

- dense (:func:`qkv_rope`): q ``[T, H·D]``, k and v ``[T, H_kv·D]``, separate matmuls' outputs or
  views of one fused matmul's row ``[q | k | v]``;
- gated (:func:`gated_qkv_rope`, Qwen3.5's full attention): ``q_proj``'s row packs
  ``[q_h | gate_h]`` per head, so q head ``h`` starts at ``2·D·h``; the gate is not read (the
  caller takes it as a strided view). k and v may be separate tensors or views of one matmul.

*Partial RoPE*: only a head's first ``R`` (rotary) dims rotate, dim ``i < R/2`` with
``i + R/2`` (rotate-half within those ``R``); dims ``R ..`` pass through, normed. ``R = D`` is
ordinary RoPE; the cos/sin tables are ``[T, R]``.

Its plain-torch references are ``QKVProjection.query_key_value`` + ``write_and_attend`` in
``splitspec/models/layers.py`` and ``GatedAttention.project_attend_paged``'s torch path in
``splitspec/models/qwen35.py`` (the CPU paths), which the tests compare it with.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        T, eps, stride_q_row, stride_q_head, stride_k_row, stride_v_row, stride_cache_head, stride_cache_slot,
        NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
        BLOCK: tl.constexpr, NORM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        offs = tl.arange(0, BLOCK)  # BLOCK: HEAD_DIM rounded up to a power of two
        inside = offs < HEAD_DIM
        slot = tl.load(slots_ptr + row)
        if head >= NUM_HEADS + KV_HEADS:  # v: copied into the cache as is
            # Names apart from the other branch's: Triton requires one type per name across branches.
            v_head = head - NUM_HEADS - KV_HEADS
            value = tl.load(v_ptr + row * stride_v_row + v_head * HEAD_DIM + offs, mask=inside)
            v_dst = v_cache_ptr + v_head * stride_cache_head + slot * stride_cache_slot
            tl.store(v_dst + offs, value.to(v_cache_ptr.dtype.element_ty), mask=inside)
        else:
            if head < NUM_HEADS:
                src = q_ptr + row * stride_q_row + head * stride_q_head
                w_ptr = qw_ptr
            else:
                src = k_ptr + row * stride_k_row + (head - NUM_HEADS) * HEAD_DIM
                w_ptr = kw_ptr
            # Each dim's rotation partner, read as a second (cached) gather of the same head
            # rather than as halves: the pass-through part (D - R dims) need not be a power of two.
            half = ROTARY // 2
            first = offs < half
            partner = tl.where(first, offs + half, tl.where(offs < ROTARY, offs - half, offs))
            x = tl.load(src + offs, mask=inside, other=0.0).to(tl.float32)
            xp = tl.load(src + partner, mask=inside, other=0.0).to(tl.float32)
            if NORM:  # over the whole head (the masked lanes are zeros)
                inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
                x = x * inv * tl.load(w_ptr + offs, mask=inside).to(tl.float32)
                xp = xp * inv * tl.load(w_ptr + partner, mask=inside).to(tl.float32)
            # Past the rotary dims cos = 1, sin = 0: those dims pass through exactly.
            rotary = offs < ROTARY
            c = tl.load(cos_ptr + row * ROTARY + offs, mask=rotary, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + row * ROTARY + offs, mask=rotary, other=0.0).to(tl.float32)
            y = x * c + tl.where(first, -xp, xp) * s
            if head < NUM_HEADS:
                q_dst = q_out_ptr + (head * T + row) * HEAD_DIM
                tl.store(q_dst + offs, y.to(q_out_ptr.dtype.element_ty), mask=inside)
            else:
                k_dst = k_cache_ptr + (head - NUM_HEADS) * stride_cache_head + slot * stride_cache_slot
                tl.store(k_dst + offs, y.to(k_cache_ptr.dtype.element_ty), mask=inside)


def qkv_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Returns q [H, T, D] from ``q`` [T, H * D] (H may be 0: keys and values only); writes k [T,
    H_kv * D] (normed, RoPE'd) and v into ``k_cache``/``v_cache`` [H_kv, C, D] at ``slots`` [T].
    Norm weights [D] (None = no norm). Rows may be strided (views of one or two matmuls)."""
    d = k_cache.shape[-1]
    return _launch(q, d, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, q.shape[-1] // d)


def gated_qkv_rope(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Qwen3.5's layout: returns q [H, T, D] from ``q_gate`` [T, H * 2D] (``[q_h | gate_h]`` per
    head; the gates are left as they are) and writes k [T, H_kv * D] (normed, RoPE'd) and v into
    ``k_cache``/``v_cache`` [H_kv, C, D] at ``slots`` [T]. ``cos``/``sin`` [T, R] may rotate fewer
    dims than D (partial RoPE). Rows of q_gate, k and v may be strided (views of one matmul)."""
    d = k_cache.shape[-1]
    return _launch(q_gate, 2 * d, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, q_gate.shape[-1] // (2 * d))


def _launch(q, q_head_stride, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, num_heads) -> torch.Tensor:
    """The kernel over q heads ``q_head_stride`` apart in rows of ``q``, and k/v heads packed in
    rows of ``k``/``v``."""
    t, d, rotary = k.shape[0], k_cache.shape[-1], cos.shape[-1]
    kv_heads = k_cache.shape[0]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (t, rotary) and rotary % 2 == 0 and rotary <= d
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q_out = torch.empty(num_heads, t, d, device=k.device, dtype=k.dtype)
    weights = (q_weight, k_weight) if q_weight is not None else (cos, cos)  # unused without NORM
    _qkv_rope_kernel[(t, num_heads + 2 * kv_heads)](
        q, k, v, cos, sin, weights[0], weights[1], q_out, k_cache, v_cache, slots,
        t, eps, q.stride(0), q_head_stride, k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=d, ROTARY=rotary, BLOCK=triton.next_power_of_2(d),
        NORM=q_weight is not None,
    )
    return q_out
