"""``y = x @ W^T`` for many bf16 rows of x and W in Q4_K or Q6_K blocks: one tiled GEMM that expands
each weight tile in shared memory (CUDA C++, ``gguf_gemm.cu``, built into ``native.gguf_mma``'s
extension).

A batched verify pass of many trees, or many users' decode steps, multiplies tens to hundreds of
rows by every weight. ``native.gguf_mma``'s kernels take 32 rows a launch and read and expand every
weight again for each 32; ``native.gguf_expand`` writes the whole weight out as bf16 for cuBLAS,
4.5-5 bytes of traffic a weight whatever the rows (about 29 ms of a 27B pass, BENCHMARKS.md [Y3]).
Here a block of 8 warps owns 128 features and 32 or 64 rows of x (``block_rows``); the raw bytes
of a super-block arrive by cp.async a super-block ahead, every thread expands a quarter of one
feature's super-block to bf16 into a shared half tile, and the warps multiply the tiles on
``mma.sync`` (bf16, float32 accumulators); two blocks share a multiprocessor, so one expands while
the other multiplies. So a weight is read from memory once per 64 rows and never written back.

Numerics are ``gguf_expand``'s: each weight is the dequantizer's float32 value (``gguf_dequant``'s
arithmetic) rounded to bf16, as a bf16 model holds it; products accumulate in float32, over K in
order within a split. K is split over programs (``splits``) when the tiles are too few to fill the
GPU; the last program of a tile adds the splits' float32 partial sums in split order, so a result
repeats its bits. The splits depend on M, so a row's result may differ in its last bits between
calls of different row counts (as cuBLAS's choice of kernel does on the expanded path).

Which calls come here is ``gguf_matmul``'s choice (``takes``).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from native import gguf_mma, sm_count

TYPES = {Q.Q4_K: 12, Q.Q6_K: 14}  # gguf's type numbers, as the extension takes them
ALIGNMENT = {Q.Q4_K: 16, Q.Q6_K: 2}  # bytes: the rows' copies (Q6_K's in 4-byte words around them)
FEATURES = 128  # W rows a program computes
MAX_SPLITS = 8


def block_rows(m: int) -> int:
    """Rows of x a program takes: 32 up to 32 rows, 64 above (half the expansions a weight)."""
    return 32 if m <= 32 else 64


def blocks_per_sm(qtype: Q, rows_per_block: int) -> int:
    """Programs a multiprocessor holds (shared memory): two, but one for Q6_K at 64 rows."""
    return 1 if qtype == Q.Q6_K and rows_per_block == 64 else 2


def splits_for(tiles: int, super_blocks: int, slots: int) -> int:
    """How many programs share a tile's K range, for ``tiles`` tiles and ``slots`` programs the GPU
    holds at once: one when the tiles fill the slots (split partial sums cost a float32 write and
    read of the output each); else the count that best fills the last wave, discounting each
    program's start (a program of ``k`` super-blocks costs about ``k + 1``), never below two
    super-blocks a program."""
    if tiles >= slots:
        return 1

    def worth(s: int) -> float:
        programs = tiles * s
        waves = -(-programs // slots)
        per_program = super_blocks / s
        return programs / (waves * slots) * per_program / (per_program + 1)

    return max(range(1, max(1, min(MAX_SPLITS, super_blocks // 2)) + 1), key=worth)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, rows_per_block: int = 0, splits: int = 0) -> torch.Tensor:
    """x [M, K] bf16 @ W^T for W [out_features, K] in ``raw``'s Q4_K/Q6_K blocks -> [M, out_features]
    bf16. ``rows_per_block`` (32 or 64; 0: ``block_rows``) and ``splits`` (0: ``splits_for``) are
    for benchmarks. ``usable`` must hold."""
    M, K = x.shape
    bm = rows_per_block or block_rows(M)
    tiles = -(-M // bm) * -(-out_features // FEATURES)
    if tiles > gguf_mma.MAX_TILES:
        raise ValueError(f"{M} x {out_features} needs {tiles} programs, more than the {gguf_mma.MAX_TILES} counters")
    splits = splits or splits_for(tiles, K // 256, sm_count(x.device) * blocks_per_sm(qtype, bm))
    if x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.clone(memory_format=torch.contiguous_format)  # cp.async copies x 16 bytes at a time; a fresh copy is aligned
    out = torch.empty(M, out_features, dtype=torch.bfloat16, device=x.device)
    partial = torch.empty(splits, M, out_features, dtype=torch.float32, device=x.device) if splits > 1 else out
    gguf_mma.extension().gguf_gemm(x, raw, out, partial, gguf_mma.counters(x.device), TYPES[qtype], splits, bm)
    return out


def usable(x: torch.Tensor, raw: torch.Tensor, qtype: Q) -> bool:
    """Whether ``matmul`` takes x [M, K] and ``raw``: a Q4_K/Q6_K weight, bf16 x on a GPU with bf16
    tensor cores and cp.async (sm_80 on), rows aligned as the kernel copies them, and built."""
    if qtype not in TYPES or x.dtype != torch.bfloat16 or not x.is_cuda:
        return False
    if raw.data_ptr() % ALIGNMENT[qtype] or raw.stride(0) % ALIGNMENT[qtype] or not gguf_mma.capable(x):
        return False
    return gguf_mma.extension() is not None
