"""Triton kernels for the tree-aware Gated DeltaNet: the conv over each row's ancestors, and the
delta rule with every row starting from its parent's state (spec 3.3), over the rows of one
sequence or of several concatenated (batched verify).

They compute what :func:`splitspec.models.delta_rule.conv_silu_reference` and
:func:`splitspec.models.delta_rule.gated_delta_tree` compute, with the same terms (block, parents,
history, ancestor table, recurrent state); those torch functions are the references. The torch
path is launch-bound: a few small ops per depth level per layer. Here each is one launch.

- :func:`tree_conv_silu`: one program per (row, channel block) sums the ``K`` taps of the row's
  window, read through the ancestor table straight from the histories and the block's inputs (no
  ``[T, K, C]`` gather), and applies SiLU.
- :func:`tree_gated_delta`: one program per (value head, ``Dv`` tile, sequence) holds the
  ``[Dk, BV]`` state tile in registers and walks its sequence's rows in order (parents come
  first); the sequences of a batch run side by side, not one after another. A row whose parent is
  the previous row continues in registers; any other row reloads its parent's stored state (or its
  sequence's state before the block), prefetched with its inputs while the previous row computes.
  Every row's state is stored by default (a per-sequence cache's commit adopts the deepest accepted
  row's). A one-sequence call walks rows ``0 .. T - 1`` without reading any offsets.
  The state is rounded to the storage dtype after every row, as the torch path does by reading its
  parent's *stored* state, so both give the same stored bits up to float32 rounding. Two options
  serve a fixed-shape (CUDA graph) pass: the sequences' states read in place from a table through
  their slot indices (no per-layer gather of ``[S, H, Dk, Dv]``), and a ``keep`` mask of the rows
  to store: where the block alone reads the states, only the rows a later row reloads.
- :func:`path_gated_delta`: one program per (layer and value head, ``Dv`` tile, sequence) advances
  a committed state along the sequence's accepted path, in place (the commit by recomputation of
  :mod:`splitspec.models.delta_rule`).

Import this module only where Triton can run (CUDA, or ``TRITON_INTERPRET=1`` set before the
import); :mod:`splitspec.models.delta_rule` decides when and imports it lazily.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["path_gated_delta", "tree_conv_silu", "tree_gated_delta"]


def _on_device_of(x: torch.Tensor):
    """Triton launches on the *current* CUDA device, whatever device the tensors are on."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 ``x`` in ``dtype``, rounded to nearest even as torch's ``.to`` does. bfloat16 is rounded
    by hand: on GPUs Triton's cast gives the same bits, but its CPU interpreter truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _conv_silu_kernel(
    history,  # [S, K-1, C] (with INDEXED: a table of histories)
    history_index,  # [S] int64 row of history each sequence reads (read only when INDEXED)
    inputs,  # [T, C] rows in_row elements apart
    ancestors,  # [T, K] int64
    weight,  # [C, K]
    out,  # [T, C]
    kept_inputs,  # [T, C] a copy of inputs (written only with KEEP)
    kept_values,  # [T, C - V_START] a copy of out's channels V_START.. (written only with KEEP)
    C,
    in_row,
    V_START,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BATCHED: tl.constexpr,  # histories of several sequences: virtual rows need the sequence decoded
    INDEXED: tl.constexpr,  # sequence s reads history[history_index[s]]
    KEEP: tl.constexpr,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = channels < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(K):
        a = tl.load(ancestors + row * K + tap)  # a row of the block, or virtual row -(s(K-1) + i) of sequence s
        in_block = a >= 0
        # history[s, K-1-i] in the flattened history; one sequence's -i is simply K-1-i, without the
        # divide on every tap's load chain (int32: a divide by the constant K - 1 is a multiply).
        if BATCHED:
            back = tl.maximum(-a - 1, 0).to(tl.int32)  # s(K-1) + i - 1
            sequence = back // (K - 1)
            within = K - 2 - back % (K - 1)
        else:
            sequence = 0
            within = tl.maximum(a + K - 1, 0)
        if INDEXED:
            past = tl.load(history_index + sequence) * (K - 1) + within
        else:
            past = sequence * (K - 1) + within
        # Both indices clamped in range; the masks pick the one that applies.
        x_block = tl.load(inputs + tl.maximum(a, 0) * in_row + channels, mask=valid & in_block, other=0.0)
        x_history = tl.load(history + past * C + channels, mask=valid & (a < 0), other=0.0)
        w = tl.load(weight + channels * K + tap, mask=valid, other=0.0)
        acc += (x_block.to(tl.float32) + x_history.to(tl.float32)) * w.to(tl.float32)
    y = _rounded(acc * tl.sigmoid(acc), out.dtype.element_ty)
    tl.store(out + row * C + channels, y, mask=valid)
    if KEEP:  # the row's own input is tap K - 1's load; read again here, from L1
        tl.store(kept_inputs + row * C + channels, tl.load(inputs + row * in_row + channels, mask=valid), mask=valid)
        tl.store(kept_values + row * (C - V_START) + channels - V_START, y, mask=valid & (channels >= V_START))


