"""``y = x @ W^T`` from GGUF blocks with int8 activations and integer dot products (Q4_K, Q6_K).

``native.gguf_matmul`` expands every weight to float32 in registers and multiply-adds it with x:
about six ALU operations per weight value, so a batch-1 step is bound by arithmetic, not by the
bytes it reads (an H200 issues ~33 T simple operations a second against ~4.1 TB/s of memory:
eight operations a byte at most, and a Q4_K byte holds two values). This module does what
llama.cpp's ``mmvq`` does instead:

1. **Activations to int8** (:func:`quantize_rows`): each run of 32 values of an x row becomes
   32 int8 ``xq`` and one float32 scale ``xd = max|x| / 127``, plus the run's exact float sum
   ``xsum`` (the K-quants' per-sub-block minimum multiplies it).
2. **Integer dot products**: the weight's 4-bit (6-bit) values are masked out of whole 32-bit
   words of the file's bytes, four at a time, and ``dp4a`` multiplies four byte pairs and adds
   them in one instruction, so a Q4_K word (eight values) costs about five operations whatever
   the number of x rows it meets. A sub-block's 32 products sum as integers; then its two scales
   (the weight's and x's) multiply the sum once.

Terms: a *block* is GGUF's unit of quantization (a 256-value *super-block* for the K-quants); a
*sub-block* shares one scale inside it (32 values for Q4_K, 16 for Q6_K); a *word* is 4 bytes
of the packed weight. For Q4_K (layout in ``native.gguf_matmul``) a super-block's value is
``d * sc[s] * q - dmin * m[s]`` with ``q`` in 0..15, so sub-block ``s`` of a row contributes::

    d * sc[s] * xd[s] * sum_i q_i * xq_i  -  dmin * m[s] * xsum[s]

Q6_K's value is ``d * sc[s] * (q - 32)`` with ``q`` in 0..63 and 16-value sub-blocks:
``d * sc[s] * xd * (sum_i q_i xq_i - 32 * sum_i xq_i)`` (the second sum taken over int8 x, so the
offset is exact in integers).

The result differs from the dequantize-then-matmul reference by x's int8 rounding (about 0.4%
of a run's largest value, per value; sums of many such errors mostly cancel), as llama.cpp's
batch-1 path does. One program handles ``BLOCK_N`` output features and all ``M`` (<= 32) x rows,
so each weight word is loaded and unpacked once for every row; larger M goes to the ``tl.dot``
kernel of ``native.gguf_matmul``.

``dp4a`` is PTX (NVIDIA); elsewhere (the CPU interpreter that CI runs, ROCm) the same sums are
made from shifts and multiplies (``_dp4a`` with ``USE_ASM`` false).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from native import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton run the reference only
    triton = None

MMVQ_TYPES = frozenset({Q.Q4_K, Q.Q6_K})
MAX_ROWS = 32  # x rows one program multiplies; above, the tl.dot kernel's tensor cores win
RUN = 32  # x values sharing one int8 scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (xq int8 [M, K], xd float32 [M, K/32], xsum float32 [M, K/32]):
    every run of 32 values as ``xq * xd`` with ``xd = max|x| / 127``, ``xq`` rounded half away
    from zero; ``xsum`` the run's sum of x itself (float32)."""
    m, k = x.shape
    runs = x.float().view(m, k // RUN, RUN)
    xd = runs.abs().amax(-1) / 127  # [M, K/32]
    inv = torch.where(xd > 0, 1 / xd, torch.zeros_like(xd))
    scaled = runs * inv[..., None]
    xq = (scaled.abs() + 0.5).floor().copysign(scaled).clamp(-127, 127).to(torch.int8)
    return xq.view(m, k), xd, runs.sum(-1)


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, xq_ptr, xd_ptr, xsum_ptr, K, stride_xm, RUNS: tl.constexpr):
        """Program (m, r): runs r * RUNS .. r * RUNS + RUNS - 1 of x row m (see quantize_rows_reference)."""
        m, r = tl.program_id(0), tl.program_id(1)
        run = r * RUNS + tl.arange(0, RUNS)  # [RUNS]
        at = run[:, None] * 32 + tl.arange(0, 32)[None, :]  # [RUNS, 32]
        ok = run < K // 32
        x = tl.load(x_ptr + m * stride_xm + at, mask=ok[:, None], other=0.0).to(tl.float32)
        xd = tl.max(tl.abs(x), axis=1) / 127  # [RUNS]
        inv = tl.where(xd > 0, 1 / xd, 0.0)
        scaled = x * inv[:, None]
        q = tl.floor(tl.abs(scaled) + 0.5)
        q = tl.minimum(tl.where(scaled < 0, -q, q), 127.0)
        tl.store(xq_ptr + m * K + at, q.to(tl.int8), mask=ok[:, None])
        tl.store(xd_ptr + m * (K // 32) + run, xd, mask=ok)
        tl.store(xsum_ptr + m * (K // 32) + run, tl.sum(x, axis=1), mask=ok)

    @triton.jit
    def _dp4a(a, b, c, USE_ASM: tl.constexpr):
        """c + the sum of the four products of ``a``'s unsigned bytes and ``b``'s signed bytes (int32 words)."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            s = c
            for i in tl.static_range(4):
                s += ((a >> (8 * i)) & 255) * ((b << (24 - 8 * i)) >> 24)  # << then >> sign-extends b's byte i
            return s

    @triton.jit
    def _f16_at(w_ptr, byte_offset):
        """The little-endian f16 at an even ``byte_offset`` -> f32."""
        return tl.load(w_ptr.to(tl.pointer_type(tl.float16)) + byte_offset // 2).to(tl.float32)

    @triton.jit
    def _word_at(w_ptr, byte_offset, ALIGNED: tl.constexpr):
        """The int32 word at ``byte_offset``: one load when 4-byte aligned, else two int16 loads
        (Q6_K's 210-byte blocks are only 2-byte aligned)."""
        if ALIGNED:
            return tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + byte_offset // 4)
        else:
            half = w_ptr.to(tl.pointer_type(tl.int16)) + byte_offset // 2
            return (tl.load(half).to(tl.int32) & 0xFFFF) | (tl.load(half + 1).to(tl.int32) << 16)

    @triton.jit
    def _q4_k_scales(w_ptr, block, s):
        """6-bit (scale, min) of sub-blocks ``s`` [S] of the super-blocks at byte ``block`` [BLOCK_N]
        -> two int32 [BLOCK_N, S]: bytes 4..15 as three words a, b, c; for s < 4 scale is byte s of
        a and min byte s of b (low 6 bits); for s >= 4 the nibbles of byte s - 4 of c, topped by the
        high 2 bits of byte s - 4 of a (scale) or of b (min)."""
        a = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + block // 4 + 1)[:, None]  # [BLOCK_N, 1]
        b = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + block // 4 + 2)[:, None]
        c = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + block // 4 + 3)[:, None]
        shift = (8 * (s % 4))[None, :]  # [1, S]
        first = (s < 4)[None, :]
        scale = tl.where(first, (a >> shift) & 63, ((c >> shift) & 15) | (((a >> (shift + 6)) & 3) << 4))
        minimum = tl.where(first, (b >> shift) & 63, ((c >> (shift + 4)) & 15) | (((b >> (shift + 6)) & 3) << 4))
        return scale, minimum

    @triton.jit
    def _q4_k_block_dot(xq_words, xd_ptr, xsum_ptr, w_ptr, rows, row_nbytes, sb, m, m_ok, K, M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
        """Super-block ``sb`` (along K) of ``rows`` [BLOCK_N] against x rows ``m`` -> its sums
        [M_BLOCK, BLOCK_N, 4] by 32-byte group j. Word t (0..31) of a super-block's 128 quant bytes
        lies in group j = t // 8: its low nibbles are values 64 j + 4 (t % 8) + 0..3 (sub-block
        2 j), its high nibbles the same + 32 (sub-block 2 j + 1)."""
        t = tl.arange(0, 32)
        x_word = 16 * (t // 8) + t % 8  # [32] x word of t's low nibbles in a super-block (high: + 8)
        j = tl.arange(0, 4)
        block = rows * row_nbytes + sb * 144  # [BLOCK_N] byte of the super-block
        q = _word_at(w_ptr, block[:, None] + 16 + 4 * t[None, :], True)  # [BLOCK_N, 32]
        lo = (q & 0x0F0F0F0F)[None]  # [1, BLOCK_N, 32]
        hi = ((q >> 4) & 0x0F0F0F0F)[None]
        x_at = m[:, None] * (K // 4) + sb * 64 + x_word[None, :]  # [M_BLOCK, 32]
        x_lo = tl.load(xq_words + x_at, mask=m_ok[:, None], other=0)[:, None, :]  # [M_BLOCK, 1, 32]
        x_hi = tl.load(xq_words + x_at + 8, mask=m_ok[:, None], other=0)[:, None, :]
        dot_lo = tl.sum(tl.reshape(_dp4a(lo, x_lo, 0, USE_ASM), (M_BLOCK, BLOCK_N, 4, 8)), axis=3)  # [M_BLOCK, BLOCK_N, 4]
        dot_hi = tl.sum(tl.reshape(_dp4a(hi, x_hi, 0, USE_ASM), (M_BLOCK, BLOCK_N, 4, 8)), axis=3)
        sc_lo, mn_lo = _q4_k_scales(w_ptr, block, 2 * j)  # [BLOCK_N, 4]
        sc_hi, mn_hi = _q4_k_scales(w_ptr, block, 2 * j + 1)
        d = _f16_at(w_ptr, block)[:, None]  # [BLOCK_N, 1]
        dmin = _f16_at(w_ptr, block + 2)[:, None]
        run = m[:, None] * (K // 32) + sb * 8 + 2 * j[None, :]  # [M_BLOCK, 4] x runs of sub-blocks 2 j
        xd_lo = tl.load(xd_ptr + run, mask=m_ok[:, None], other=0.0)[:, None, :]  # [M_BLOCK, 1, 4]
        xd_hi = tl.load(xd_ptr + run + 1, mask=m_ok[:, None], other=0.0)[:, None, :]
        xs_lo = tl.load(xsum_ptr + run, mask=m_ok[:, None], other=0.0)[:, None, :]
        xs_hi = tl.load(xsum_ptr + run + 1, mask=m_ok[:, None], other=0.0)[:, None, :]
        out = dot_lo.to(tl.float32) * (d * sc_lo.to(tl.float32))[None] * xd_lo
        out += dot_hi.to(tl.float32) * (d * sc_hi.to(tl.float32))[None] * xd_hi
        return out - ((dmin * mn_lo.to(tl.float32))[None] * xs_lo + (dmin * mn_hi.to(tl.float32))[None] * xs_hi)

    @triton.jit(do_not_specialize=["M"])
    def _q4_k_mmvq_kernel(
        xq_ptr, xd_ptr, xsum_ptr, w_ptr, y_ptr,
        M, N, K, row_nbytes, stride_ys,
        M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, UNROLL: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """y[split, m, n] over this split's super-blocks for every x row m < M and this program's
        BLOCK_N features, ``UNROLL`` super-blocks a step (more loads in flight per program)."""
        pid_n, split = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(cols, N - 1).to(tl.int64)  # the tail repeats the last row, unstored
        m = tl.arange(0, M_BLOCK)
        m_ok = m < M
        xq_words = xq_ptr.to(tl.pointer_type(tl.int32))
        acc = tl.zeros((M_BLOCK, BLOCK_N, 4), dtype=tl.float32)
        for i in range(BLOCKS_PER_SPLIT // UNROLL):
            for u in tl.static_range(UNROLL):
                sb = split * BLOCKS_PER_SPLIT + i * UNROLL + u  # super-block index along K
                acc += _q4_k_block_dot(xq_words, xd_ptr, xsum_ptr, w_ptr, rows, row_nbytes, sb, m, m_ok, K, M_BLOCK, BLOCK_N, USE_ASM)
        y = tl.sum(acc, axis=2)  # [M_BLOCK, BLOCK_N]
        out = y_ptr + split * stride_ys + m[:, None] * N + cols[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols < N)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _q6_k_mmvq_kernel(
        xq_ptr, xd_ptr, xsum_ptr, w_ptr, y_ptr,
        M, N, K, row_nbytes, stride_ys,
        M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, USE_ASM: tl.constexpr,
    ):
        """Q6_K (layout in ``native.gguf_matmul``): word u (0..31) of the 128 low-bit bytes holds,
        with v = u // 4 = 4 h + 2 p + t, value 128 h + 32 p + 16 t + 4 (u % 4) + 0..3 in its low
        nibbles (sub-block v + 4 h) and that + 64 in its high nibbles (sub-block + 4); their high
        two bits lie at bits 2 p (and 2 p + 4) of word 32 + 8 h + 4 t + u % 4 of the block."""
        pid_n, split = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(cols, N - 1).to(tl.int64)
        m = tl.arange(0, M_BLOCK)
        m_ok = m < M
        u = tl.arange(0, 32)
        v = u // 4
        h, p, tt = v // 4, (v // 2) % 2, v % 2
        lane = u % 4
        value = 128 * h + 32 * p + 16 * tt + 4 * lane  # [32] first value of word u's low nibbles
        qh_word = 32 + 8 * h + 4 * tt + lane  # [32] word of their high bits
        shift = (2 * p)[None, :]
        xq_words = xq_ptr.to(tl.pointer_type(tl.int32))
        acc = tl.zeros((M_BLOCK, BLOCK_N, 8), dtype=tl.float32)
        for i in range(BLOCKS_PER_SPLIT):
            sb = split * BLOCKS_PER_SPLIT + i
            block = rows * row_nbytes + sb * 210  # [BLOCK_N]
            ql = _word_at(w_ptr, block[:, None] + 4 * u[None, :], False)  # [BLOCK_N, 32]
            qh = _word_at(w_ptr, block[:, None] + 4 * qh_word[None, :], False)
            lo = ((ql & 0x0F0F0F0F) | (((qh >> shift) & 0x03030303) << 4))[None]  # [1, BLOCK_N, 32]: 6-bit values
            hi = (((ql >> 4) & 0x0F0F0F0F) | (((qh >> (shift + 4)) & 0x03030303) << 4))[None]
            x_at = m[:, None] * (K // 4) + sb * 64 + value[None, :] // 4  # [M_BLOCK, 32]
            x_lo = tl.load(xq_words + x_at, mask=m_ok[:, None], other=0)[:, None, :]  # [M_BLOCK, 1, 32]
            x_hi = tl.load(xq_words + x_at + 16, mask=m_ok[:, None], other=0)[:, None, :]
            # per word sum q x - 32 sum x, in integers (the sums of x once per x row, not per feature)
            ones = 0 * x_lo + 0x01010101
            w_lo = _dp4a(lo, x_lo, 0, USE_ASM) - 32 * _dp4a(ones, x_lo, 0, USE_ASM)  # [M_BLOCK, BLOCK_N, 32]
            w_hi = _dp4a(hi, x_hi, 0, USE_ASM) - 32 * _dp4a(ones, x_hi, 0, USE_ASM)
            dot_lo = tl.sum(tl.reshape(w_lo, (M_BLOCK, BLOCK_N, 8, 4)), axis=3)  # [M_BLOCK, BLOCK_N, 8]: words by v
            dot_hi = tl.sum(tl.reshape(w_hi, (M_BLOCK, BLOCK_N, 8, 4)), axis=3)
            vv = tl.arange(0, 8)
            sub = 2 * (vv // 2) + 4 * (vv // 4) + vv % 2  # [8] sub-block of the low nibbles of words 4 vv ..
            scales = w_ptr.to(tl.pointer_type(tl.int8)) + block[:, None] + 192 + sub[None, :]  # [BLOCK_N, 8]
            d = _f16_at(w_ptr, block + 208)[:, None]
            sc_lo = d * tl.load(scales).to(tl.float32)
            sc_hi = d * tl.load(scales + 4).to(tl.float32)
            run = m[:, None] * (K // 32) + sb * 8 + (sub // 2)[None, :]  # [M_BLOCK, 8] the x run of a 16-value sub-block
            xd_lo = tl.load(xd_ptr + run, mask=m_ok[:, None], other=0.0)[:, None, :]
            xd_hi = tl.load(xd_ptr + run + 2, mask=m_ok[:, None], other=0.0)[:, None, :]
            acc += dot_lo.to(tl.float32) * sc_lo[None] * xd_lo + dot_hi.to(tl.float32) * sc_hi[None] * xd_hi
        y = tl.sum(acc, axis=2)
        out = y_ptr + split * stride_ys + m[:, None] * N + cols[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols < N)[None, :])


@dataclass(frozen=True)
class MmvqTiling:
    """``block_n`` output features per program, ``num_warps`` per program, ``split_k`` programs
    sharing one tile's super-blocks (0: enough for about two waves of programs), ``unroll``
    super-blocks per loop step (Q4_K)."""

    block_n: int = 4
    num_warps: int = 2
    split_k: int = 0
    unroll: int = 1


def _split(blocks: int, tiles: int, device: torch.device, asked: int) -> int:
    wanted = asked or max(1, min((2 * sm_count(device)) // max(tiles, 1), 16))
    return max(s for s in range(1, wanted + 1) if blocks % s == 0)  # equal ranges, no tail


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_reference` by one Triton launch (x [M, K], unit stride along K)."""
    m, k = x.shape
    xq = torch.empty(m, k, device=x.device, dtype=torch.int8)
    xd = torch.empty(m, k // RUN, device=x.device, dtype=torch.float32)
    xsum = torch.empty_like(xd)
    runs = 8
    _quantize_rows_kernel[(m, triton.cdiv(k // RUN, runs))](x, xq, xd, xsum, k, x.stride(0), RUNS=runs, num_warps=1)
    return xq, xd, xsum


def gguf_mmvq(x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, tiling: MmvqTiling | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32) @ W^T for W [out_features, K] held as GGUF
    blocks ``raw`` [out_features, row_bytes] (uint8, contiguous) -> [M, out_features] in x's dtype."""
    if qtype not in MMVQ_TYPES:
        raise ValueError(f"no mmvq kernel for {qtype.name}")
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"gguf_mmvq takes at most {MAX_ROWS} rows, got {M}")
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if K % block_values or tuple(raw.shape) != (out_features, K // block_values * block_bytes) or not raw.is_contiguous():
        raise ValueError(f"raw {qtype.name} weight must be contiguous uint8 [{out_features}, {K // block_values * block_bytes}]")
    tiling = tiling or MmvqTiling()
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq, xd, xsum = quantize_rows(x)
    N = out_features
    m_block = max(1, 1 << (M - 1).bit_length())
    tiles = triton.cdiv(N, tiling.block_n)
    blocks = K // block_values
    split = _split(blocks, tiles, x.device, tiling.split_k)
    y = x.new_empty(M, N) if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    common = dict(M_BLOCK=m_block, BLOCK_N=tiling.block_n, BLOCKS_PER_SPLIT=blocks // split,
                  USE_ASM=x.is_cuda and torch.version.hip is None, num_warps=tiling.num_warps)
    args = (xq, xd, xsum, raw, y, M, N, K, raw.stride(0), y.stride(0) if split > 1 else 0)
    if qtype == Q.Q4_K:
        unroll = max(u for u in range(1, tiling.unroll + 1) if (blocks // split) % u == 0)
        _q4_k_mmvq_kernel[(tiles, split)](*args, UNROLL=unroll, **common)
    else:
        _q6_k_mmvq_kernel[(tiles, split)](*args, **common)
    return y if split == 1 else y.sum(0).to(x.dtype)
