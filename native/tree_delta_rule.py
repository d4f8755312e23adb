"""Triton kernels for the tree-aware Gated DeltaNet: the conv over each row's ancestors, and the
delta rule with every row starting from its parent's state (spec 3.3).

They compute what :func:`splitspec.models.delta_rule.conv_silu_reference` and
:func:`splitspec.models.delta_rule.gated_delta_tree` compute, with the same terms (block, parents,
history, ancestor table, recurrent state); those torch functions are the references. The torch
path is launch-bound: a few small ops per depth level per layer. Here each is one launch.

- :func:`tree_conv_silu`: one program per (row, channel block) sums the ``K`` taps of the row's
  window, read through the ancestor table straight from the history and the block's inputs (no
  ``[T, K, C]`` gather), and applies SiLU.
- :func:`tree_gated_delta`: one program per (value head, ``Dv`` tile) holds the ``[Dk, BV]`` state
  tile in registers and walks the rows in order (parents come first). A row whose parent is the
  previous row continues in registers; any other row reloads its parent's stored state (or the
  state before the block), prefetched with its inputs while the previous row computes. Every
  row's state is stored, since the deepest accepted row's becomes the sequence's state on commit.
  The state is rounded to the storage dtype after every row, as the torch path does by reading its
  parent's *stored* state, so both give the same stored bits up to float32 rounding.

Import this module only where Triton can run (CUDA, or ``TRITON_INTERPRET=1`` set before the
import); :mod:`splitspec.models.delta_rule` decides when and imports it lazily.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["tree_conv_silu", "tree_gated_delta"]


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
    history,  # [K-1, C]
    inputs,  # [T, C]
    ancestors,  # [T, K] int64
    weight,  # [C, K]
    out,  # [T, C]
    C,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = channels < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(K):
        a = tl.load(ancestors + row * K + tap)  # a row of the block, or -1, -2, ... into the history
        in_block = a >= 0
        # Both indices clamped in range; the masks pick the one that applies.
        x_block = tl.load(inputs + tl.maximum(a, 0) * C + channels, mask=valid & in_block, other=0.0)
        x_history = tl.load(history + tl.maximum(a + K - 1, 0) * C + channels, mask=valid & (a < 0), other=0.0)
        w = tl.load(weight + channels * K + tap, mask=valid, other=0.0)
        acc += (x_block.to(tl.float32) + x_history.to(tl.float32)) * w.to(tl.float32)
    y = acc * tl.sigmoid(acc)
    tl.store(out + row * C + channels, _rounded(y, out.dtype.element_ty), mask=valid)


def tree_conv_silu(
    history: torch.Tensor,  # [K-1, C] conv inputs before the block
    inputs: torch.Tensor,  # [T, C]
    ancestors: torch.Tensor,  # [T, K] int64, see delta_rule.ancestor_table
    weight: torch.Tensor,  # [C, K], oldest tap first
    block_c: int = 512,
) -> torch.Tensor:
    """``SiLU(sum_k window[t, k] * weight[:, k])`` for every row ``t``: ``[T, C]`` in ``inputs.dtype``,
    accumulated in float32 (the torch reference rounds each product to ``inputs.dtype`` first)."""
    num_rows, channels = inputs.shape
    width = weight.shape[1]
    if history.shape != (width - 1, channels) or ancestors.shape != (num_rows, width) or weight.shape[0] != channels:
        raise ValueError(
            f"tree_conv_silu: history {tuple(history.shape)}, inputs {tuple(inputs.shape)}, ancestors "
            f"{tuple(ancestors.shape)} and weight {tuple(weight.shape)} disagree"
        )
    out = torch.empty_like(inputs)
    if num_rows == 0:
        return out
    history, inputs, ancestors, weight = (x.contiguous() for x in (history.to(inputs.dtype), inputs, ancestors.long(), weight))
    block_c = min(block_c, triton.next_power_of_2(channels))
    with _on_device_of(inputs):
        _conv_silu_kernel[(num_rows, triton.cdiv(channels, block_c))](
            history, inputs, ancestors, weight, out, channels, K=width, BLOCK_C=block_c
        )
    return out


@triton.jit
def _tree_delta_kernel(
    q,  # [T, H, DK] normalised and scaled
    k,  # [T, H, DK] normalised
    v,  # [T, H, DV]
    g,  # [T, H] log-decay
    beta,  # [T, H]
    initial,  # [H, DK, DV] the state before the block, storage dtype
    parents,  # [T] int64
    out,  # [T, H, DV] float32
    states,  # [T, H, DK, DV] storage dtype
    q_row,  # elements between rows of q, k and v (heads and dims are packed within a row)
    k_row,
    v_row,
    T,
    H,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    head = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] value dims of this tile
    keys = tl.arange(0, BK)  # [BK]
    col_ok, key_ok = cols < DV, keys < DK
    tile_ok = key_ok[:, None] & col_ok[None, :]
    tile = head * DK * DV + keys[:, None] * DV + cols[None, :]  # [BK, BV] offsets of this tile in one state
    state_size = H * DK * DV
    # Row t's inputs and starting state are loaded during row t - 1 (row 0's before the loop), so
    # their latency hides behind a row of arithmetic. A starting state other than the previous
    # row's is the state before the block or a row < t - 1, both stored by then.
    s = tl.load(initial + tile, mask=tile_ok, other=0.0).to(tl.float32)  # row 0's parent is -1
    qt = tl.load(q + head * DK + keys, mask=key_ok, other=0.0).to(tl.float32)  # [BK]
    kt = tl.load(k + head * DK + keys, mask=key_ok, other=0.0).to(tl.float32)  # [BK]
    vt = tl.load(v + head * DV + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BV]
    gt = tl.load(g + head).to(tl.float32)
    bt = tl.load(beta + head).to(tl.float32)
    t = 0
    while t < T:  # not `for t in range(T)`: the interpreter cannot index with a runtime T under numpy >= 2.4
        # Prefetch row t + 1 (masked off past the end).
        nt = t + 1
        more = nt < T
        nth = nt * H + head  # T * H stays far below 2**31; T * state_size need not
        pn = tl.load(parents + nt, mask=more, other=t)
        reload = more & (pn != t)  # row t + 1 does not continue row t
        tl.debug_barrier()  # rows stored by earlier iterations are visible to every thread
        from_initial = tl.load(initial + tile, mask=tile_ok & reload & (pn < 0), other=0.0)
        from_row = tl.load(states + tl.maximum(pn, 0) * state_size + tile, mask=tile_ok & reload & (pn >= 0), other=0.0)
        qn = tl.load(q + nt * q_row + head * DK + keys, mask=key_ok & more, other=0.0)
        kn = tl.load(k + nt * k_row + head * DK + keys, mask=key_ok & more, other=0.0)
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
        tl.store(states + t.to(tl.int64) * state_size + tile, stored, mask=tile_ok)
        # Children read the stored (rounded) state, as in the torch path.
        s = tl.where(reload, from_initial.to(tl.float32) + from_row.to(tl.float32), stored.to(tl.float32))
        qt, kt, vt = qn.to(tl.float32), kn.to(tl.float32), vn.to(tl.float32)
        gt, bt = gn.to(tl.float32), bn.to(tl.float32)
        t = nt


def tree_gated_delta(
    q: torch.Tensor,  # [T, H, Dk] normalised and scaled
    k: torch.Tensor,  # [T, H, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] the state before the block
    parents: torch.Tensor,  # [T], parents[t] < t
    store_dtype: torch.dtype,
    block_v: int = 16,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`splitspec.models.delta_rule.gated_delta_tree` as one launch: outputs ``[T, H, Dv]``
    (float32) and the state after every row ``[T, H, Dk, Dv]`` (``store_dtype``)."""
    num_rows, heads, dk = k.shape
    dv = v.shape[-1]
    expected = {"q": (num_rows, heads, dk), "v": (num_rows, heads, dv), "g": (num_rows, heads), "beta": (num_rows, heads),
                "state": (heads, dk, dv), "parents": (num_rows,)}
    for name, tensor in (("q", q), ("v", v), ("g", g), ("beta", beta), ("state", state), ("parents", parents)):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"tree_gated_delta: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
    out = torch.empty(num_rows, heads, dv, dtype=torch.float32, device=v.device)
    states = torch.empty(num_rows, heads, dk, dv, dtype=store_dtype, device=v.device)
    if num_rows == 0:
        return out, states
    # q, k, v may be views with rows apart (v is a slice of the conv output): only heads and dims
    # need to be packed.
    q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
    g, beta, parents = (x.contiguous() for x in (g, beta, parents.long()))
    initial = state.to(store_dtype).contiguous()
    block_v = min(block_v, triton.next_power_of_2(dv))
    with _on_device_of(v):
        _tree_delta_kernel[(heads, triton.cdiv(dv, block_v))](
            q, k, v, g, beta, initial, parents, out, states, q.stride(0), k.stride(0), v.stride(0), num_rows, heads,
            DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, num_warps=num_warps,
        )
    return out, states