def tree_conv_silu(
    history: torch.Tensor,  # [S, K-1, C] (or [K-1, C] for S = 1) conv inputs before the block
    inputs: torch.Tensor,  # [T, C]
    ancestors: torch.Tensor,  # [T, K] int64, see delta_rule.ancestor_table
    weight: torch.Tensor,  # [C, K], oldest tap first
    block_c: int = 512,
    *,
    keep: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, C], [T, V]) contiguous, inputs.dtype
    history_index: torch.Tensor | None = None,  # [S] int64: sequence s reads history[history_index[s]] (history: a table)
) -> torch.Tensor:
    """``SiLU(sum_k window[t, k] * weight[:, k])`` for every row ``t``: ``[T, C]`` in ``inputs.dtype``,
    accumulated in float32 (the torch reference rounds each product to ``inputs.dtype`` first).
    ``inputs`` may have its rows apart (a slice of a fused projection's output). ``keep``: the
    same launch also writes a copy of ``inputs`` and of the output's last ``V`` channels there
    (what a tree pass keeps of the rows, ``TreeRows``), saving a tree pass two copies a layer.
    ``history_index``: the histories are read in place from a table (a layer's state slots),
    which saves gathering them first (a launch a layer)."""
    num_rows, channels = inputs.shape
    width = weight.shape[1]
    if (
        history.dim() not in (2, 3) or history.shape[-2:] != (width - 1, channels)
        or ancestors.shape != (num_rows, width) or weight.shape[0] != channels
        or (history_index is not None and (history.dim() != 3 or history_index.dim() != 1))
    ):
        raise ValueError(
            f"tree_conv_silu: history {tuple(history.shape)}, inputs {tuple(inputs.shape)}, ancestors "
            f"{tuple(ancestors.shape)}, weight {tuple(weight.shape)} and history_index "
            f"{None if history_index is None else tuple(history_index.shape)} disagree"
        )
    if keep is not None and (
        keep[0].shape != inputs.shape or keep[1].shape[0] != num_rows or not 0 < keep[1].shape[1] <= channels
        or any(x.dtype != inputs.dtype or not x.is_contiguous() for x in keep)
    ):
        raise ValueError(f"tree_conv_silu: keep {[tuple(x.shape) for x in keep]} does not fit inputs {tuple(inputs.shape)}")
    out = torch.empty(num_rows, channels, dtype=inputs.dtype, device=inputs.device)
    if num_rows == 0:
        return out
    if inputs.stride(-1) != 1:
        inputs = inputs.contiguous()
    history, ancestors, weight = (x.contiguous() for x in (history.to(inputs.dtype), ancestors.long(), weight))
    block_c = min(block_c, triton.next_power_of_2(channels))
    kept_inputs, kept_values = keep if keep is not None else (out, out)  # pointers the kernel does not write without KEEP
    sequences = history.shape[0] if history_index is None else history_index.shape[0]
    with _on_device_of(inputs):
        _conv_silu_kernel[(num_rows, triton.cdiv(channels, block_c))](
            history, ancestors if history_index is None else history_index.long().contiguous(), inputs, ancestors, weight, out,
            kept_inputs, kept_values, channels, inputs.stride(0),
            channels - kept_values.shape[1] if keep is not None else channels, K=width, BLOCK_C=block_c,
            BATCHED=history.dim() == 3 and sequences > 1, INDEXED=history_index is not None, KEEP=keep is not None,
        )
    return out


