"""The delta rule over a verify tree in chunked form: every row's output from matrix products over
the block, not a walk over its rows.

:func:`native.tree_delta_rule.tree_gated_delta` walks a sequence's rows one after another (each
row's state from its parent's), so a tree of ``T`` rows costs ``T`` dependent steps of a
``[Dk, Dv]`` state: latency, not bandwidth. A tree pass needs only the rows' outputs (the commit
recomputes the accepted path's state, :func:`splitspec.models.delta_rule.path_gated_delta`), and
those have the closed form of the chunked delta rule
(:func:`splitspec.models.delta_rule.gated_delta_chunked`) with the chain's causal mask replaced by
the tree's ancestor mask. For one sequence's rows (terms as in :mod:`splitspec.models.delta_rule`):

- ``R[i, j]``: row ``j`` is row ``i`` or one of its ancestors in the block (its path from the
  block's start). ``parents[t] < t``, so ``R`` is lower triangular.
- ``G[i] = sum_j R[i, j] g[j]``: the log-decay from the state before the block to row ``i``,
  ``D[i, j] = exp(G[i] - G[j])`` where ``R[i, j]`` (else 0).
- Unrolling ``S_i = exp(g_i) S_parent + k_i w_i^T`` along the path gives
  ``S_i = exp(G_i) S0 + sum_j D[i, j] k_j w_j^T``, and the corrections ``w`` solve the unit lower
  triangular system ``(I + L) W = beta (V - exp(G) K S0)``,
  ``L[i, j] = beta_i D[i, j] k_i.k_j`` for ``j`` a strict ancestor of ``i``.
- ``o_i = S_i^T q_i = exp(G_i) S0^T q_i + sum_j D[i, j] (q_i.k_j) w_j``.

``(I + L)^{-1}`` is built by doubling the blocks of a block-diagonal inverse,
``X_2b = X_b - X_b C_b X_b`` (``C_b``: ``L``'s entries between the two halves of each ``2b``
block), which is exact block inversion and stays as well conditioned as the rows' own recurrence
(a power series of ``L`` would cancel binomially large terms where keys repeat). ``R`` comes from
the parent matrix by squaring. All are ``tl.dot`` on ``[BT, BT]``, ``[BT, Dk]`` and
``[BT, BV]`` tiles, ``BT`` the rows a sequence may have rounded up to a power of two.

It equals the row walk up to float32 rounding where states are stored in float32 (the walk
rounds each row's state to the storage dtype; this form keeps none), so the dispatcher
(:func:`splitspec.models.delta_rule.tree_outputs`) would use it only then; it does so only with
``SPLITSPEC_NATIVE_ON=tree_chunk_delta``, since on an H100 its first configuration (``ieee``
products, ``Dv`` tiles of 64, 4 warps) ran 5x slower a layer than the walk in the 27B's verify
pass (BENCHMARKS.md [T11]). Its defaults since (q.k in ``tf32``, other products ``tf32x3``, ``Dv``
tiles of 64, 8 warps) were the fastest of five variants at one and 8 and 32 sequences of 23 rows,
1.12-1.28x the walk, each call timed as its share of a CUDA graph (0.70x at 64 rows), on bf16 q
and k; in the 27B's graphed verify pass, whose q and k are float32 (q.k then in tf32x3), it took
391 µs a layer against the walk's 31 ([T12]). Its outputs also differ from the walk's (which a
decode step runs) in the last bits, so a tree pass's logits would not equal a decode step's.
One program per (value head, ``Dv`` tile,
sequence); the sequences' states are read in place from a table through their slots. Nothing is
read on the host: a pass calling it can be captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native.tree_delta_rule import _on_device_of, _packed_block

__all__ = ["MAX_ROWS", "tree_chunk_delta"]

MAX_ROWS = 64  # the most rows a sequence may have here: BT x BT tiles above that outgrow the registers
KERNEL_NAME = "tree_chunk_delta"  # for SPLITSPEC_NATIVE_ON (off by default) and SPLITSPEC_NATIVE_OFF


@triton.jit
def _tree_chunk_kernel(
    q,  # [T, H / GROUP, DK] normalised and scaled: value head h reads key head h // GROUP
    k,  # [T, H / GROUP, DK] normalised
    v,  # [T, H, DV]
    g,  # [T, H] log-decay
    beta,  # [T, H]
    initial,  # [S, H, DK, DV] the states before the block (with INDEXED: a table of them)
    state_index,  # [S] int64 row of initial each sequence starts from (read only when INDEXED)
    parents,  # [T] int64, -(s + 1) = sequence s's state
    offsets,  # [S + 1] int64 row offsets of the sequences (read only when RAGGED)
    out,  # [T, H, DV] float32
    q_row,  # elements between rows of q, k and v (heads and dims are packed within a row)
    k_row,
    v_row,
    T,
    H,
    GROUP,  # value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,  # a power of two >= the rows of any sequence
    LOG_BT: tl.constexpr,
    RAGGED: tl.constexpr,
    INDEXED: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision for the products of float32 values
    KEY_PRECISION: tl.constexpr,  # and for q.k products
):
    head = tl.program_id(0)
    key_head = head // GROUP
    cols = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] value dims of this tile
    sequence = tl.program_id(2)
    keys = tl.arange(0, BK)  # [BK]
    col_ok, key_ok = cols < DV, keys < DK
    if RAGGED:
        start = tl.load(offsets + sequence)
        end = tl.load(offsets + sequence + 1)
        if INDEXED:
            row_of_state = tl.load(state_index + sequence).to(tl.int64)
        else:
            row_of_state = sequence.to(tl.int64)
    else:
        start = 0
        end = T
        row_of_state = 0
    before = initial + row_of_state * H * DK * DV + head * DK * DV  # this head's state before the block
    local = tl.arange(0, BT)  # [BT]
    rows = start + local  # [BT]
    live = rows < end
    Q = tl.load(q + rows[:, None] * q_row + key_head * DK + keys[None, :], mask=live[:, None] & key_ok[None, :], other=0.0)  # [BT, BK]
    K = tl.load(k + rows[:, None] * k_row + key_head * DK + keys[None, :], mask=live[:, None] & key_ok[None, :], other=0.0)  # [BT, BK]
    V = tl.load(v + rows[:, None] * v_row + head * DV + cols[None, :], mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BT, BV]
    gl = tl.load(g + rows * H + head, mask=live, other=0.0).to(tl.float32)  # [BT]
    bl = tl.load(beta + rows * H + head, mask=live, other=0.0).to(tl.float32)  # [BT]
    par = tl.load(parents + rows, mask=live, other=-1)  # [BT]
    up = tl.where(par >= 0, par - start, -1)  # [BT] the parent's local row, -1: the state before the block
    s0 = tl.load(before + keys[:, None] * DV + cols[None, :], mask=key_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BK, BV]

    eye = local[:, None] == local[None, :]  # [BT, BT]
    # Ancestor-or-self by squaring I + P (P[i, j]: j is i's parent): 2^LOG_BT >= BT - 1 steps up.
    # Its entries are small integers, exact in any dot precision.
    reach = tl.where(eye | (up[:, None] == local[None, :]), 1.0, 0.0)  # [BT, BT]
    for _ in tl.static_range(LOG_BT):
        reach = tl.where(tl.dot(reach, reach, input_precision="tf32") > 0.5, 1.0, 0.0)
    ancestor = reach > 0.5  # [BT, BT]
    G = tl.sum(reach * gl[None, :], axis=1)  # [BT] log-decay from the state before the block, row included
    decay = tl.where(ancestor, tl.exp(tl.where(ancestor, G[:, None] - G[None, :], 0.0)), 0.0)  # [BT, BT] D
    # q.k products in KEY_PRECISION: tf32 where q and k are bfloat16, whose 8-bit significands
    # tf32's 11 hold exactly (the products are then exact, the sums float32).
    Q, K = Q.to(tl.float32), K.to(tl.float32)
    kk = tl.dot(K, tl.trans(K), input_precision=KEY_PRECISION)  # [BT, BT]
    qk = tl.dot(Q, tl.trans(K), input_precision=KEY_PRECISION)  # [BT, BT]
    ks = tl.dot(K, s0, input_precision=PRECISION)  # [BT, BV]
    qs = tl.dot(Q, s0, input_precision=PRECISION)  # [BT, BV]
    lower = tl.where(ancestor & ~eye, bl[:, None] * kk * decay, 0.0)  # [BT, BT] L
    grown = tl.exp(G)  # [BT]
    rhs = bl[:, None] * (V - grown[:, None] * ks)  # [BT, BV]
    # (I + L)^{-1} by doubling blocks: X_1 = I (I + L's 1 x 1 diagonal blocks are 1).
    inverse = tl.where(eye, 1.0, 0.0)  # [BT, BT]
    for level in tl.static_range(LOG_BT):
        half = 1 << level
        between = ((local[:, None] // (2 * half)) == (local[None, :] // (2 * half))) & ((local[:, None] // half) != (local[None, :] // half))
        c = tl.where(between, lower, 0.0)
        inverse = inverse - tl.dot(inverse, tl.dot(c, inverse, input_precision=PRECISION), input_precision=PRECISION)
    w = tl.dot(inverse, rhs, input_precision=PRECISION)  # [BT, BV] the corrections
    o = grown[:, None] * qs + tl.dot(qk * decay, w, input_precision=PRECISION)
    tl.store(out + (rows[:, None] * H + head) * DV + cols[None, :], o, mask=live[:, None] & col_ok[None, :])


def tree_chunk_delta(
    q: torch.Tensor,  # [T, H / G, Dk] normalised and scaled: value head h reads key head h // G
    k: torch.Tensor,  # [T, H / G, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, Dk, Dv] (or [H, Dk, Dv] for S = 1) the states before the block; a table with state_index
    parents: torch.Tensor,  # [T], parents[t] < t, -(s + 1) = sequence s's state
    max_rows: int,
    offsets: torch.Tensor | None = None,  # [S + 1] row offsets of the sequences
    *,
    state_index: torch.Tensor | None = None,  # [S] int64: sequence s starts from state[state_index[s]]
    block_v: int | None = None,
    num_warps: int | None = None,
    precision: str = "tf32x3",
) -> torch.Tensor:
    """The outputs ``[T, H, Dv]`` (float32) of :func:`native.tree_delta_rule.tree_gated_delta` on
    the same arguments, from the chunked form (module docstring); no states. ``max_rows`` (at most
    :data:`MAX_ROWS`): the most rows any sequence has, which the caller knows from the pass's
    shape; more rows in a sequence would be left uncomputed. A row past ``offsets[S]`` (padding)
    gets output 0. ``precision``: ``tl.dot``'s input precision for float32 products."""
    if not 1 <= max_rows <= MAX_ROWS:
        raise ValueError(f"tree_chunk_delta: max_rows {max_rows} is outside 1..{MAX_ROWS}")
    num_rows, key_heads, dk = k.shape
    heads, dv = v.shape[1], v.shape[-1]
    if heads % key_heads:
        raise ValueError(f"tree_chunk_delta: {heads} value heads are not a multiple of {key_heads} key heads")
    num_seqs = state_index.shape[0] if state_index is not None else (state.shape[0] if state.dim() == 4 else 1)
    out = (torch.zeros if offsets is not None else torch.empty)(num_rows, heads, dv, dtype=torch.float32, device=v.device)
    if num_rows == 0:
        return out
    q, k, v, g, beta, parents, offsets = _packed_block(q, k, v, g, beta, parents, offsets, num_seqs, state_index)
    initial = state.contiguous()
    block_t = max(16, triton.next_power_of_2(max_rows))
    block_v = max(16, min(block_v or 64, triton.next_power_of_2(dv)))
    unread = parents  # a pointer for the arguments a variant does not read
    with _on_device_of(v):
        _tree_chunk_kernel[(heads, triton.cdiv(dv, block_v), num_seqs)](
            q, k, v, g, beta, initial,
            unread if state_index is None else state_index.long().contiguous(),
            parents,
            unread if offsets is None else offsets.long().contiguous(),
            out, q.stride(0), k.stride(0), v.stride(0), num_rows, heads, heads // key_heads,
            DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=block_v, BT=block_t,
            LOG_BT=block_t.bit_length() - 1, RAGGED=offsets is not None, INDEXED=state_index is not None,
            PRECISION=precision, KEY_PRECISION="tf32" if q.dtype == k.dtype == torch.bfloat16 else precision,
            num_warps=num_warps or 8,
        )
    return out
