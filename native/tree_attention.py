"""Masked grouped-query attention for decode and tree-verify shapes: few query rows, a long KV span.

Terms: a *row* is one (query head, token) pair; the ``group = H / H_kv`` query heads that share a
K/V head read the same keys, so they run as ``group * T`` rows of one program; the *span* ``S``
is the number of KV slots read (a fixed power of two under CUDA graphs) and the boolean mask
[T, S] says which slots each token sees (causal prefix + tree ancestors).

In plain torch this is ~10 kernels per layer (mask repeat, two matmuls, scale, fill, softmax,
casts, a transpose copy), launch-bound at these sizes. Here it is the flash-decoding split:
programs over (K/V head, key split, row block) each run an online softmax over their keys, and a
second small kernel combines the splits and writes ``[T, H * D]``, the layout ``o_proj`` reads.
With one split the first kernel writes the output itself.

Reference: the plain-torch branch of ``QKVProjection.attend`` in ``splitspec/models/layers.py``.
"""

from __future__ import annotations

import math
import os

import torch

from native import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

BLOCK_S = 64  # keys per loop step
WAVES = 1  # programs per multiprocessor the key splits aim for (H100 and H200: 1 beat 2 and 4 for verify b22, tied for AR)
# Triton 3.6's CPU interpreter multiplies bfloat16 tiles wrongly in tl.dot: there the kernel
# computes in float32 (the GPU keeps the 16-bit tensor-core path, checked by the GPU scripts).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running maximum: exp2(NEG - NEG) stays 1

    @triton.jit
    def _partial_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, stat_ptr, out_ptr,
        T, S, stride_kh, stride_ks, stride_vh, stride_vs, stride_mt, scale_log2, total_rows,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCKS_PER_SPLIT: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] within this K/V head
        rows_ok = rows < GROUP * T
        token = rows % T
        head_row = kv_head * GROUP * T + rows  # = query head * T + token
        d = tl.arange(0, D)
        q = tl.load(q_ptr + head_row[:, None] * D + d[None, :], mask=rows_ok[:, None], other=0.0)  # [BLOCK_R, D]
        if IEEE:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_R], NEG, tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for b in range(BLOCKS_PER_SPLIT):
            cols = (split * BLOCKS_PER_SPLIT + b) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
            cols_ok = cols < S
            k_t = tl.load(k_ptr + kv_head * stride_kh + cols[None, :] * stride_ks + d[:, None], mask=cols_ok[None, :], other=0.0)  # [D, BLOCK_S]
            if IEEE:
                s = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            seen = tl.load(mask_ptr + token[:, None] * stride_mt + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0)
            s = tl.where(seen != 0, s * scale_log2, float("-inf"))  # [BLOCK_R, BLOCK_S], log2 units
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_head * stride_vh + cols[:, None] * stride_vs + d[None, :], mask=cols_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if DIRECT:
            # [T, H * D]: query head h = head_row // T writes columns h * D ..
            dst = out_ptr + token[:, None] * (total_rows // T) * D + (head_row // T)[:, None] * D + d[None, :]
            l = tl.where(rows_ok, l, 1.0)  # pad rows saw nothing: keep them finite, they are not stored
            tl.store(dst, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])
        else:
            tl.store(acc_ptr + (split * total_rows + head_row)[:, None] * D + d[None, :], acc, mask=rows_ok[:, None])
            tl.store(stat_ptr + split * total_rows + head_row, m, mask=rows_ok)
            tl.store(stat_ptr + (tl.num_programs(1) + split) * total_rows + head_row, l, mask=rows_ok)

    @triton.jit
    def _combine_kernel(
        acc_ptr, stat_ptr, out_ptr, T, total_rows, splits,
        D: tl.constexpr, SPLITS: tl.constexpr,
    ):
        head_row = tl.program_id(0)  # query head * T + token
        s = tl.arange(0, SPLITS)
        ok = s < splits
        m = tl.load(stat_ptr + s * total_rows + head_row, mask=ok, other=NEG)
        l = tl.load(stat_ptr + (splits + s) * total_rows + head_row, mask=ok, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # [SPLITS]
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (s * total_rows + head_row)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        token, head = head_row % T, head_row // T
        tl.store(out_ptr + token * (total_rows // T) * D + head * D + d, out.to(out_ptr.dtype.element_ty))


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Shapes the kernel takes: one sequence, a power-of-two head_dim, unit-stride heads."""
    d = q.shape[-1]
    return (
        q.dim() == 3 and mask.dim() == 2 and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and k.dtype == q.dtype == v.dtype and d >= 16 and d & (d - 1) == 0
        and k.stride(-1) == 1 and v.stride(-1) == 1 and mask.stride(-1) == 1 and mask.dtype == torch.bool
    )


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [H, T, D], k/v [H_kv, S, D] (views into a cache are fine), mask [T, S] bool (True =
    visible; every row sees at least one key) -> [T, H * D] in q's dtype."""
    h, t, d = q.shape
    kv_heads, span = k.shape[0], k.shape[1]
    group = h // kv_heads
    q = q.contiguous()
    total_rows = h * t
    # Tiles for head_dim 128 (Qwen3); halved for 256 (Qwen3.5's full attention), whose 64-key
    # tiles would overflow an H200's shared memory. tl.dot wants 16 rows at least.
    wide = d > 128
    block_s = BLOCK_S // 2 if wide else BLOCK_S
    block_r = max(16, min(32 if wide else 64, triton.next_power_of_2(group * t)))
    row_blocks = triton.cdiv(group * t, block_r)
    blocks = triton.cdiv(span, block_s)
    # Enough programs for about WAVES waves over the device; each split reads whole key blocks.
    wanted = max(1, min(blocks, (WAVES * sm_count(q.device)) // (kv_heads * row_blocks)))
    per_split = triton.cdiv(blocks, wanted)
    splits = triton.cdiv(blocks, per_split)
    out = q.new_empty(t, h * d)
    acc = stat = out  # unused when DIRECT
    if splits > 1:
        acc = torch.empty(splits, total_rows, d, device=q.device, dtype=torch.float32)
        stat = torch.empty(2, splits, total_rows, device=q.device, dtype=torch.float32)
    _partial_kernel[(kv_heads, splits, row_blocks)](
        q, k, v, mask, acc, stat, out,
        t, span, k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0), math.log2(math.e) / math.sqrt(d), total_rows,
        GROUP=group, D=d, BLOCK_R=block_r, BLOCK_S=block_s, BLOCKS_PER_SPLIT=per_split, DIRECT=splits == 1,
        IEEE=q.dtype == torch.float32 or INTERPRETED, num_warps=4, num_stages=2 if wide else 3,
    )
    if splits > 1:
        _combine_kernel[(total_rows,)](acc, stat, out, t, total_rows, splits, D=d, SPLITS=triton.next_power_of_2(splits), num_warps=4)
    return out