@triton.jit
def _tree_delta_kernel(
    q,  # [T, H / GROUP, DK] normalised and scaled: value head h reads key head h // GROUP
    k,  # [T, H / GROUP, DK] normalised
    v,  # [T, H, DV]
    g,  # [T, H] log-decay
    beta,  # [T, H]
    initial,  # [S, H, DK, DV] the states before the block, storage dtype (with INDEXED: a table of them)
    state_index,  # [S] int64 row of initial each sequence starts from (read only when INDEXED)
    parents,  # [T] int64, -(s + 1) = sequence s's state
    offsets,  # [S + 1] int64 row offsets of the sequences (read only when RAGGED)
    keep,  # [T] int8 rows whose state is stored (read only unless KEEP_ALL)
    out,  # [T, H, DV] float32
    states,  # [T, H, DK, DV] storage dtype
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
    RAGGED: tl.constexpr,  # several sequences: this program walks rows offsets[s] .. offsets[s + 1] - 1
    INDEXED: tl.constexpr,  # sequence s starts from initial[state_index[s]]
    KEEP_ALL: tl.constexpr,  # store every row's state (else only where keep is set)
):
    head = tl.program_id(0)
    key_head = head // GROUP
    cols = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] value dims of this tile
    sequence = tl.program_id(2)
    keys = tl.arange(0, BK)  # [BK]
    col_ok, key_ok = cols < DV, keys < DK
    tile_ok = key_ok[:, None] & col_ok[None, :]
    tile = head * DK * DV + keys[:, None] * DV + cols[None, :]  # [BK, BV] offsets of this tile in one state
    state_size = H * DK * DV
    if RAGGED:
        t = tl.load(offsets + sequence).to(tl.int32)
        end = tl.load(offsets + sequence + 1).to(tl.int32)
        if INDEXED:
            row_of_state = tl.load(state_index + sequence).to(tl.int64)
        else:
            row_of_state = sequence.to(tl.int64)
        before = initial + row_of_state * state_size  # this sequence's state before the block
        # A sequence of no rows (t = end, maybe T) runs no row: its first row's loads below need
        # only stay in range, and so go unmasked, as on the one-sequence path.
        first = tl.minimum(t, T - 1)
    else:
        t = 0
        end = T
        before = initial
        first = 0
    # Row t's inputs and starting state are loaded during row t - 1 (the first row's before the
    # loop), so their latency hides behind a row of arithmetic. A starting state other than the
    # previous row's is the state before the block or an earlier row's, stored by then.
    s = tl.load(before + tile, mask=tile_ok, other=0.0).to(tl.float32)  # the first row's parent is -(s + 1)
    qt = tl.load(q + first * q_row + key_head * DK + keys, mask=key_ok, other=0.0).to(tl.float32)  # [BK]
    kt = tl.load(k + first * k_row + key_head * DK + keys, mask=key_ok, other=0.0).to(tl.float32)  # [BK]
    vt = tl.load(v + first * v_row + head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BV]
    gt = tl.load(g + first * H + head).to(tl.float32)
    bt = tl.load(beta + first * H + head).to(tl.float32)
    while t < end:  # not `for t in range(...)`: the interpreter cannot index with a runtime bound under numpy >= 2.4
        # Prefetch row t + 1 (masked off past the sequence's end).
        nt = t + 1
        more = nt < end
        nth = nt * H + head  # T * H stays far below 2**31; T * state_size need not
        pn = tl.load(parents + nt, mask=more, other=t)
        reload = more & (pn != t)  # row t + 1 does not continue row t
        tl.debug_barrier()  # rows stored by earlier iterations are visible to every thread
        from_before = tl.load(before + tile, mask=tile_ok & reload & (pn < 0), other=0.0)
        from_row = tl.load(states + tl.maximum(pn, 0) * state_size + tile, mask=tile_ok & reload & (pn >= 0), other=0.0)
        qn = tl.load(q + nt * q_row + key_head * DK + keys, mask=key_ok & more, other=0.0)
        kn = tl.load(k + nt * k_row + key_head * DK + keys, mask=key_ok & more, other=0.0)
        vn = tl.load(v + nt * v_row + head * DV + cols, mask=col_ok & more, other=0.0)
        gn = tl.load(g + nth, mask=more, other=0.0)
        bn = tl.load(beta + nth, mask=more, other=0.0)
        # Row t.
        th = t * H + head
        s = s * tl.exp(gt)
        predicted = tl.sum(s * kt[:, None], axis=0)  # [BV]  S^T k
        s = s + kt[:, None] * ((vt - predicted) * bt)[None, :]
        tl.store(out + th * DV + cols, tl.sum(s * qt[:, None], axis=0), mask=col_ok)
        stored = _rounded(s, states.dtype.element_ty)
        if KEEP_ALL:
            tl.store(states + t.to(tl.int64) * state_size + tile, stored, mask=tile_ok)
        else:
            kept = tl.load(keep + t) != 0
            tl.store(states + t.to(tl.int64) * state_size + tile, stored, mask=tile_ok & kept)
        # Children read the stored (rounded) state, as in the torch path.
        s = tl.where(reload, from_before.to(tl.float32) + from_row.to(tl.float32), stored.to(tl.float32))
        qt, kt, vt = qn.to(tl.float32), kn.to(tl.float32), vn.to(tl.float32)
        gt, bt = gn.to(tl.float32), bn.to(tl.float32)
        t = nt
    if RAGGED:
        # Rows of no sequence (padding, past offsets[S]) feed the rest of the pass: the last
        # sequence's programs write them zeros (the output is not cleared beforehand, a launch saved).
        if sequence == tl.num_programs(2) - 1:
            while end < T:
                tl.store(out + (end * H + head) * DV + cols, tl.zeros([BV], dtype=tl.float32), mask=col_ok)
                end += 1


