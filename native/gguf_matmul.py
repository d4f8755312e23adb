"""``y = x @ W^T`` straight from GGUF-quantized blocks (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS), as Triton kernels.

A batch-1 decode step reads every weight once and does little arithmetic per byte, so it is bound
by memory bandwidth: keeping the weights quantized in GPU memory and expanding them in registers
reads 2-4x fewer bytes than a bf16 matmul. ``W`` [N, K] is held as the file's raw bytes: a uint8
tensor [N, K / block_values * block_bytes], row n being the blocks of output feature n, exactly as
GGUF stores it (see ``models.dequant`` for the block layouts).

Calls of many rows (prompt chunks, large batched passes) go to ``native.gguf_expand``, which
expands tiles of W for cuBLAS; calls of 1-64 bf16 rows of Q4_K, Q6_K and IQ4_XS to ``native.gguf_mma``.
The rest run here, on two kernels chosen by ``Tiling.gemv`` (``default_tiling`` picks by M). The GEMV kernel (M = 1,
decode): one program per ``BLOCK_N`` output features and x row; each step of ``CHUNK`` values
loads the rows' bytes as whole runs (16-byte vectors for Q4_K), expands them with their scales to
float32 in registers, in the order the bytes lie, and multiply-adds them with x loaded in that
order into a per-lane accumulator that is reduced once, after the K loop: the work per byte is a
few ALU operations and no cross-lane traffic, so the kernel can run at memory speed. Integers
become floats by the 2**23 mantissa trick (``exact_f32``): conversion instructions run at a
quarter rate and would bound it. The ``tl.dot`` kernel (tree verify, prefill): one program per
tile of ``BLOCK_N`` features and ``BLOCK_M`` (16-128) rows, each chunk's blocks expanded once
and multiplied on tensor cores. When the tiles are too few to fill the GPU, K is split over
``SPLIT_K`` programs whose float32 partial sums are added afterwards in a fixed order, so a
result never depends on scheduling.

Terms (blocks, sub-blocks, IQ4_XS's indices) as in ``native.gguf_blocks``, whose per-type
functions the ``tl.dot`` kernel expands its chunks with. IQ4_XS's levels are read from a 16-entry float32
table in device memory (``gguf_blocks.levels``; ``_iq4_xs_step`` says why a table). Products accumulate in
float32. The ``tl.dot`` kernel rounds the weight to x's dtype before the multiply, as a
dequantized model in that dtype holds it; the GEMV kernel multiplies the float32 weight (closer
to the exact product; both stay within x's dtype rounding of the reference). The output has x's
dtype.

**Interleaved Q4_K and Q6_K.** On a GPU where ``gguf_mma`` runs, the loaders of a model computing
in bf16 lay each decoder layer's Q4_K and Q6_K weight out by ``interleave`` (their
``interleave_layers``, in ``splitspec.models.quantized``): the 16 features a warp of those
kernels computes have their super-blocks side by side, so each step of the warp reads 2,304
(Q4_K) or 3,360 (Q6_K) contiguous bytes instead of 16 runs 144 or 210 bytes long and a row apart.
The same kernels ran 1.19-1.24x (Q4_K) and 1.04-1.09x (Q6_K) faster at one row on the 27B and 8B
layer shapes, bit for bit the same output (BENCHMARKS.md [V4], [V5]); the 27B AR step 1.13x with
Q4_K's ([K8]). ``gguf_mma`` and ``gguf_expand`` read the layout in place; the Triton kernels
and the reference read a de-interleaved copy (``deinterleave``), paths a GPU in bf16 does not take.

``gguf_matmul_reference`` is the plain-torch definition the kernels are tested against, and
``QuantLinear`` is the ``nn.Linear`` stand-in the loader builds (``load_target(keep_quantized=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn
from torch.nn import functional as F

from native import gguf_expand, gguf_mma, sm_count, use_triton
from native.gguf_blocks import TYPE_IDS, levels
from native.gguf_dequant import dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton run the reference only
    triton = None

KERNEL_TYPES = frozenset({Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})


def row_bytes(qtype: Q, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` values."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if in_features % block_values:
        raise ValueError(f"{qtype.name} rows hold multiples of {block_values} values, got {in_features}")
    return in_features // block_values * block_bytes


INTERLEAVE = 16  # features whose super-blocks ``interleave`` puts side by side (a warp's of gguf_mma's kernels)
INTERLEAVED_TYPES = (Q.Q4_K, Q.Q6_K)  # the types gguf_mma reads interleaved


def interleavable(raw: torch.Tensor, qtype: Q) -> bool:
    """Whether ``interleave`` takes this weight: Q4_K or Q6_K blocks of a multiple of ``INTERLEAVE`` rows."""
    return qtype in INTERLEAVED_TYPES and raw.dim() == 2 and raw.shape[0] % INTERLEAVE == 0


def interleave(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """``qtype`` blocks [N, row_bytes] in the file's layout (row n: feature n's super-blocks) -> a
    new tensor of the same shape holding them as [N / 16, super-blocks, 16, block bytes]:
    super-block s of features 16 t .. 16 t + 15 side by side. Rows [16 a, 16 b) of it still hold
    exactly the features [16 a, 16 b), so a fused weight's parts stay views of it
    (``layers.fuse_linears``)."""
    n, block_bytes = raw.shape[0], GGML_QUANT_SIZES[qtype][1]
    return raw.view(n // INTERLEAVE, INTERLEAVE, -1, block_bytes).transpose(1, 2).contiguous().view(n, -1)


def deinterleave(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """``interleave``'s inverse: a new tensor in the file's layout."""
    n, block_bytes = raw.shape[0], GGML_QUANT_SIZES[qtype][1]
    return raw.view(n // INTERLEAVE, -1, INTERLEAVE, block_bytes).transpose(1, 2).contiguous().view(n, -1)


def gguf_matmul_reference(x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, interleaved: bool = False) -> torch.Tensor:
    """x [..., K] @ dequantize(raw)^T in x's dtype -> [..., out_features]: the definition
    (``interleaved``: ``raw`` in ``interleave``'s layout)."""
    w = dequantize(deinterleave(raw, qtype) if interleaved else raw, qtype, (out_features, x.shape[-1])).to(x.dtype)
    return F.linear(x, w)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_enabled(x: torch.Tensor) -> bool:
    """Whether ``gguf_matmul`` runs for x: a kernel dtype where ``native.use_triton`` says kernels run."""
    return use_triton(x) and x.dtype in KERNEL_DTYPES


# ------------------------------------------------------------------------------------------ kernels

if triton is not None:
    from native.gguf_blocks import chunk, exact_f32, f16, iq4_xs_scale, q4_k_scale_min

    @triton.jit(do_not_specialize=["M"])
    def _gguf_matmul_kernel(
        x_ptr, w_ptr, y_ptr, levels_ptr,
        M, N, K, stride_xm, stride_ys, stride_ym, row_nbytes,
        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
        CHUNKS_PER_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    ):
        """y[split, m, n] = sum over this split's K range of x[m, k] * W[n, k] (see the module doc)."""
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        rows = tl.minimum(cols, N - 1).to(tl.int64)  # W rows to read (the tail repeats the last, unstored); int64: a vocab-sized W passes 2 GiB
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A constant trip count: triton 3.6's CPU interpreter cannot take a runtime loop bound
        # under numpy >= 2.4, and the compiler can pipeline a known count.
        for i in range(CHUNKS_PER_SPLIT):
            k0 = (split * CHUNKS_PER_SPLIT + i) * CHUNK
            w = chunk(w_ptr, levels_ptr, rows, row_nbytes, k0, QTYPE, BLOCK_N, CHUNK, False)
            x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + tl.arange(0, CHUNK))[None, :], mask=m_ok[:, None], other=0.0)
            w = w.to(x.dtype)  # the weight as a dequantized model in x's dtype holds it
            if FP32_DOT:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        y = y_ptr + split * stride_ys + m[:, None] * stride_ym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols < N)[None, :])

    # -------------------------------------------------------------------- GEMV path (M = 1)
    # One x row per program. Each step loads BLOCK_N rows x CHUNK values as whole runs of bytes
    # (16-byte vectors where the block layout allows), expands them to float32 with their scales
    # in registers, in the order the bytes lie, and multiply-adds them with x loaded in that same
    # order into an accumulator of the step's shape: no cross-lane work until the one reduction
    # after the K loop. The returned (weights, x offsets) pairs cover the step's values once.

    @triton.jit
    def _q8_0_step(w_ptr, rows, row_nbytes, k0, CHUNK: tl.constexpr):
        """Q8_0: G = CHUNK / 32 blocks of f16 d then 32 int8 q -> w [BLOCK_N, G, 32], x offsets [G, 32]."""
        G: tl.constexpr = CHUNK // 32
        g = tl.arange(0, G)
        lane = tl.arange(0, 32)
        block = rows[:, None] * row_nbytes + (k0 // 32 + g)[None, :] * 34  # [BLOCK_N, G]
        q = tl.load(w_ptr + block[:, :, None] + 2 + lane[None, None, :]).to(tl.int32)
        w = exact_f32(q ^ 128, 128.0) * f16(w_ptr, block)[:, :, None]  # q ^ 128 = int8 + 128
        return w, k0 + 32 * g[:, None] + lane[None, :]

    @triton.jit
    def _q4_k_step(w_ptr, rows, row_nbytes, k0, CHUNK: tl.constexpr):
        """Q4_K (layout in ``q4_k_chunk``): G = CHUNK / 64 groups of 32 quant bytes (16-byte
        aligned: 144 = 9 * 16); byte l of group j holds value 64 j + l of its super-block in its low
        nibble (sub-block 2 j) and 64 j + 32 + l in its high one -> (w_lo, w_hi) [BLOCK_N, G, 32]
        and the x offsets of w_lo [G, 32] (w_hi's are 32 on)."""
        G: tl.constexpr = CHUNK // 64
        g = tl.arange(0, G)
        j = g % 4
        lane = tl.arange(0, 32)
        block = rows[:, None] * row_nbytes + (k0 // 256 + g // 4)[None, :] * 144  # [BLOCK_N, G]
        at = tl.multiple_of(block + 16 + 32 * j[None, :], (16, 16))
        q = tl.load(w_ptr + at[:, :, None] + lane[None, None, :]).to(tl.int32)  # [BLOCK_N, G, 32]
        scale_lo, min_lo = q4_k_scale_min(w_ptr, block, 2 * j)
        scale_hi, min_hi = q4_k_scale_min(w_ptr, block, 2 * j + 1)
        d, dmin = f16(w_ptr, block), f16(w_ptr, block + 2)  # [BLOCK_N, G]
        w_lo = tl.fma(exact_f32(q & 15, 0.0), (d * scale_lo.to(tl.float32))[:, :, None], -(dmin * min_lo.to(tl.float32))[:, :, None])
        w_hi = tl.fma(exact_f32(q >> 4, 0.0), (d * scale_hi.to(tl.float32))[:, :, None], -(dmin * min_hi.to(tl.float32))[:, :, None])
        return w_lo, w_hi, k0 + 64 * g[:, None] + lane[None, :]

    @triton.jit
    def _q5_k_step(w_ptr, rows, row_nbytes, k0, CHUNK: tl.constexpr):
        """Q5_K (layout in ``q5_k_chunk``): ``_q4_k_step``'s groups (32 low-nibble bytes at 48 + 32 j,
        16-byte aligned: 176 = 11 * 16) plus the block's 32 fifth-bit bytes, whose bits 2 j and 2 j + 1
        complete the low and high nibble of byte l -> (w_lo, w_hi) [BLOCK_N, G, 32] and the x offsets
        of w_lo [G, 32] (w_hi's are 32 on)."""
        G: tl.constexpr = CHUNK // 64
        g = tl.arange(0, G)
        j = g % 4
        lane = tl.arange(0, 32)
        block = rows[:, None] * row_nbytes + (k0 // 256 + g // 4)[None, :] * 176  # [BLOCK_N, G]
        at = tl.multiple_of(block + 48 + 32 * j[None, :], (16, 16))
        q = tl.load(w_ptr + at[:, :, None] + lane[None, None, :]).to(tl.int32)  # [BLOCK_N, G, 32]
        qh_at = tl.multiple_of(block + 16, (16, 16))  # read again for each of a block's 4 groups: L1 hits, no more DRAM bytes
        qh = tl.load(w_ptr + qh_at[:, :, None] + lane[None, None, :]).to(tl.int32) >> (2 * j)[None, :, None]
        scale_lo, min_lo = q4_k_scale_min(w_ptr, block, 2 * j)
        scale_hi, min_hi = q4_k_scale_min(w_ptr, block, 2 * j + 1)
        d, dmin = f16(w_ptr, block), f16(w_ptr, block + 2)  # [BLOCK_N, G]
        q_lo = (q & 15) | ((qh << 4) & 16)  # bit 2 j of qh lands on 4
        q_hi = (q >> 4) | ((qh << 3) & 16)  # bit 2 j + 1 lands on 4
        w_lo = tl.fma(exact_f32(q_lo, 0.0), (d * scale_lo.to(tl.float32))[:, :, None], -(dmin * min_lo.to(tl.float32))[:, :, None])
        w_hi = tl.fma(exact_f32(q_hi, 0.0), (d * scale_hi.to(tl.float32))[:, :, None], -(dmin * min_hi.to(tl.float32))[:, :, None])
        return w_lo, w_hi, k0 + 64 * g[:, None] + lane[None, :]

    @triton.jit
    def _iq4_xs_step(w_ptr, levels_ptr, rows, row_nbytes, k0, CHUNK: tl.constexpr):
        """IQ4_XS (layout in ``iq4_xs_chunk``): U = CHUNK / 32 runs, one per sub-block s = u % 8, of
        16 index bytes at 8 + 16 s (8-byte aligned only: 136 = 17 * 8); byte i holds the indices of
        values 32 u + i (low nibble) and 32 u + 16 + i (high) -> (w_lo, w_hi) [BLOCK_N, U, 16] and
        the x offsets of w_lo [U, 16] (w_hi's are 16 on). The levels come from ``levels_ptr``: a
        gather from one 64-byte line that stays in L1 costs one load per value, where a select over
        sixteen constants would cost ~15 ALU operations, and the ALU is this kernel's other bound."""
        U: tl.constexpr = CHUNK // 32
        u = tl.arange(0, U)
        s = u % 8
        lane = tl.arange(0, 16)
        block = rows[:, None] * row_nbytes + (k0 // 256 + u // 8)[None, :] * 136  # [BLOCK_N, U]
        at = tl.multiple_of(block + 8 + 16 * s[None, :], (8, 8))
        index = tl.load(w_ptr + at[:, :, None] + lane[None, None, :]).to(tl.int32)  # [BLOCK_N, U, 16]
        dl = f16(w_ptr, block) * exact_f32(iq4_xs_scale(w_ptr, block, s), 32.0)  # [BLOCK_N, U]
        w_lo = tl.load(levels_ptr + (index & 15)) * dl[:, :, None]
        w_hi = tl.load(levels_ptr + (index >> 4)) * dl[:, :, None]
        return w_lo, w_hi, k0 + 32 * u[:, None] + lane[None, :]

    @triton.jit
    def _q6_k_step(w_ptr, rows, row_nbytes, k0, CHUNK: tl.constexpr):
        """Q6_K (layout in ``q6_k_chunk``): U = CHUNK / 32 runs u = 8 sb + v of 16 low-bit bytes
        16 v + i, v = 4 h + 2 p + t; the low nibble is value 128 h + 32 p + 16 t + i (r = p,
        sub-block v + 4 h), the high one that + 64 (r = p + 2, sub-block + 4); their high bits are
        bits 2 r of byte 128 + 32 h + 16 t + i -> (w_lo, w_hi) [BLOCK_N, U, 16] and the x offsets
        of w_lo [U, 16] (w_hi's are 64 on)."""
        U: tl.constexpr = CHUNK // 32
        u = tl.arange(0, U)
        v = u % 8
        h, p, t = v // 4, (v // 2) % 2, v % 2
        lane = tl.arange(0, 16)
        block = rows[:, None] * row_nbytes + (k0 // 256 + u // 8)[None, :] * 210  # [BLOCK_N, U]
        ql = tl.load(w_ptr + block[:, :, None] + (16 * v)[None, :, None] + lane[None, None, :]).to(tl.int32)
        qh_at = (128 + 32 * h + 16 * t)[None, :, None] + lane[None, None, :]
        qh = tl.load(w_ptr + block[:, :, None] + qh_at).to(tl.int32) >> (2 * p)[None, :, None]
        scales = w_ptr + block + 192 + (v + 4 * h)[None, :]  # [BLOCK_N, U]
        d = f16(w_ptr, block + 208)
        scale_lo = d * tl.load(scales).to(tl.int8, bitcast=True).to(tl.float32)
        scale_hi = d * tl.load(scales + 4).to(tl.int8, bitcast=True).to(tl.float32)
        w_lo = exact_f32((ql & 15) | ((qh & 3) << 4), 32.0) * scale_lo[:, :, None]
        w_hi = exact_f32((ql >> 4) | (qh & 48), 32.0) * scale_hi[:, :, None]  # bits 2 p + 4 land on 4, 5
        x_at = k0 + 256 * (u // 8)[:, None] + (128 * h + 32 * p + 16 * t)[:, None] + lane[None, :]
        return w_lo, w_hi, x_at

    @triton.jit
    def _gguf_gemv_kernel(
        x_ptr, w_ptr, y_ptr, levels_ptr,
        N, stride_xm, stride_ys, stride_ym, row_nbytes,
        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PER_SPLIT: tl.constexpr,
    ):
        """y[split, m, n] for x row m = program_id(2) and this program's BLOCK_N features n (see above)."""
        pid_n, split, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(cols, N - 1).to(tl.int64)
        x_row = x_ptr + m * stride_xm
        if QTYPE == 0:
            acc = tl.zeros((BLOCK_N, CHUNK // 32, 32), dtype=tl.float32)
        elif QTYPE == 1 or QTYPE == 3:  # Q4_K, Q5_K: 32-byte groups of two sub-blocks
            acc = tl.zeros((BLOCK_N, CHUNK // 64, 32), dtype=tl.float32)
        else:  # Q6_K, IQ4_XS: 16-byte runs
            acc = tl.zeros((BLOCK_N, CHUNK // 32, 16), dtype=tl.float32)
        for i in range(CHUNKS_PER_SPLIT):
            k0 = (split * CHUNKS_PER_SPLIT + i) * CHUNK
            if QTYPE == 0:
                w, x_at = _q8_0_step(w_ptr, rows, row_nbytes, k0, CHUNK)
                acc = tl.fma(w, tl.load(x_row + x_at).to(tl.float32)[None], acc)  # fma: the compiler does not fuse a += b * c here
            elif QTYPE == 1:
                w_lo, w_hi, x_at = _q4_k_step(w_ptr, rows, row_nbytes, k0, CHUNK)
                acc = tl.fma(w_lo, tl.load(x_row + x_at).to(tl.float32)[None], acc)
                acc = tl.fma(w_hi, tl.load(x_row + x_at + 32).to(tl.float32)[None], acc)
            elif QTYPE == 2:
                w_lo, w_hi, x_at = _q6_k_step(w_ptr, rows, row_nbytes, k0, CHUNK)
                acc = tl.fma(w_lo, tl.load(x_row + x_at).to(tl.float32)[None], acc)
                acc = tl.fma(w_hi, tl.load(x_row + x_at + 64).to(tl.float32)[None], acc)
            elif QTYPE == 3:
                w_lo, w_hi, x_at = _q5_k_step(w_ptr, rows, row_nbytes, k0, CHUNK)
                acc = tl.fma(w_lo, tl.load(x_row + x_at).to(tl.float32)[None], acc)
                acc = tl.fma(w_hi, tl.load(x_row + x_at + 32).to(tl.float32)[None], acc)
            else:
                w_lo, w_hi, x_at = _iq4_xs_step(w_ptr, levels_ptr, rows, row_nbytes, k0, CHUNK)
                acc = tl.fma(w_lo, tl.load(x_row + x_at).to(tl.float32)[None], acc)
                acc = tl.fma(w_hi, tl.load(x_row + x_at + 16).to(tl.float32)[None], acc)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
        tl.store(y_ptr + split * stride_ys + m * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@dataclass(frozen=True)
class Tiling:
    """How ``gguf_matmul`` cuts its work: ``block_n`` output features per program, ``chunk`` K
    values per loop step, ``num_warps`` per program, ``split_k`` programs sharing one tile's K
    range (0: enough to make about two waves of programs on the device), and ``gemv``: the GEMV
    kernel (one x row per program, CUDA cores) instead of ``tl.dot`` tiles."""

    block_n: int
    chunk: int
    num_warps: int
    split_k: int = 0
    gemv: bool = False


def default_tiling(m: int, qtype: Q | None = None) -> Tiling:
    """The tiling for ``m`` input rows: the GEMV kernel for one row (decode), where the weight's
    bytes are all the work; ``tl.dot`` tiles above, which expand each weight value once per tile.
    Chosen by ``scripts/gpu_gguf_matmul.py`` on an H200 (BENCHMARKS.md): the fastest candidate
    over one Qwen3-8B step's linears per type and row count, within ~10% of it for every m >= 2."""
    if m == 1:
        # Q5_K and IQ4_XS are not timed yet: they take the tiling of the type whose step has their
        # shape (Q5_K: Q4_K's 32-byte groups; IQ4_XS: Q6_K's 16-byte runs).
        if qtype in (Q.Q6_K, Q.IQ4_XS):
            return Tiling(block_n=8, chunk=1024, num_warps=4, gemv=True)
        return Tiling(block_n=4, chunk=1024, num_warps=2, gemv=True)
    return Tiling(block_n=64, chunk=128, num_warps=4)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def gguf_matmul(
    x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, tiling: Tiling | None = None, interleaved: bool = False,
    prepared: gguf_mma.Prepared | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32) @ W^T for W [out_features, K] held as GGUF blocks ``raw``
    [out_features, row_bytes] (uint8; ``interleaved``: in ``interleave``'s layout) ->
    [..., out_features] in x's dtype: by ``native.gguf_mma`` where it takes the call
    (Q4_K/Q6_K/IQ4_XS, bf16, 1-64 rows), by ``native.gguf_expand`` (expanded tiles on cuBLAS) for
    many rows, else by the Triton kernels. ``tiling`` forces the Triton kernels with that tiling
    (benchmarks compare tilings). ``prepared``: x is ``gguf_mma.produce``'s placeholder; its arrays
    serve a Q4_K/Q6_K kernel's call, and any other path reads ``prepared.plain()``."""
    if qtype not in KERNEL_TYPES:
        raise ValueError(f"no kernel for {qtype.name} (kernels: {', '.join(sorted(t.name for t in KERNEL_TYPES))})")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    K = x.shape[-1]
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, row_bytes(qtype, K)):
        raise ValueError(f"raw {qtype.name} weight must be uint8 [{out_features}, {row_bytes(qtype, K)}], got {raw.dtype} {list(raw.shape)}")
    if not raw.is_contiguous():  # the GEMV kernel's 16-byte loads rely on whole packed rows
        raise ValueError(f"raw {qtype.name} weight must be contiguous, got strides {raw.stride()}")
    if interleaved and not interleavable(raw, qtype):
        raise ValueError(f"an interleaved weight must be Q4_K or Q6_K of a multiple of {INTERLEAVE} rows, got {qtype.name} [{out_features}, ...]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], out_features
    if M == 0:
        return x.new_empty(*lead, N)
    if prepared is not None:
        if tiling is None and qtype in gguf_mma.A_OPERAND_TYPES and gguf_mma.usable(x2, raw, qtype):
            return gguf_mma.matmul(x2, raw, qtype, N, interleaved=interleaved, prepared=prepared.arrays_for(qtype)).reshape(*lead, N)
        x2 = prepared.plain().reshape(-1, K)
    if tiling is None and gguf_mma.usable(x2, raw, qtype):
        return gguf_mma.matmul(x2, raw, qtype, N, interleaved=interleaved).reshape(*lead, N)
    table = levels(x.device) if qtype == Q.IQ4_XS else raw  # the other types never read this pointer
    if tiling is None and gguf_expand.takes(x2, qtype):
        return gguf_expand.matmul(x2, raw, qtype, N, table, interleaved).reshape(*lead, N)
    if interleaved:  # the Triton kernels read the file's layout (a GPU computing in bf16 never gets here)
        raw = deinterleave(raw, qtype)
    tiling = tiling or default_tiling(M, qtype)
    if tiling.gemv:
        block_m = 1
        smallest_chunk = GGML_QUANT_SIZES[qtype][0]  # a step holds whole blocks (super-blocks)
    else:
        block_m = min(128, max(16, _next_power_of_2(M)))  # tl.dot wants 16 rows at least
        smallest_chunk = 32
    block_n, chunk = tiling.block_n, max(tiling.chunk, smallest_chunk)
    while K % chunk:  # Q8_0 rows are multiples of 32 only; K-quant and IQ4_XS rows always fit 256
        chunk //= 2
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    chunks = K // chunk
    wanted = tiling.split_k or max(1, min((2 * sm_count(x.device)) // tiles, 16))
    split_k = max(s for s in range(1, wanted + 1) if chunks % s == 0)  # equal K ranges, no tail
    y = x.new_empty(M, N) if split_k == 1 else torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, block_n), split_k, triton.cdiv(M, block_m))
    common = dict(QTYPE=TYPE_IDS[qtype], BLOCK_N=block_n, CHUNK=chunk, CHUNKS_PER_SPLIT=chunks // split_k, num_warps=tiling.num_warps)
    strides = (x2.stride(0), y.stride(0) if split_k > 1 else 0, y.stride(-2), raw.stride(0))
    if tiling.gemv:
        _gguf_gemv_kernel[grid](x2, raw, y, table, N, *strides, **common)
    else:
        _gguf_matmul_kernel[grid](x2, raw, y, table, M, N, K, *strides, BLOCK_M=block_m, FP32_DOT=x.dtype == torch.float32, **common)
    if split_k > 1:
        y = y.sum(0).to(x.dtype)  # fixed order, unlike atomics: the same input gives the same bits
    return y.reshape(*lead, N)


def quant_linear(x: torch.Tensor, raw: torch.Tensor, qtype: Q, bias: torch.Tensor | None = None,
                 interleaved: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W [rows of raw, K] in ``raw``'s blocks (``interleaved``: in
    ``interleave``'s layout): the kernels where ``triton_enabled``, else ``gguf_matmul_reference``.
    x may be ``gguf_mma.produce``'s placeholder (``gguf_mma.prepared_for``)."""
    prepared = gguf_mma.prepared_for(x)
    if prepared is not None and not (prepared.arrays and triton_enabled(x)):  # x's values, where no kernel takes the arrays
        x, prepared = prepared.plain(), None
    if triton_enabled(x):
        y = gguf_matmul(x, raw, qtype, raw.shape[0], interleaved=interleaved, prepared=prepared)
    else:
        y = gguf_matmul_reference(x, raw, qtype, raw.shape[0], interleaved)
    return y if bias is None else y + bias.to(y.dtype)


class QuantLinear(nn.Module):
    """A bias-optional linear layer whose weight [out_features, in_features] stays in GGUF blocks.

    ``raw`` (buffer, uint8 [out_features, row_bytes]) holds the rows exactly as in the file, or,
    once ``interleave`` has run, in ``interleave``'s layout (``interleaved``). The forward runs the
    kernels when ``triton_enabled``, else ``gguf_matmul_reference``.
    """

    def __init__(self, qtype: Q, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"QuantLinear supports {', '.join(sorted(t.name for t in KERNEL_TYPES))}, not {qtype.name}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("raw", torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.interleaved = False

    def interleave(self) -> None:
        """Rewrite the blocks in place in ``interleave``'s layout (``interleavable`` must hold). In
        place, so that a loader's references to the loaded tensor keep no second copy alive (the
        extra memory is one weight's, while it is rewritten)."""
        if not self.interleaved:
            self.raw.copy_(interleave(self.raw, self.qtype))
            self.interleaved = True

    def deinterleave(self) -> None:
        """Rewrite the blocks in place in the file's layout."""
        if self.interleaved:
            self.raw.copy_(deinterleave(self.raw, self.qtype))
            self.interleaved = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.raw, self.qtype, self.bias, self.interleaved)

    def extra_repr(self) -> str:
        layout = ", interleaved" if self.interleaved else ""
        return f"{self.qtype.name}{layout}, in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
