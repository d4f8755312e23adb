"""Gated DeltaNet state math over a chain or a tree of rows: causal conv gather and delta rule.

One pass may carry the rows of several sequences (batched verify): each has its own committed
conv history and recurrent state, and its rows only ever read its own.

Terms
-----
block
    The ``T`` rows of one forward pass: a prefill chunk (a chain), a verify tree, or the rows of
    ``S`` sequences concatenated, sequence ``s`` owning rows ``[offsets[s], offsets[s + 1])``.
offsets
    ``[S + 1]`` int64 row offsets of the sequences in the block (``offsets[0] = 0``,
    ``offsets[S] = T``); one sequence is ``[0, T]``. :func:`batch_parents` builds them.
parents
    ``[T]`` int64: the row each row continues from. ``-(s + 1)`` means sequence ``s``'s state
    before the block (its committed state), so with one sequence ``-1``; otherwise ``parents[t]``
    is a row of the same sequence with ``parents[t] < t``. A chain has ``parents[t] = t - 1``.
    Verify rows are ``[root, node 1..n]`` with the root at ``-(s + 1)`` and node ``j``'s parent
    row as in :mod:`splitspec.spec.tree`.
history
    ``[S, K - 1, C]`` (``[K - 1, C]`` when ``S = 1``): per sequence, the last ``K - 1`` conv
    inputs before the block, oldest first (``K`` is the conv kernel width).
ancestor table
    ``[T, K]`` int64: column ``K - 1`` is the row itself, column ``j`` is ``K - 1 - j`` steps up
    its parent chain. Steps past the block's start continue into the row's own sequence's
    history as *virtual rows*: ``-(s * (K - 1) + i)`` is the ``i``-th latest history input of
    sequence ``s`` (``i = 1 .. K - 1``; ``history[s, K - 1 - i]``), so one sequence has ``-1``
    (its latest input), ``-2``, ... and a row's code does not depend on how many sequences share
    the block. E.g. with ``K = 4``, ``parents = [-1, 0, 0]`` gives
    ``[[-3, -2, -1, 0], [-2, -1, 0, 1], [-2, -1, 0, 2]]``: siblings 1 and 2 convolve over their
    own lineage, not over each other (spec 3.3, ``ggml_ssm_conv_tree``). Two sequences,
    ``parents = [-1, -2, 1]`` (sequence 0: row 0; sequence 1: rows 1 and 2), give
    ``[[-3, -2, -1, 0], [-6, -5, -4, 1], [-5, -4, 1, 2]]``.
recurrent state
    ``[H, Dk, Dv]`` per sequence (``[S, H, Dk, Dv]`` for a block of ``S`` sequences), one
    ``[Dk, Dv]`` matrix ``S`` per value head. One token with query ``q``, key ``k`` (both
    L2-normalised, ``q`` scaled by ``1/sqrt(Dk)``), value ``v``, log-decay ``g <= 0`` and
    write strength ``beta`` in (0, 1) updates it as::

        S = exp(g) * S
        S = S + k ⊗ beta * (v - S^T k)       # the delta rule: write the correction only
        o = S^T q

    In a tree, each row starts from its parent row's state (the parent-chain recurrence of
    spec 3.3), so every row's output equals that of decoding its root-to-row path one token at a
    time. The state after every row is kept (``[T, H, Dk, Dv]``); after acceptance the deepest
    accepted row's state becomes its sequence's state, and the last ``K - 1`` inputs along its
    path (:func:`committed_history`) its sequence's history.

The arithmetic runs in float32 (float64 when the inputs are); ``store_dtype`` is the dtype states
are kept in between tokens. A row reads its parent's *stored* state, so a tree row and a
sequential step compute the same thing for any ``store_dtype``.

:func:`conv_silu` and :func:`gated_delta` are what the model calls: they run the Triton kernels of
:mod:`native.tree_delta_rule` where :func:`native_kernels_for` says so, and otherwise
the torch functions here (:func:`conv_silu_reference`, :func:`gated_delta_tree`), which are the
kernels' references. A block of several sequences gives every row what the one-sequence call on
its own sequence's rows gives (prefill, :func:`gated_delta_chunked`, stays one sequence per call).

Commit by recomputation
-----------------------
path
    The accepted rows of one sequence's block, root first, each the parent of the next: the
    rows whose tokens the sequence commits.
A tree pass need not keep every row's state until acceptance (``Hv * Dk * Dv`` values per row
and layer: 151 MB per row over the 48 layers of Qwen3.5-27B in float32). It keeps each row's
delta-rule inputs instead (normalised key, value, log-decay, write strength: with the conv inputs
both keep, 1.98 MB a row at that geometry in bfloat16, 76x less), and
:func:`path_gated_delta` advances the sequence's committed state along its path afterwards, row
by row exactly as the tree did (the state rounded to the storage dtype after every row), while
:func:`committed_histories` takes the path's last ``K - 1`` conv inputs. The tree's per-row
states then live for one layer only; the kernel stores just the rows a later row reloads
(:func:`reloaded_rows`).

Fixed shapes
------------
A pass captured as a CUDA graph may not read tensor values on the host. :func:`depth_levels`
does (it groups rows by depth on the host), so a fixed-shape pass hands :func:`gated_delta_tree`
every row's depth as a tensor and the number of levels to walk instead; the Triton kernels read
nothing on the host at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from native import use_triton

__all__ = [
    "ancestor_table",
    "batch_parents",
    "chain_parents",
    "commit_conv_histories",
    "committed_histories",
    "committed_history",
    "conv_silu",
    "conv_silu_reference",
    "conv_windows",
    "depth_levels",
    "gated_delta",
    "gated_delta_chunked",
    "gated_delta_tree",
    "l2_normalize",
    "native_kernels_for",
    "path_gated_delta",
    "path_gated_delta_reference",
    "reloaded_rows",
    "tree_outputs",
]


def chain_parents(num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[T]`` parents of a causal chain: ``[-1, 0, 1, ..., T - 2]``."""
    return torch.arange(-1, num_rows - 1, device=device)


