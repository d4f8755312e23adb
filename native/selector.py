"""A DFlash2 draft's selector pair scores (``CandidateSelector.pair_scores`` in
splitspec/models/dflash2.py) in one launch after the gate projection.

Unfused, the scores of a block are about ten small kernels (the predecessors' concatenation,
two codebook gathers and their casts, the gate's cast and multiply, a batched matmul, the
unary add). One program per block depth ``t`` here gathers its ``K`` predecessors' rows of the
predecessor codebook ``A`` and its ``K`` candidates' rows of the successor codebook ``B`` once
and writes ``S[t, a, b] = U[t, b] + sum_r A[a_r] * gate[t, r] * B[b, r]`` in float32, as the
reference (the sum's order differs: float32 rounding, not bitwise).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

MAX_CHUNK_R = 256  # rank columns a loop iteration: the published rank's whole codebook rows

if triton is not None:

    @triton.jit
    def _pair_scores_kernel(
        gate_ptr, a_book_ptr, b_book_ptr, cand_ptr, anchor_ptr, unary_ptr, out_ptr, depths, K,
        R: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_R: tl.constexpr,
    ):
        pid = tl.program_id(0)  # block s, depth t: row s * depths + t of gate, cand and unary
        s, t = pid // depths, pid % depths
        ks = tl.arange(0, BLOCK_K)
        ok = ks < K
        cand = tl.load(cand_ptr + pid * K + ks, mask=ok, other=0).to(tl.int64)  # [BLOCK_K] b
        if t == 0:  # depth 1: every row's predecessor is the anchor
            pred = tl.load(anchor_ptr + s + ks * 0).to(tl.int64)
        else:
            pred = tl.load(cand_ptr + (pid - 1) * K + ks, mask=ok, other=0).to(tl.int64)  # [BLOCK_K] a
        acc = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.float32)
        for r0 in tl.static_range(0, R, CHUNK_R):  # whole codebook rows at once for ranks up to CHUNK_R
            rs = r0 + tl.arange(0, CHUNK_R)
            r_ok = rs < R
            gate = tl.load(gate_ptr + pid * R + rs, mask=r_ok, other=0.0).to(tl.float32)
            both = ok[:, None] & r_ok[None, :]
            a = tl.load(a_book_ptr + pred[:, None] * R + rs[None, :], mask=both, other=0.0).to(tl.float32) * gate[None, :]
            b = tl.load(b_book_ptr + cand[:, None] * R + rs[None, :], mask=both, other=0.0).to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")  # [a, b], float32 products as the reference's
        unary = tl.load(unary_ptr + pid * K + ks, mask=ok, other=0.0).to(tl.float32)
        out = acc + unary[None, :]
        tl.store(out_ptr + pid * K * K + ks[:, None] * K + ks[None, :], out, mask=ok[:, None] & ok[None, :])


def supported(gate: torch.Tensor, a_book: torch.Tensor, b_book: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor) -> bool:
    """Contiguous operands, codebooks of the gate's rank, at most 64 candidates."""
    return (
        all(t.is_contiguous() for t in (gate, a_book, b_book, unary, candidates))
        and a_book.shape == b_book.shape and a_book.shape[-1] == gate.shape[-1] and candidates.shape[-1] <= 64
    )


def pair_scores(
    gate: torch.Tensor,  # [..., L, R] the gate projection of each depth's draft row
    a_book: torch.Tensor,  # [vocab, R] predecessor codebook A
    b_book: torch.Tensor,  # [vocab, R] successor codebook B
    unary: torch.Tensor,  # [..., L, K]
    candidates: torch.Tensor,  # [..., L, K] token ids
    anchor: torch.Tensor,  # [...] the depth-1 predecessor
) -> torch.Tensor:
    """S [..., L, K, K] float32, as ``CandidateSelector.pair_scores``."""
    depths, k = candidates.shape[-2:]
    blocks = candidates.numel() // (depths * k)
    out = torch.empty(*candidates.shape, k, dtype=torch.float32, device=gate.device)
    anchors = anchor.reshape(blocks).contiguous()
    block_k = max(16, triton.next_power_of_2(k))
    _pair_scores_kernel[(blocks * depths,)](
        gate, a_book, b_book, candidates, anchors, unary, out, depths, k,
        R=gate.shape[-1], BLOCK_K=block_k, CHUNK_R=min(MAX_CHUNK_R, triton.next_power_of_2(gate.shape[-1])), num_warps=4,
    )
    return out
