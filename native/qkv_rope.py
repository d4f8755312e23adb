"""One kernel from a fused q/k/v projection to attention-ready tensors: per-head RMSNorm (Qwen3's
q/k norm), rotate-half RoPE, and the K/V writes into the cache slots.

In plain torch that is ~15 small kernels per layer (two norms, two RoPEs of five ops each, two
index copies), ~2 µs each on an H200 even inside a CUDA graph: about 1 ms of a 36-layer decode
step. Here it is one launch of ``T × (H + 2·H_kv)`` programs, one per (row, head), each owning a
``head_dim`` vector: norm and rotation in float32, rounded once on store.

Its plain-torch reference is ``QKVProjection.query_key_value`` + ``write_and_attend`` in
``splitspec/models/layers.py`` (the CPU path), which the tests compare it with.
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
        qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        T, eps, stride_cache_head, stride_cache_slot,
        NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        base = qkv_ptr + (row * (NUM_HEADS + 2 * KV_HEADS) + head) * 2 * HALF
        x1 = tl.load(base + offs).to(tl.float32)
        x2 = tl.load(base + HALF + offs).to(tl.float32)
        slot = tl.load(slots_ptr + row)
        if head >= NUM_HEADS + KV_HEADS:  # v: copied into the cache as is
            dst = v_cache_ptr + (head - NUM_HEADS - KV_HEADS) * stride_cache_head + slot * stride_cache_slot
            tl.store(dst + offs, x1.to(v_cache_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, x2.to(v_cache_ptr.dtype.element_ty))
        else:
            if NORM:
                inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
                is_q = head < NUM_HEADS  # a q head or a k head: both weights are [D], load both and pick
                w1 = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs)).to(tl.float32)
                w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs), tl.load(kw_ptr + HALF + offs)).to(tl.float32)
                x1 = x1 * inv * w1
                x2 = x2 * inv * w2
            c1 = tl.load(cos_ptr + row * 2 * HALF + offs).to(tl.float32)
            c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + offs).to(tl.float32)
            s1 = tl.load(sin_ptr + row * 2 * HALF + offs).to(tl.float32)
            s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + offs).to(tl.float32)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            if head < NUM_HEADS:
                dst = q_out_ptr + (head * T + row) * 2 * HALF
                tl.store(dst + offs, y1.to(q_out_ptr.dtype.element_ty))
                tl.store(dst + HALF + offs, y2.to(q_out_ptr.dtype.element_ty))
            else:
                dst = k_cache_ptr + (head - NUM_HEADS) * stride_cache_head + slot * stride_cache_slot
                tl.store(dst + offs, y1.to(k_cache_ptr.dtype.element_ty))
                tl.store(dst + HALF + offs, y2.to(k_cache_ptr.dtype.element_ty))


def qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Returns q [H, T, D] from ``qkv`` [T, (H + 2 H_kv) * D]; writes k (normed, RoPE'd) and v into
    ``k_cache``/``v_cache`` [H_kv, C, D] at ``slots`` [T]. Norm weights [D] (None = no norm)."""
    t, d = qkv.shape[0], cos.shape[-1]
    kv_heads = k_cache.shape[0]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(num_heads, t, d, device=qkv.device, dtype=qkv.dtype)
    weights = (q_weight, k_weight) if q_weight is not None else (cos, cos)  # unused without NORM
    _qkv_rope_kernel[(t, num_heads + 2 * kv_heads)](
        qkv, cos, sin, weights[0], weights[1], q, k_cache, v_cache, slots,
        t, eps, k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=d // 2, NORM=q_weight is not None,
    )
    return q