def batch_parents(blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-sequence parents of ``S >= 1`` blocks (each ``[n_s]``, ``-1`` = before the block)
    -> the parents ``[T]`` of their concatenation and its ``offsets`` ``[S + 1]``."""
    lengths = torch.tensor([len(p) for p in blocks])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(blocks[0].device)  # [S+1]
    parents = torch.cat([torch.where(p >= 0, p + offsets[s], -(s + 1)) for s, p in enumerate(blocks)])
    return parents, offsets


def ancestor_table(parents: torch.Tensor, width: int) -> torch.Tensor:
    """``parents`` ``[T]`` -> the ancestor table ``[T, width]``, with the virtual-row codes of the
    module docstring for rows of any sequence."""
    num_rows = parents.shape[0]
    table = torch.empty(num_rows, width, dtype=torch.int64, device=parents.device)
    table[:, width - 1] = torch.arange(num_rows, device=parents.device)
    for j in range(width - 2, -1, -1):
        newer = table[:, j + 1]  # [T]
        up = parents[newer.clamp(min=0)]  # [T] the parent where newer is a row
        # A parent -(s + 1) is before the block: sequence s's latest history input, -(s(K-1) + 1).
        up = torch.where(up >= 0, up, (up + 1) * (width - 1) - 1)
        # Inside the block follow the parent; in the history, step one input further back.
        table[:, j] = torch.where(newer >= 0, up, newer - 1)
    return table


def conv_windows(history: torch.Tensor, inputs: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """The ``K``-tap input window of rows along their parent chains, oldest first.

    ``history`` [S, K-1, C] (or [K-1, C] for one sequence), ``inputs`` [T, C], ``ancestors``
    [R, K] (the table's rows, or any of them) -> ``[R, K, C]``. The conv output of row ``t`` is
    ``sum_k windows[t, k] * weight[:, k]``, and the conv state after row ``t`` (the history its
    children see) is ``windows[t, 1:]``: ``conv_windows(history, inputs, ancestors[rows])[:, 1:]``
    is every sequence's new history at once when ``rows`` are their deepest accepted rows.
    """
    before = history.shape[-2]  # K - 1
    flat = history.reshape(-1, history.shape[-1]).to(inputs.dtype)  # [S*(K-1), C], sequence s at s*(K-1)
    back = -ancestors - 1  # [R, K] s*(K-1) + i - 1 for the virtual row i inputs back in sequence s
    in_history = back // before * before + before - 1 - back % before  # its index in flat
    index = torch.where(ancestors >= 0, ancestors + flat.shape[0], in_history)
    return torch.cat([flat, inputs])[index]  # [S*(K-1)+T, C] gathered


def committed_history(history: torch.Tensor, inputs: torch.Tensor, ancestors: torch.Tensor, row: int) -> torch.Tensor:
    """One sequence's conv history after ``row``: its new history when ``row`` is its deepest
    accepted row. ``history`` [K-1, C] is that sequence's alone (as a per-sequence cache holds it),
    ``inputs`` [T, C] and ``ancestors`` [T, K] the whole block's -> ``[K-1, C]``."""
    before = history.shape[-2]
    window = ancestors[row]  # [K]
    # Re-code the row's virtual rows -(s(K-1) + i) as the one-sequence -i of the history given.
    window = torch.where(window >= 0, window, -((-window - 1) % before) - 1)
    return conv_windows(history, inputs, window[None])[0, 1:]


def conv_silu_reference(history: torch.Tensor, inputs: torch.Tensor, ancestors: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise conv of every row's window: ``history`` [S, K-1, C] or [K-1, C],
    ``inputs`` [T, C], ``ancestors`` [T, K], ``weight`` [C, K] (oldest tap first) -> ``[T, C]``."""
    return F.silu((conv_windows(history, inputs, ancestors) * weight.T).sum(1))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the FLA convention)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def depth_levels(parents: torch.Tensor) -> list[torch.Tensor]:
    """Rows grouped by depth below the block start: ``levels[d]`` holds the rows at depth ``d``.

    Rows of one level depend only on earlier levels, so a level is computed in one batch; a tree
    of depth ``D`` takes ``D + 1`` sequential steps whatever its width.
    """
    depth: list[int] = []
    for p in parents.tolist():
        depth.append(0 if p < 0 else depth[p] + 1)
    depths = torch.tensor(depth, dtype=torch.int64)
    return [torch.nonzero(depths == d).flatten().to(parents.device) for d in range(max(depth, default=-1) + 1)]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gated_delta_tree(
    q: torch.Tensor,  # [T, H, Dk] normalised and scaled
    k: torch.Tensor,  # [T, H, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, Dk, Dv] (or [H, Dk, Dv] for S = 1) the states before the block
    parents: torch.Tensor,  # [T], -(s + 1) = sequence s's state
    store_dtype: torch.dtype,
    state_index: torch.Tensor | None = None,  # [S]: sequence s starts from state[state_index[s]] (state: a table)
    depths: torch.Tensor | None = None,  # [T] each row's depth below its block's start, -1 = no sequence's row
    levels: int = 0,  # with depths: the depths to walk, 0 .. levels - 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form over a tree (or the trees of ``S`` sequences): outputs ``[T, H, Dv]``
    and the state after every row ``[T, H, Dk, Dv]`` (in ``store_dtype``). A chain is the tree
    with ``chain_parents``.

    Rows run level by level, a level being the rows of one depth (they depend only on earlier
    levels). Without ``depths`` the levels come from ``parents`` on the host (:func:`depth_levels`):
    each row is computed once. With ``depths`` (a fixed-shape pass, see the module docstring) each
    of ``levels`` steps computes every row and keeps those of its depth: no host read, fixed
    shapes, ``levels`` times the arithmetic; a row of depth -1 (padding) is never kept, its output
    and state stay 0."""
    dt = _math_dtype(v.dtype)
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    decay = g.to(dt).exp()[..., None, None]  # [T, H, 1, 1]
    initial = state if state.dim() == 4 else state[None]  # [S, H, Dk, Dv]
    if state_index is not None:
        initial = initial.index_select(0, state_index)
    num_seqs = initial.shape[0]
    # Slot s holds sequence s's state before the block, slot S + t the state after row t: a row's
    # starting state is one slot, one gather for the whole level.
    slots = torch.zeros((num_seqs + v.shape[0], *initial.shape[1:]), dtype=store_dtype, device=v.device)  # [S+T, H, Dk, Dv]
    slots[:num_seqs] = initial
    start = torch.where(parents >= 0, parents + num_seqs, -parents - 1)  # [T]
    out = torch.zeros_like(v)  # [T, H, Dv]
    if depths is None:
        for rows in depth_levels(parents):
            s = slots[start[rows]].to(dt) * decay[rows]  # [R, H, Dk, Dv]
            kr = k[rows][..., None]  # [R, H, Dk, 1]
            predicted = (s * kr).sum(-2)  # [R, H, Dv]  S^T k
            s = s + kr * ((v[rows] - predicted) * beta[rows][..., None])[..., None, :]
            out[rows] = (s * q[rows][..., None]).sum(-2)
            slots[rows + num_seqs] = s.to(store_dtype)
        return out, slots[num_seqs:]
    for level in range(levels):
        # Every row from its parent's slot; only this level's parents are final, so only its rows are kept.
        s = slots[start].to(dt) * decay  # [T, H, Dk, Dv]
        kr = k[..., None]
        predicted = (s * kr).sum(-2)
        s = s + kr * ((v - predicted) * beta[..., None])[..., None, :]
        at = depths == level  # [T]
        out = torch.where(at[:, None, None], (s * q[..., None]).sum(-2), out)
        slots[num_seqs:] = torch.where(at[:, None, None, None], s.to(store_dtype), slots[num_seqs:])
    return out, slots[num_seqs:]


def gated_delta_chunked(
    q: torch.Tensor,  # [T, H, Dk] normalised and scaled
    k: torch.Tensor,  # [T, H, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] the state before the chain
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over a chain (prefill): outputs ``[T, H, Dv]`` and the final state
    ``[H, Dk, Dv]`` (math dtype), equal to :func:`gated_delta_tree` up to rounding.

    Within a chunk of ``L`` rows, with ``c_t`` the cumulative log-decay and ``S0`` the state at the
    chunk start, unrolling the recurrence gives ``S_t = e^{c_t} S0 + sum_{s<=t} e^{c_t - c_s} k_s d_s^T``
    where the written corrections ``d`` solve the unit lower-triangular system
    ``(I + A) d = beta v - beta e^{c} (K S0)`` with ``A[t, s] = beta_t e^{c_t - c_s} k_t.k_s``
    (``s < t``). Then ``o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t.k_s) d_s`` and the
    next chunk starts from ``S_L``. Per chunk: two triangular solves and a few matmuls.
    """
    dt = _math_dtype(v.dtype)
    # Heads first: [H, T, D].
    q, k, v = (x.to(dt).transpose(0, 1) for x in (q, k, v))
    g, beta = (x.to(dt).transpose(0, 1) for x in (g, beta))  # [H, T]
    s = state.to(dt)  # [H, Dk, Dv]
    out = torch.empty_like(v)
    for begin in range(0, v.shape[1], chunk):
        sl = slice(begin, min(begin + chunk, v.shape[1]))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        c = g[:, sl].cumsum(-1)  # [H, L]
        n = c.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # e^{c_t - c_s} for s <= t, 0 above the diagonal (masked before exp: no overflow).
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, L, L]
        a = (bc * kc) @ kc.transpose(-1, -2) * decay  # [H, L, L], lower triangle incl. diagonal
        system = a.tril(-1) + torch.eye(n, dtype=dt, device=v.device)
        rhs = bc * vc - (bc * c.exp()[..., None] * kc) @ s  # [H, L, Dv]
        d = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, sl] = c.exp()[..., None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ d
        s = c[:, -1, None, None].exp() * s + ((c[:, -1:] - c).exp()[..., None] * kc).transpose(-1, -2) @ d
    return out.transpose(0, 1), s


def native_kernels_for(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``x``: where ``native.use_triton`` says
    kernels run (CUDA, or the CPU tests), unless the math is float64 (it stays on torch)."""
    return use_triton(x) and x.dtype != torch.float64


def conv_silu(
    history: torch.Tensor, inputs: torch.Tensor, ancestors: torch.Tensor, weight: torch.Tensor,
    keep: tuple[torch.Tensor, torch.Tensor] | None = None,
    history_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`conv_silu_reference`, by a Triton kernel where :func:`native_kernels_for` says so.
    ``keep``: ``[T, C]`` and ``[T, V]`` tensors that also get a copy of ``inputs`` and of the
    output's last ``V`` channels (by the kernel's own launch where it runs). ``history_index``
    [S]: ``history`` is a table, sequence s's history its row ``history_index[s]`` (the kernel
    reads it in place)."""
    if native_kernels_for(inputs):
        from native.tree_delta_rule import tree_conv_silu

        return tree_conv_silu(history, inputs, ancestors, weight, keep=keep, history_index=history_index)
    if history_index is not None:
        history = history.index_select(0, history_index)
    out = conv_silu_reference(history, inputs, ancestors, weight)
    if keep is not None:
        keep[0].copy_(inputs)
        keep[1].copy_(out[:, out.shape[1] - keep[1].shape[1]:])
    return out


def gated_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, store_dtype: torch.dtype, offsets: torch.Tensor | None = None,
    *,
    state_index: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
    levels: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_tree`, by a Triton kernel where :func:`native_kernels_for` says so.
    ``q`` and ``k`` may hold key heads ``[T, Hk, Dk]``, fewer than ``v``'s value heads: value head
    ``h`` reads key head ``h // (Hv / Hk)`` (the kernel indexes them so; the torch path repeats
    them). ``offsets`` [S + 1] (the block's sequences) spare the kernel deriving them from ``parents``;
    the torch path needs none. ``state_index`` [S]: ``state`` is a table and sequence ``s`` starts
    from ``state[state_index[s]]`` (the kernel reads it in place). ``keep`` [T] bool or int8
    (:func:`reloaded_rows`): the kernel stores only these rows' states, the others' are left
    undefined. ``depths`` and ``levels``: the torch path's fixed-shape walk (:func:`gated_delta_tree`)."""
    if native_kernels_for(v):
        from native.tree_delta_rule import tree_gated_delta

        options = {name: x for name, x in (("state_index", state_index), ("keep", keep)) if x is not None}
        return tree_gated_delta(q, k, v, g, beta, state, parents, store_dtype, offsets, **options)
    group = v.shape[1] // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    return gated_delta_tree(q, k, v, g, beta, state, parents, store_dtype, state_index, depths, levels)


def tree_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, store_dtype: torch.dtype, offsets: torch.Tensor | None,
    *,
    max_rows: int,
    state_index: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
    levels: int = 0,
) -> torch.Tensor:
    """A tree pass's outputs ``[T, H, Dv]`` alone (its states are not needed: the commit
    recomputes the accepted path's): :func:`gated_delta` with ``keep`` (:func:`reloaded_rows`) and
    the other arguments as there. With ``SPLITSPEC_NATIVE_ON=tree_chunk_delta``, where the kernels
    run, states are stored in float32 and a sequence has 2 to ``native.tree_chunk_delta.MAX_ROWS``
    rows (``max_rows``, from the pass's shape), by the chunked form over the tree instead
    (:mod:`native.tree_chunk_delta`: products over the block in place of a walk over its rows).
    It is off by default: on an H100 it made the 27B's verify b22 pass 26.7 ms against the walk's
    20.3 and a 32-sequence pass 286 ms against 146 (BENCHMARKS.md [T11]). Other storage dtypes
    would keep the walk in any case, which rounds each row's state to them."""
    if native_kernels_for(v) and store_dtype == torch.float32 and state.dtype == torch.float32:
        from native import switched_on
        from native.tree_chunk_delta import KERNEL_NAME, MAX_ROWS, tree_chunk_delta

        if 2 <= max_rows <= MAX_ROWS and switched_on(KERNEL_NAME) and use_triton(v, KERNEL_NAME):
            return tree_chunk_delta(q, k, v, g, beta, state, parents, max_rows, offsets, state_index=state_index)
    return gated_delta(q, k, v, g, beta, state, parents, store_dtype, offsets, state_index=state_index, keep=keep,
                       depths=depths, levels=levels)[0]


def reloaded_rows(parents: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the rows whose state a later row starts from, other than the row right after
    them (which continues from it without a reload): all the tree kernel must store when nothing
    but the block itself reads the states. On the device, fixed shape."""
    rows = torch.arange(parents.shape[0], device=parents.device)
    reloads = (parents >= 0) & (parents != rows - 1)  # [T] rows that start from an earlier, stored row
    count = torch.zeros(parents.shape[0], dtype=torch.int32, device=parents.device)
    return count.scatter_add_(0, parents.clamp(min=0), reloads.to(torch.int32)) > 0


def path_gated_delta_reference(
    states: torch.Tensor,  # [L, slots, H, Dk, Dv] storage dtype, advanced in place
    slots: torch.Tensor,  # [B] int64 the slot each path advances (distinct)
    paths: torch.Tensor,  # [B, P] int64 each path's rows, root first; entries past its length are ignored
    lengths: torch.Tensor,  # [B] int64 rows of each path, >= 1
    keys: torch.Tensor,  # [L, T, Hk, Dk] every row's normalised key (before the value-head repeat)
    values: torch.Tensor,  # [L, T, H, Dv]
    decays: torch.Tensor,  # [L, T, H] log-decay g
    betas: torch.Tensor,  # [L, T, H]
) -> None:
    """Advance ``B`` sequences' states (every layer's) along their accepted paths: each path row
    updates the state as :func:`gated_delta_tree` updates a row's (value head ``h`` reads key head
    ``h // (H / Hk)``), and rounds it to the storage dtype, as the tree's children read it. The
    state after the last row replaces the slot's: the state the tree pass computed for the
    sequence's deepest accepted row, without keeping it (module docstring)."""
    dt = _math_dtype(values.dtype)
    group = values.shape[2] // keys.shape[2]
    s = states[:, slots].to(dt)  # [L, B, H, Dk, Dv]
    for step in range(paths.shape[1]):
        rows = paths[:, step]  # [B]
        k = keys[:, rows].to(dt).repeat_interleave(group, 2)[..., None]  # [L, B, H, Dk, 1]
        v, beta = values[:, rows].to(dt), betas[:, rows].to(dt)  # [L, B, H, Dv], [L, B, H]
        n = s * decays[:, rows].to(dt).exp()[..., None, None]
        predicted = (n * k).sum(-2)  # [L, B, H, Dv]
        n = n + k * ((v - predicted) * beta[..., None])[..., None, :]
        n = n.to(states.dtype).to(dt)  # the next row reads the stored state
        s = torch.where((step < lengths)[None, :, None, None, None], n, s)
    states[:, slots] = s.to(states.dtype)


def path_gated_delta(
    states: torch.Tensor, slots: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor,
    keys: torch.Tensor, values: torch.Tensor, decays: torch.Tensor, betas: torch.Tensor,
) -> None:
    """:func:`path_gated_delta_reference`, by one Triton launch where :func:`native_kernels_for` says so."""
    if native_kernels_for(keys):
        from native.tree_delta_rule import path_gated_delta as kernel

        return kernel(states, slots, paths, lengths, keys, values, decays, betas)
    return path_gated_delta_reference(states, slots, paths, lengths, keys, values, decays, betas)


def commit_conv_histories(conv: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor, inputs: torch.Tensor) -> None:
    """Rewrite the conv histories ``conv`` ``[L, slots, K-1, C]`` of ``slots`` ``[B]`` in place with
    :func:`committed_histories` of ``inputs`` (of ``conv``'s dtype) and ``windows``: by one Triton
    launch where :func:`native_kernels_for` says so, else by a gather, the torch function and a
    scatter."""
    if native_kernels_for(inputs):
        from native.tree_delta_rule import commit_conv_histories as kernel

        return kernel(conv, slots, windows, inputs)
    conv[:, slots] = committed_histories(conv[:, slots], inputs, windows)


def committed_histories(history: torch.Tensor, inputs: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Conv histories of ``B`` sequences after their paths, every layer at once: ``history``
    ``[L, B, K-1, C]`` (theirs before the block), ``inputs`` ``[L, T, C]`` (the block's rows),
    ``windows`` ``[B, K-1]`` int64 (each new history entry, oldest first: a row of the block, or
    ``-i`` for the ``i``-th latest entry of the old history) -> ``[L, B, K-1, C]``."""
    layers, num_seqs, before, channels = history.shape
    from_rows = inputs[:, windows.clamp(min=0)]  # [L, B, K-1, C]
    index = (windows + before).clamp(0, before - 1)[None, :, :, None].expand(layers, num_seqs, before, channels)
    from_history = history.gather(2, index).to(inputs.dtype)
    return torch.where((windows >= 0)[None, :, :, None], from_rows, from_history)
