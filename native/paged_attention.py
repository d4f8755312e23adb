"""Masked grouped-query attention of a batched pass read straight from the paged KV pool.

Terms as in ``splitspec.models.paged``: ``B`` sequences, each with ``T`` (padded) query rows and
key columns ``0 .. S`` whose K/V live in the pool's *slots* through the sequence's block table
(column ``c`` of sequence ``b`` is slot ``tables[b, c // block_size] * block_size + c %
block_size``). Columns ``< starts[b]`` are the committed prefix, ``starts[b] .. starts[b] + T``
the block's own rows; nothing past ``starts[b] + T`` is read. Every row sees the prefix from
``prefix_from[b]`` on (0 unless given), so its visibility is not read there; columns before it
follow ``visible`` (a draft window hides them).

The torch path (``QKVProjection.attend_paged``) first gathers every sequence's keys into
``[B, H_kv, S, D]``: a full extra read and write of the KV per layer. Here the gather happens in
the loads. The design is ``native/tree_attention.py``'s flash-decoding split, with the sequence
as one more grid axis: programs over (sequence x K/V head, key split, row block) each run an
online softmax over their key tiles (the ``group`` query heads of one K/V head are ``group * T``
rows of one program), then a small kernel combines the splits and writes ``[B, T, H * D]``. A
program's loop stops at its sequence's last key tile, so the short sequences of a batch with
long ones cost little, and splits past it store nothing (the combine skips them). A pass's
ragged rows (``rows``, ``PassAttention.row_index``) are read and written where they lie.

Reference: the plain-torch branch of ``QKVProjection.attend_paged`` in ``splitspec/models/layers.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from native import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

BLOCK_S = 64  # keys per loop step (32 for head_dim 256, as tree_attention)
WAVES = 1  # programs per multiprocessor the key splits aim for (tree_attention's measured choice)
# Triton 3.6's CPU interpreter multiplies bfloat16 tiles wrongly in tl.dot: there the kernel
# computes in float32 (the GPU keeps the 16-bit tensor-core path).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running maximum: exp2(NEG - NEG) stays 1

    @triton.jit
    def _key_tile(
        tile, q, m, l, acc, k_base, v_base, table_row, vis_seq, token, rows_ok, d, low, start, keys,
        stride_ks, stride_vs, stride_mt, scale_log2,
        PAGE: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One step of the online softmax: key tile ``tile`` of a sequence, read through its block
        table ``table_row``; columns at or past ``keys`` are masked off (not loaded). Columns from
        ``low`` to ``start`` (the committed prefix) are visible to every row: their visibility is
        not read."""
        cols = tile * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] key columns
        cols_ok = cols < keys
        block = tl.load(table_row + cols // PAGE, mask=cols_ok, other=0)
        slot = block * PAGE + cols % PAGE  # [BLOCK_S] int64 pool slots
        k_t = tl.load(k_base + slot[None, :] * stride_ks + d[:, None], mask=cols_ok[None, :], other=0.0)  # [D, BLOCK_S]
        if IEEE:
            s = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        prefix = (cols >= low) & (cols < start)  # [BLOCK_S]
        # A tile of the prefix alone loads no visibility (its loads are all masked off).
        seen = tl.load(
            vis_seq + token[:, None] * stride_mt + cols[None, :], mask=rows_ok[:, None] & (cols_ok & ~prefix)[None, :], other=0
        )
        seen = (seen != 0) | (rows_ok[:, None] & prefix[None, :])
        s = tl.where(seen, s * scale_log2, float("-inf"))  # [BLOCK_R, BLOCK_S], log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=cols_ok[:, None], other=0.0)  # [BLOCK_S, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit
    def _paged_partial_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, start_ptr, low_ptr, vis_ptr, acc_ptr, stat_ptr, out_ptr, row_ptr, gate_ptr,
        T, S, stride_qb, stride_qh, stride_qt, stride_kh, stride_ks, stride_vh, stride_vs,
        stride_tb, stride_mb, stride_mt, stride_rb, stride_gr, stride_gh, scale_log2, total_rows, ragged_rows,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
        DIRECT: tl.constexpr, IEEE: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, RAGGED: tl.constexpr, LOW: tl.constexpr,
        GATED: tl.constexpr,
    ):
        seq = tl.program_id(0) // KV_HEADS
        kv_head = tl.program_id(0) % KV_HEADS
        split = tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] within this (sequence, K/V head)
        rows_ok = rows < GROUP * T
        token = rows % T
        head = kv_head * GROUP + rows // T  # query head
        d = tl.arange(0, D)
        seq64 = seq.to(tl.int64)
        if RAGGED:
            # q [H, N, D]: the padded place (seq, token) is ragged row row_ptr[seq, token]; N = a pad place.
            ragged = tl.load(row_ptr + seq64 * stride_rb + token, mask=rows_ok, other=ragged_rows).to(tl.int64)  # [BLOCK_R]
            live = rows_ok & (ragged < ragged_rows)
            q_at = head[:, None] * stride_qh + ragged[:, None] * stride_qt
        else:
            live = rows_ok
            q_at = seq64 * stride_qb + head[:, None] * stride_qh + token[:, None] * stride_qt
        q = tl.load(q_ptr + q_at + d[None, :], mask=live[:, None], other=0.0)  # [BLOCK_R, D]
        if IEEE:
            q = q.to(tl.float32)
        # Keys this sequence has: its committed prefix and its block's T rows (within the pass's S).
        start = tl.load(start_ptr + seq)
        low = 0
        if LOW:  # columns before it follow the visibility (a draft window)
            low = tl.load(low_ptr + seq)
        keys = tl.minimum(start + T, S)
        tiles = tl.cdiv(keys, BLOCK_S)
        first = split * BLOCKS_PER_SPLIT
        last = tl.minimum(first + BLOCKS_PER_SPLIT, tiles)
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        m = tl.full([BLOCK_R], NEG, tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        if DYNAMIC_LOOP:
            for tile in range(first, last):  # no iteration at all for a split past the sequence's keys
                m, l, acc = _key_tile(
                    tile, q, m, l, acc, k_base, v_base, table_ptr + seq64 * stride_tb, vis_ptr + seq64 * stride_mb,
                    token, rows_ok, d, low, start, keys, stride_ks, stride_vs, stride_mt, scale_log2, PAGE, BLOCK_S, IEEE,
                )
        else:
            # Triton 3.6's interpreter (with numpy 2) takes no tensor loop bounds: the same tiles,
            # a fixed count, those past the sequence's keys skipped by a branch.
            for i in range(BLOCKS_PER_SPLIT):
                if first + i < last:
                    m, l, acc = _key_tile(
                        first + i, q, m, l, acc, k_base, v_base, table_ptr + seq64 * stride_tb, vis_ptr + seq64 * stride_mb,
                        token, rows_ok, d, low, start, keys, stride_ks, stride_vs, stride_mt, scale_log2, PAGE, BLOCK_S, IEEE,
                    )
        # Global row (sequence, query head, token) = (seq * H + head) * T + token.
        head_row = (seq * KV_HEADS * GROUP + head) * T + token
        if DIRECT:
            l = tl.where(l > 0, l, 1.0)  # a row that saw nothing (a pad row) stays finite: zeros
            out_row = ragged if RAGGED else seq64 * T + token  # [BLOCK_R] row of out
            dst = out_ptr + out_row[:, None] * (KV_HEADS * GROUP * D) + head[:, None] * D + d[None, :]
            y = (acc / l[:, None]).to(out_ptr.dtype.element_ty)
            if GATED:
                gate_at = gate_ptr + out_row[:, None] * stride_gr + head[:, None] * stride_gh + d[None, :]
                y = _gated(y, tl.load(gate_at, mask=live[:, None], other=0.0))
            tl.store(dst, y, mask=live[:, None])
        else:
            used = rows_ok & (first < tiles)  # splits past the sequence's keys store nothing
            tl.store(acc_ptr + (split * total_rows + head_row.to(tl.int64))[:, None] * D + d[None, :], acc, mask=used[:, None])
            tl.store(stat_ptr + split * total_rows + head_row, m, mask=used)
            tl.store(stat_ptr + (tl.num_programs(1) + split) * total_rows + head_row, l, mask=used)

    @triton.jit
    def _gated(y, gate):
        """``y * sigmoid(gate)`` as torch computes it in y's dtype: the sigmoid rounded to it, then
        the product (Qwen3.5's gated attention output)."""
        g = gate.to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(y.dtype)
        return (y.to(tl.float32) * sig.to(tl.float32)).to(y.dtype)

    @triton.jit
    def _paged_combine_kernel(
        acc_ptr, stat_ptr, start_ptr, out_ptr, row_ptr, gate_ptr, T, S, heads, total_rows, splits, stride_rb, ragged_rows,
        stride_gr, stride_gh,
        D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, RAGGED: tl.constexpr,
        GATED: tl.constexpr,
    ):
        head_row = tl.program_id(0)  # (seq * H + head) * T + token
        token = head_row % T
        head = (head_row // T) % heads
        seq = head_row // (T * heads)
        keys = tl.minimum(tl.load(start_ptr + seq) + T, S)
        used = tl.cdiv(tl.cdiv(keys, BLOCK_S), BLOCKS_PER_SPLIT)  # splits that wrote anything
        s = tl.arange(0, SPLITS)
        ok = s < used
        m = tl.load(stat_ptr + s * total_rows + head_row, mask=ok, other=NEG)
        l = tl.load(stat_ptr + (splits + s) * total_rows + head_row, mask=ok, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # [SPLITS]
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (s.to(tl.int64) * total_rows + head_row)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        total = tl.sum(l * w, 0)
        total = tl.where(total > 0, total, 1.0)  # a row that saw nothing stays finite
        out = tl.sum(acc * w[:, None], 0) / total
        if RAGGED:
            out_row = tl.load(row_ptr + seq.to(tl.int64) * stride_rb + token).to(tl.int64)
        else:
            out_row = seq.to(tl.int64) * T + token
        dst = out_ptr + out_row * (heads * D) + head * D + d
        live = (d < D) & (out_row < ragged_rows)  # a pad place stores nothing
        y = out.to(out_ptr.dtype.element_ty)
        if GATED:
            y = _gated(y, tl.load(gate_ptr + out_row * stride_gr + head * stride_gh + d, mask=live, other=0.0))
        tl.store(dst, y, mask=live)


@dataclass(frozen=True)
class Plan:
    """How a launch divides the work: tile sizes, row blocks and key splits."""

    block_s: int  # keys per loop step
    block_r: int  # query rows per program
    row_blocks: int
    per_split: int  # key tiles per split
    splits: int
    num_warps: int = 4
    num_stages: int = 3  # Triton's software pipelining of the key loop


def plan(
    sequences: int, heads: int, kv_heads: int, block_rows: int, head_dim: int, keys: int, device: torch.device, *,
    block_s: int = 0, block_r: int = 0, waves: int = 0, num_warps: int = 4, num_stages: int = 0,
) -> Plan:
    """The launch shape for ``sequences`` x ``block_rows`` rows of ``heads`` heads over ``keys``
    columns; the keyword arguments (0: the default) are for ``scripts/gpu_paged_attention_tune.py``."""
    group = heads // kv_heads
    # Tiles for head_dim 128 (Qwen3); halved for 256 (Qwen3.5's full attention), whose 64-key
    # tiles would overflow an H200's shared memory. tl.dot wants 16 rows at least.
    wide = head_dim > 128
    block_s = block_s or (BLOCK_S // 2 if wide else BLOCK_S)
    block_r = block_r or max(16, min(32 if wide else 64, triton.next_power_of_2(group * block_rows)))
    row_blocks = triton.cdiv(group * block_rows, block_r)
    blocks = triton.cdiv(keys, block_s)
    # About WAVES waves of programs over the device; B * H_kv programs fill it alone at large B.
    wanted = max(1, min(blocks, ((waves or WAVES) * sm_count(device)) // (sequences * kv_heads * row_blocks)))
    per_split = triton.cdiv(blocks, wanted)
    stages = num_stages or (2 if wide else 3)
    return Plan(block_s, block_r, row_blocks, per_split, triton.cdiv(blocks, per_split), num_warps, stages)


def supported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor | None = None) -> bool:
    """Shapes the kernel takes: q [B, H, T, D] (or, with ``rows`` [B, T], the ragged [H, N, D]) with
    H a multiple of the pool's H_kv, a power-of-two head_dim, unit-stride rows, a bool visibility
    [B, T, S]."""
    d = q.shape[-1]
    places = (q.shape[0], q.shape[2]) if rows is None else tuple(rows.shape)
    return (
        triton is not None and q.dim() == (4 if rows is None else 3) and k_pool.dim() == 3 and v_pool.dim() == 3 and visible.dim() == 3
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k_pool.dtype == q.dtype == v_pool.dtype
        and k_pool.shape == v_pool.shape and k_pool.shape[-1] == d and q.shape[-3] % k_pool.shape[0] == 0
        and d >= 16 and d & (d - 1) == 0
        and q.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
        and visible.dtype == torch.bool and visible.stride(-1) == 1
        and tuple(visible.shape[:2]) == places
        and (rows is None or (rows.dim() == 2 and not rows.is_floating_point()))
    )


def paged_tree_attention(
    q: torch.Tensor,  # [B, H, T, D] each sequence's block rows, padded to T (views are fine); with rows: [H, N, D]
    k_pool: torch.Tensor,  # [H_kv, slots, D] one layer of the pool
    v_pool: torch.Tensor,
    tables: torch.Tensor,  # [B, S // block_size] int64 block tables (pad block past each sequence's blocks)
    starts: torch.Tensor,  # [B] int64 committed positions of each sequence
    visible: torch.Tensor,  # [B, T, S] bool, True = visible (PassAttention.visible)
    block_size: int,
    launch: Plan | None = None,  # plan()'s, unless given (benchmarks)
    rows: torch.Tensor | None = None,  # [B, T] ragged row of q at each padded place (N: none), PassAttention.row_index
    prefix_from: torch.Tensor | None = None,  # [B] int64 first prefix column every row sees (None: 0)
    gate: torch.Tensor | None = None,  # [rows of the output, H, D] (any row and head strides): the output times sigmoid(gate)
) -> torch.Tensor:
    """Each row's attention over its own sequence's paged keys -> [B, T, H * D] in q's dtype
    (head h's output at columns h * D ..; query head h reads K/V head h // (H / H_kv)). Only key
    columns below ``starts[b] + T`` are read, and of ``visible`` only those before
    ``prefix_from[b]`` and from ``starts[b]`` on: the committed prefix between is visible to every
    row (as ``PassInputs.attention`` builds it, from column 0; a draft window's from its first).

    With ``rows``, q holds a pass's N ragged rows and the result is ``[N, H * D]``: the kernel reads
    each padded place's query from its ragged row and writes its output there, so a pass of
    sequences with different row counts needs no padded copy of q and no reordering of the output
    (four launches a layer, 0.51 ms of a 16-sequence 8B verify pass at budget 22: BENCHMARKS.md [B8]).
    Rows no place names (a CUDA-graph bucket's pad rows) come out zeros. ``gate``: each output
    row times ``sigmoid`` of its gate row, in the output's dtype as torch rounds it (Qwen3.5's gated
    attention, three launches a layer otherwise); ``gate`` may be a strided view (of ``q_proj``'s
    packed output)."""
    if rows is None:
        b, h, t, d = q.shape
        out = q.new_empty(b, t, h * d)
        ragged_rows, stride_q, stride_r = b * t, (q.stride(0), q.stride(1), q.stride(2)), 0
    else:
        (h, ragged_rows, d), (b, t) = q.shape, rows.shape
        out = q.new_zeros(ragged_rows, h * d)  # rows no place names (a graph bucket's pad rows) stay zeros: finite
        stride_q = (0, q.stride(0), q.stride(1))
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        stride_r = rows.stride(0)
    kv_heads = k_pool.shape[0]
    span = visible.shape[-1]
    group = h // kv_heads
    tables, starts = tables.to(torch.int64), starts.to(torch.int64)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    starts = starts.contiguous()
    p = launch or plan(b, h, kv_heads, t, d, span, q.device)
    total_rows = b * h * t
    acc = stat = out  # unused when DIRECT
    row_ptr = out if rows is None else rows  # unused unless RAGGED
    if gate is not None and (gate.shape != (out.shape[0] if rows is not None else b * t, h, d) or gate.stride(-1) != 1):
        raise ValueError(f"paged_tree_attention: gate {tuple(gate.shape)} is not [rows, {h}, {d}] with contiguous heads")
    gate_args = (out, 0, 0) if gate is None else (gate, gate.stride(0), gate.stride(1))
    if p.splits > 1:
        acc = torch.empty(p.splits, total_rows, d, device=q.device, dtype=torch.float32)
        stat = torch.empty(2, p.splits, total_rows, device=q.device, dtype=torch.float32)
    _paged_partial_kernel[(b * kv_heads, p.splits, p.row_blocks)](
        q, k_pool, v_pool, tables, starts, starts if prefix_from is None else prefix_from.to(torch.int64).contiguous(), visible,
        acc, stat, out, row_ptr, gate_args[0],
        t, span, *stride_q, k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        tables.stride(0), visible.stride(0), visible.stride(1), stride_r, *gate_args[1:], math.log2(math.e) / math.sqrt(d),
        total_rows, ragged_rows,
        KV_HEADS=kv_heads, GROUP=group, D=d, PAGE=block_size, BLOCK_R=p.block_r, BLOCK_S=p.block_s,
        BLOCKS_PER_SPLIT=p.per_split, DIRECT=p.splits == 1, IEEE=q.dtype == torch.float32 or INTERPRETED, DYNAMIC_LOOP=not INTERPRETED,
        RAGGED=rows is not None, LOW=prefix_from is not None, GATED=gate is not None, num_warps=p.num_warps, num_stages=p.num_stages,
    )
    if p.splits > 1:
        _paged_combine_kernel[(total_rows,)](
            acc, stat, starts, out, row_ptr, gate_args[0], t, span, h, total_rows, p.splits, stride_r, ragged_rows, *gate_args[1:],
            D=d, SPLITS=triton.next_power_of_2(p.splits), BLOCK_S=p.block_s, BLOCKS_PER_SPLIT=p.per_split,
            RAGGED=rows is not None, GATED=gate is not None, num_warps=4,
        )
    return out
