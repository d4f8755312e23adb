"""Top-K of log-softmax over a vocabulary, as two launches: the draft's per-depth candidates.

``torch.topk(torch.log_softmax(logits.float(), -1), k)`` over a [15, 151936] block is about ten
kernels (a float copy, the softmax's two passes, the radix select's four or five) and ~110 µs
of an H100's time in a ~1.8 ms draft step. log-softmax is ``logits - logsumexp`` per row, so
the top-K of the logits are the top-K of the log-probs, and one pass over the logits gives both:

1. ``_chunk_kernel``: a program per (row, chunk of ``CHUNK`` columns) loads its chunk once,
   writes the chunk's maximum and ``sum(exp(x - max))`` (the partial logsumexp) and its own
   top-K (values and column ids, found by K rounds of max-and-remove);
2. ``_merge_kernel``: a program per row combines the partial sums into the row's logsumexp
   and picks the top-K of the chunks' candidates, subtracting the logsumexp.

Ties go to the lower column id. Reference: :func:`top_k_log_softmax_reference`, which the tests
compare it with.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

CHUNK = 4096  # columns per program of the first pass: ~38 programs per row for a 152k vocabulary
MAX_K = 64


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        logits_ptr, vals_ptr, ids_ptr, stats_ptr, V, stride_row,
        K: tl.constexpr, CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        chunks = tl.num_programs(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        part = row * chunks + chunk
        tl.store(stats_ptr + 2 * part, m)
        tl.store(stats_ptr + 2 * part + 1, tl.sum(tl.exp(x - m), 0))
        for i in range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(x == best, cols, V + CHUNK), 0)  # the lowest column holding the max
            tl.store(vals_ptr + part * K + i, best)
            tl.store(ids_ptr + part * K + i, at)
            x = tl.where(cols == at, float("-inf"), x)

    @triton.jit
    def _merge_kernel(
        vals_ptr, ids_ptr, stats_ptr, out_ids_ptr, out_vals_ptr, chunks,
        K: tl.constexpr, CANDIDATES: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        c_ok = c < chunks
        m = tl.load(stats_ptr + 2 * (row * chunks + c), mask=c_ok, other=float("-inf"))
        s = tl.load(stats_ptr + 2 * (row * chunks + c) + 1, mask=c_ok, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        j = tl.arange(0, CANDIDATES)
        j_ok = j < chunks * K
        vals = tl.load(vals_ptr + row * chunks * K + j, mask=j_ok, other=float("-inf"))
        ids = tl.load(ids_ptr + row * chunks * K + j, mask=j_ok, other=0)
        # Candidates are chunk-major, so the lowest position holding the max is the lowest column.
        for i in range(K):
            best = tl.max(vals, 0)
            at = tl.min(tl.where(vals == best, j, CANDIDATES), 0)
            tl.store(out_vals_ptr + row * K + i, best - lse)
            tl.store(out_ids_ptr + row * K + i, tl.sum(tl.where(j == at, ids, 0), 0))
            vals = tl.where(j == at, float("-inf"), vals)


def supported(logits: torch.Tensor, k: int) -> bool:
    """Inputs the kernels take: 2-D float logits with unit column stride, 1 <= k <= MAX_K <= columns."""
    return (
        logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 1 <= k <= min(MAX_K, logits.shape[1])
    )


def top_k_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (ids [R, k] int32, log-probs [R, k] float32), highest first."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    vals = torch.empty(rows, chunks, k, device=dev, dtype=torch.float32)
    ids = torch.empty(rows, chunks, k, device=dev, dtype=torch.int32)
    stats = torch.empty(rows, chunks, 2, device=dev, dtype=torch.float32)
    _chunk_kernel[(rows, chunks)](logits, vals, ids, stats, vocab, logits.stride(0), K=k, CHUNK=CHUNK, num_warps=8)
    out_ids = torch.empty(rows, k, device=dev, dtype=torch.int32)
    out_vals = torch.empty(rows, k, device=dev, dtype=torch.float32)
    _merge_kernel[(rows,)](
        vals, ids, stats, out_ids, out_vals, chunks,
        K=k, CANDIDATES=triton.next_power_of_2(chunks * k), CHUNKS=triton.next_power_of_2(chunks), num_warps=4,
    )
    return out_ids, out_vals


def top_k_log_softmax_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch form: (ids [R, k] int32, log-probs [R, k] float32)."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices.to(torch.int32), top.values