def _sequence_offsets(parents: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``[S + 1]`` row offsets of the sequences of a block, from its ``parents`` alone, on the device
    (no host sync). Sequences are concatenated in order and each one's first row starts from its
    state (parent ``-(s + 1)``), so sequence ``s`` starts at the first row that starts a sequence
    ``>= s`` (``T`` if none: ``offsets[S]``, and any sequence of no rows at the end)."""
    rows = torch.arange(parents.shape[0], device=parents.device)
    starts = torch.where(parents < 0, -parents - 1, -1)  # [T] the sequence a row starts, -1 = none
    sequences = torch.arange(num_seqs + 1, device=parents.device)
    # An [S + 1, T] compare and a min: a few small launches, unlike a scan over the rows.
    return torch.where(starts >= sequences[:, None], rows, parents.shape[0]).amin(1)


def _packed_block(q, k, v, g, beta, parents, offsets, num_seqs: int, state_index):
    """A block's delta-rule inputs as the tree kernels read them: q, k, v may stay views with rows
    apart (v is a slice of the conv output; only heads and dims need to be packed), the rest
    contiguous, and the sequences' ``offsets`` derived from ``parents`` where several sequences
    (or a state table) need them and the caller gave none."""
    q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
    g, beta, parents = (x.contiguous() for x in (g, beta, parents.long()))
    if offsets is None and (num_seqs > 1 or state_index is not None):
        offsets = _sequence_offsets(parents, num_seqs)
    return q, k, v, g, beta, parents, offsets


def tree_gated_delta(
    q: torch.Tensor,  # [T, H / G, Dk] normalised and scaled: value head h reads key head h // G
    k: torch.Tensor,  # [T, H / G, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, Dk, Dv] (or [H, Dk, Dv] for S = 1) the states before the block; a table with state_index
    parents: torch.Tensor,  # [T], parents[t] < t, -(s + 1) = sequence s's state
    store_dtype: torch.dtype,
    offsets: torch.Tensor | None = None,  # [S + 1] row offsets of the sequences
    block_v: int | None = None,
    num_warps: int | None = None,
    *,
    state_index: torch.Tensor | None = None,  # [S] int64: sequence s starts from state[state_index[s]]
    keep: torch.Tensor | None = None,  # [T] bool: store only these rows' states
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`splitspec.models.delta_rule.gated_delta_tree` as one launch: outputs ``[T, H, Dv]``
    (float32) and the state after every row ``[T, H, Dk, Dv]`` (``store_dtype``).

    With ``S > 1`` sequences each walks its own rows; ``offsets`` (which the caller that built the
    batch knows, once for all layers) save deriving them from ``parents`` in a few small launches.
    A sequence may have no rows; a row of no sequence (past ``offsets[S]``: padding) is not
    computed, its output is 0. ``state_index``: ``state`` is a table of states (a layer's state
    slots) read in place, and the sequences are ``state_index``'s. ``keep``: rows outside it
    have undefined states (the caller reads none of them). ``block_v`` and ``num_warps`` (the
    ``[Dk, block_v]`` state tile of a program and its warps) default to what was fastest on an
    H200 at the Qwen3.5-27B geometry with trees of 23 rows: 16 and 4 for one sequence; for 8 to 32
    sequences 32, with 4 warps for float32 states (S = 32: 875 us against 958 for 16 and 4) and 2
    for bfloat16 ones (674 us against 1056).

    Nothing here reads a tensor's values on the host: a pass calling it can be captured."""
    num_rows, key_heads, dk = k.shape
    heads, dv = v.shape[1], v.shape[-1]
    if heads % key_heads:
        raise ValueError(f"tree_gated_delta: {heads} value heads are not a multiple of {key_heads} key heads")
    if state_index is not None:
        num_seqs = state_index.shape[0]
        expected_state = (state.shape[0], heads, dk, dv)
    else:
        num_seqs = state.shape[0] if state.dim() == 4 else 1
        expected_state = (num_seqs, heads, dk, dv) if state.dim() == 4 else (heads, dk, dv)
    expected = {"q": (num_rows, key_heads, dk), "v": (num_rows, heads, dv), "g": (num_rows, heads), "beta": (num_rows, heads),
                "state": expected_state, "parents": (num_rows,), "offsets": (num_seqs + 1,), "keep": (num_rows,)}
    given = {"q": q, "v": v, "g": g, "beta": beta, "state": state, "parents": parents}
    if offsets is not None:
        given["offsets"] = offsets
    if keep is not None:
        given["keep"] = keep
    for name, tensor in given.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"tree_gated_delta: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
    out = torch.empty(num_rows, heads, dv, dtype=torch.float32, device=v.device)  # padding rows: the kernel's zeros
    states = torch.empty(num_rows, heads, dk, dv, dtype=store_dtype, device=v.device)
    if num_rows == 0:
        return out, states
    q, k, v, g, beta, parents, offsets = _packed_block(q, k, v, g, beta, parents, offsets, num_seqs, state_index)
    initial = state.to(store_dtype).contiguous()
    ragged = offsets is not None
    if num_seqs == 1:
        block_v, num_warps = block_v or 16, num_warps or 4
    else:
        block_v, num_warps = block_v or 32, num_warps or (4 if initial.element_size() >= 4 else 2)
    block_v = min(block_v, triton.next_power_of_2(dv))
    unread = parents  # a pointer for the arguments a variant does not read
    with _on_device_of(v):
        _tree_delta_kernel[(heads, triton.cdiv(dv, block_v), num_seqs)](
            q, k, v, g, beta, initial,
            unread if state_index is None else state_index.long().contiguous(),
            parents,
            offsets.long().contiguous() if ragged else unread,
            unread if keep is None else keep.to(torch.int8).contiguous(),
            out, states, q.stride(0), k.stride(0), v.stride(0), num_rows, heads, heads // key_heads,
            DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, RAGGED=ragged,
            INDEXED=state_index is not None, KEEP_ALL=keep is None, num_warps=num_warps,
        )
    return out, states


@triton.jit
def _path_delta_kernel(
    states,  # [L, slots, H, DK, DV] storage dtype, advanced in place
    slots,  # [B] int64 (strided: slot_stride)
    paths,  # [B, P] int64 rows of each path, root first (rows strided: path_row)
    lengths,  # [B] int64 (strided: length_stride)
    keys,  # [L, *, HK, DK] (rows strided)
    values,  # [L, *, H, DV]
    decays,  # [L, *, H]
    betas,  # [L, *, H]
    state_layer,  # elements between layers of states
    k_layer,  # elements between layers and between rows of keys, values, decays, betas
    k_row,
    v_layer,
    v_row,
    g_layer,
    g_row,
    b_layer,
    b_row,
    slot_stride,
    path_row,
    length_stride,
    H,
    GROUP,  # value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    layer_head = tl.program_id(0)
    layer = (layer_head // H).to(tl.int64)
    head = layer_head % H
    key_head = head // GROUP
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    sequence = tl.program_id(2)
    keys_at = tl.arange(0, BK)
    col_ok, key_ok = cols < DV, keys_at < DK
    tile_ok = key_ok[:, None] & col_ok[None, :]
    slot = tl.load(slots + sequence * slot_stride)
    count = tl.load(lengths + sequence * length_stride).to(tl.int32)
    state = states + layer * state_layer + (slot * H + head) * DK * DV  # this slot's head, in place
    tile = keys_at[:, None] * DV + cols[None, :]
    s = tl.load(state + tile, mask=tile_ok, other=0.0).to(tl.float32)
    j = 0
    while j < count:
        row = tl.load(paths + sequence * path_row + j)
        kt = tl.load(keys + layer * k_layer + row * k_row + key_head * DK + keys_at, mask=key_ok, other=0.0).to(tl.float32)
        vt = tl.load(values + layer * v_layer + row * v_row + head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)
        gt = tl.load(decays + layer * g_layer + row * g_row + head).to(tl.float32)
        bt = tl.load(betas + layer * b_layer + row * b_row + head).to(tl.float32)
        # The tree kernel's row update, and its rounding: a row reads its parent's stored state.
        s = s * tl.exp(gt)
        predicted = tl.sum(s * kt[:, None], axis=0)
        s = s + kt[:, None] * ((vt - predicted) * bt)[None, :]
        s = _rounded(s, states.dtype.element_ty).to(tl.float32)
        j += 1
    tl.store(state + tile, _rounded(s, states.dtype.element_ty), mask=tile_ok)


def path_gated_delta(
    states: torch.Tensor,  # [L, slots, H, Dk, Dv] storage dtype, advanced in place
    slots: torch.Tensor,  # [B] int64 distinct
    paths: torch.Tensor,  # [B, P] int64 rows, root first
    lengths: torch.Tensor,  # [B] int64, 1 .. P
    keys: torch.Tensor,  # [L, T, Hk, Dk]
    values: torch.Tensor,  # [L, T, H, Dv]
    decays: torch.Tensor,  # [L, T, H]
    betas: torch.Tensor,  # [L, T, H]
    block_v: int = 32,
    num_warps: int = 4,
) -> None:
    """:func:`splitspec.models.delta_rule.path_gated_delta_reference` as one launch over every
    layer, head and sequence: each program loads its ``[Dk, block_v]`` tile of a slot's state,
    walks the path's rows in registers and stores the tile back in place. ``slots``, ``paths`` and
    ``lengths`` are read where they are (views of one table of the commit's indices: no copies)."""
    layers, _, heads, dk, dv = states.shape
    num_seqs = paths.shape[0]
    if (
        not states.is_contiguous() or slots.shape != (num_seqs,) or lengths.shape != (num_seqs,)
        or keys.shape[0] != layers or keys.shape[-1] != dk or heads % keys.shape[2]
        or values.shape[0] != layers or values.shape[2:] != (heads, dv)
        or decays.shape[0] != layers or decays.shape[2:] != (heads,) or betas.shape != decays.shape
        or any(x.dtype != torch.int64 for x in (slots, paths, lengths)) or paths.stride(1) != 1
    ):
        raise ValueError(
            f"path_gated_delta: states {tuple(states.shape)}, slots {tuple(slots.shape)}, paths {tuple(paths.shape)}, "
            f"lengths {tuple(lengths.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
            f"decays {tuple(decays.shape)} and betas {tuple(betas.shape)} disagree (or the indices are not int64 rows)"
        )
    if num_seqs == 0:
        return
    # Rows may be strided (views of a larger buffer); within a row, heads and dims must be packed.
    keys, values, decays, betas = (x if x.stride(-1) == 1 and (x.dim() < 4 or x.stride(-2) == x.shape[-1]) else x.contiguous() for x in (keys, values, decays, betas))
    block_v = min(block_v, triton.next_power_of_2(dv))
    with _on_device_of(states):
        _path_delta_kernel[(layers * heads, triton.cdiv(dv, block_v), num_seqs)](
            states, slots, paths, lengths, keys, values, decays, betas,
            states.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), decays.stride(0), decays.stride(1),
            betas.stride(0), betas.stride(1), slots.stride(0), paths.stride(0), lengths.stride(0), heads, heads // keys.shape[2],
            DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, num_warps=num_warps,
        )


@triton.jit
def _conv_commit_kernel(
    conv,  # [L, slots, KM1, C] compute dtype, rewritten in place
    inputs,  # [L, *, C] the tree pass's conv inputs (rows strided)
    slots,  # [B] int64 (strided: slot_stride)
    windows,  # [B, KM1] int64 (rows strided: window_row)
    conv_layer,
    in_layer,
    in_row,
    slot_stride,
    window_row,
    C,
    KM1: tl.constexpr,
    KP: tl.constexpr,  # KM1 rounded up to a power of two
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    sequence = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    entries = tl.arange(0, KP)
    col_ok, entry_ok = cols < C, entries < KM1
    slot = tl.load(slots + sequence * slot_stride)
    w = tl.load(windows + sequence * window_row + entries, mask=entry_ok, other=0)  # [KP]
    history = conv + layer * conv_layer + slot * KM1 * C
    from_row = (w >= 0) & entry_ok
    rows = tl.load(inputs + layer * in_layer + tl.maximum(w, 0)[:, None] * in_row + cols[None, :],
                   mask=from_row[:, None] & col_ok[None, :], other=0.0)
    old = tl.load(history + (KM1 + w)[:, None] * C + cols[None, :], mask=(~from_row & entry_ok)[:, None] & col_ok[None, :], other=0.0)
    new = tl.where(from_row[:, None], rows.to(conv.dtype.element_ty), old)
    # Every thread's reads of the old history are done before any thread overwrites it.
    tl.debug_barrier()
    tl.store(history + entries[:, None] * C + cols[None, :], new, mask=entry_ok[:, None] & col_ok[None, :])


def commit_conv_histories(
    conv: torch.Tensor,  # [L, slots, K-1, C] advanced in place
    slots: torch.Tensor,  # [B] int64 distinct
    windows: torch.Tensor,  # [B, K-1] int64
    inputs: torch.Tensor,  # [L, T, C] (rows strided)
    block: int = 256,
) -> None:
    """``conv[:, slots] = committed_histories(conv[:, slots], inputs, windows)``
    (:func:`splitspec.models.delta_rule.committed_histories`) as one launch in place, for conv
    histories and inputs of one dtype; ``slots`` and ``windows`` read where they are."""
    layers, _, before, channels = conv.shape
    num_seqs = slots.shape[0]
    if (
        not conv.is_contiguous() or inputs.dtype != conv.dtype or inputs.shape[0] != layers or inputs.shape[2] != channels
        or inputs.stride(2) != 1 or windows.shape != (num_seqs, before) or windows.stride(1) != 1
        or slots.dtype != torch.int64 or windows.dtype != torch.int64
    ):
        raise ValueError(
            f"commit_conv_histories: conv {tuple(conv.shape)} {conv.dtype}, inputs {tuple(inputs.shape)} {inputs.dtype}, "
            f"slots {tuple(slots.shape)} and windows {tuple(windows.shape)} disagree"
        )
    if num_seqs == 0:
        return
    block = min(block, triton.next_power_of_2(channels))
    with _on_device_of(conv):
        _conv_commit_kernel[(layers, num_seqs, triton.cdiv(channels, block))](
            conv, inputs, slots, windows, conv.stride(0), inputs.stride(0), inputs.stride(1), slots.stride(0), windows.stride(0),
            channels, KM1=before, KP=triton.next_power_of_2(before), BLOCK=block,
        )
