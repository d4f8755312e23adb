"""``y = x @ W^T`` for many rows of x and W in GGUF blocks: expand W tile by tile, multiply on cuBLAS.

A prompt chunk (up to 512 rows) or a batched verify pass of many trees does hundreds of
multiply-adds per weight byte, so it is bound by arithmetic, not by reading the blocks. There
the library GEMM wins: cuBLAS's bf16 kernels run near the tensor cores' peak, which a Triton tile
that expands every chunk of blocks inside its K loop (``native.gguf_matmul``'s ``tl.dot`` path)
does not (BENCHMARKS.md, "Many rows: expanded tiles on cuBLAS"). Expanding first costs one read
of the blocks plus one write and one read of the expanded tile, 4.5-5 bytes a weight whatever M
is, which many rows amortise.

The expansion is a Triton kernel built from ``native.gguf_blocks``' per-type chunk functions, so a
weight is the dequantizer's float32 value (``gguf_dequant``, bit for bit) rounded to x's dtype,
as a dequantized model holds it and as the ``tl.dot`` and ``gguf_mma`` paths round it. W is
expanded ``TILE_BYTES`` at a time at most: the 27B's gate/up weight would take 356 MB as bf16, its
LM head 2.5 GB, where a 24 GB card has no room to spare (``services.worker.memory_plan`` counts
one tile). Each tile's product is written straight into its columns of y (cuBLAS takes y's row
stride as the output's leading dimension).

Which calls come here is ``gguf_matmul``'s choice (``takes``): x of at least ``MIN_ROWS[qtype]``
rows on a CUDA device, measured per type by ``scripts/gpu_gguf_expand.py``.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from native import use_triton
from native.gguf_blocks import TYPE_IDS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: gguf_matmul runs its reference
    triton = None

TILE_BYTES = 64 << 20  # the most expanded weight held at once
BLOCK_N = 16  # W rows a program expands
CHUNK = 256  # values of a row a program expands: one super-block (K-quants, IQ4_XS), eight Q8_0 blocks

# The fewest rows of x from which expanding beats the in-register kernels, per type, over the 8B
# and 27B layer shapes (``scripts/gpu_gguf_expand.py`` on an H200, BENCHMARKS.md): Q4_K, Q6_K and
# IQ4_XS have ``gguf_mma`` up to 64 rows; Q5_K's and Q8_0's ``tl.dot`` tiles lose from 23 and 65.
MIN_ROWS = {Q.Q4_K: 65, Q.Q6_K: 65, Q.Q5_K: 23, Q.Q8_0: 65, Q.IQ4_XS: 65}


def takes(x: torch.Tensor, qtype: Q) -> bool:
    """Whether x [M, K] is multiplied here: enough rows for ``qtype`` and kernels for x's device."""
    return qtype in MIN_ROWS and x.shape[0] >= MIN_ROWS[qtype] and use_triton(x, "gguf_expand")


def tile_rows(out_features: int, in_features: int, itemsize: int) -> int:
    """W rows expanded at once: all of them if they fit ``TILE_BYTES``, else the most that do, in
    whole programs."""
    fit = max(BLOCK_N, TILE_BYTES // (in_features * itemsize) // BLOCK_N * BLOCK_N)
    return min(out_features, fit)


if triton is not None:
    from native.gguf_blocks import chunk

    @triton.jit
    def _expand_kernel(w_ptr, levels_ptr, out_ptr, first, end, row_nbytes, stride_out,
                       QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr):
        """out[r - first, k0 : k0 + CHUNK] = W[r, k0 : k0 + CHUNK] in out's dtype, for this program's
        rows r of [first, end) and k0 = CHUNK * program_id(1); QTYPE as ``gguf_blocks.TYPE_IDS``;
        INTERLEAVED: W in ``gguf_matmul.interleave``'s layout."""
        local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of the tile
        rows = tl.minimum(first + local, end - 1).to(tl.int64)  # the tail re-reads the last row, unstored
        k0 = tl.program_id(1) * CHUNK
        w = chunk(w_ptr, levels_ptr, rows, row_nbytes, k0, QTYPE, BLOCK_N, CHUNK, INTERLEAVED)
        out = out_ptr + local[:, None].to(tl.int64) * stride_out + (k0 + tl.arange(0, CHUNK))[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(first + local < end)[:, None])


def expand(raw: torch.Tensor, qtype: Q, levels: torch.Tensor, first: int, end: int, out: torch.Tensor,
           interleaved: bool = False) -> torch.Tensor:
    """Rows [first, end) of the weight in ``raw`` [N, row_bytes], expanded into ``out`` [>= end -
    first, K] (its dtype) -> that view of ``out``. ``levels``: IQ4_XS's level table (any tensor for
    the other types, never read); ``interleaved``: ``raw`` in ``gguf_matmul.interleave``'s layout."""
    K = out.shape[1]
    # A program's values of a row: CHUNK, or one block where K is no multiple of it (Q8_0's 32).
    values = CHUNK if K % CHUNK == 0 else GGML_QUANT_SIZES[qtype][0]
    if K % values:
        raise ValueError(f"{qtype.name} rows of {K} values do not split into whole blocks")
    grid = (triton.cdiv(end - first, BLOCK_N), K // values)
    _expand_kernel[grid](raw, levels, out, first, end, raw.stride(0), out.stride(0),
                         QTYPE=TYPE_IDS[qtype], BLOCK_N=BLOCK_N, CHUNK=values, INTERLEAVED=interleaved, num_warps=4)
    return out[: end - first]


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, levels: torch.Tensor,
           interleaved: bool = False) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ W^T -> [M, out_features] in x's dtype, W expanded a tile at a
    time (``interleaved``: ``raw`` in ``gguf_matmul.interleave``'s layout)."""
    M, K = x.shape
    rows = tile_rows(out_features, K, x.element_size())
    tile = torch.empty(rows, K, dtype=x.dtype, device=x.device)
    if rows == out_features:
        return torch.mm(x, expand(raw, qtype, levels, 0, out_features, tile, interleaved).t())
    y = x.new_empty(M, out_features)
    for first in range(0, out_features, rows):
        end = min(first + rows, out_features)
        torch.mm(x, expand(raw, qtype, levels, first, end, tile, interleaved).t(), out=y[:, first:end])
    return y
