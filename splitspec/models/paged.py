"""Paged KV cache and the layout of one batched forward pass over several sequences.

Terms
-----
block
    ``block_size`` consecutive KV positions of one sequence. The pool holds ``num_blocks`` of them
    per attention layer; a sequence owns a *block table* (its blocks in position order), grown as
    it gets longer and given back whole when it ends. Position ``p`` of a sequence lives in pool
    *slot* ``table[p // block_size] * block_size + p % block_size``.
pad block
    Block 0 is never given to a sequence: the rows and table entries that pad a pass to a fixed
    shape point there, so they read and write nothing of any sequence.
pass
    One forward over the rows of ``B`` sequences: sequence ``s`` brings ``n_s`` rows (a verify
    tree ``[root, nodes]``, a decode step's one row, or a prompt chunk) written at its positions
    ``L_s .. L_s + n_s - 1``, where ``L_s`` (its *start*) is the number of positions it has
    committed. Rows are *ragged*: concatenated, ``N = sum n_s`` of them, for every matmul. For
    attention they are laid out padded, ``[B, T]`` with ``T >= max n_s``, against each sequence's
    own keys ``[B, S]`` (``S`` a multiple of ``block_size`` covering ``max L_s + n_s``).
visibility
    Row ``j`` of sequence ``s`` sees all of its sequence's committed positions and the rows of
    its own block that ``tree[s, j]`` marks (its ancestors and itself: causal for a prompt chunk).
    A pad row sees itself only; its output is discarded.

The layout's host side (:func:`pass_layout`) is numpy; the device side (:class:`PassInputs`)
holds every tensor a pass reads, so a pass of fixed ``(N, B, T, S)`` can be captured as a CUDA
graph and replayed with new inputs written into the same buffers.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

PAD_BLOCK = 0


class KVBlockPool:
    """K/V of every attention layer in blocks: ``k``, ``v`` ``[layers, H_kv, num_blocks * block_size, D]``.

    Thread-safe allocation: blocks come back from whichever thread ends a sequence.
    """

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the pad block), got {num_blocks}")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (layers, kv_heads, num_blocks * block_size, head_dim)
        # Zeros: a pad row reads slots nobody wrote, and 0 * NaN would poison its neighbours' sums.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._free = list(range(num_blocks - 1, PAD_BLOCK, -1))
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def usable_blocks(self) -> int:
        """Blocks a sequence can own: all but the pad block."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks, or None (nothing taken) when fewer are free."""
        with self._lock:
            if count > len(self._free):
                return None
            taken = self._free[len(self._free) - count :]
            del self._free[len(self._free) - count :]
            return taken[::-1]

    def release(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(blocks)

    def slots(self, table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        """Pool slots of ``positions`` of the sequence owning blocks ``table``."""
        table = np.asarray(table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def compact(self, moves: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> None:
        """Keep the accepted rows of the verify blocks of a pass, one ``(table, start, accepted)`` a
        sequence: row ``start + d`` of the sequence owning blocks ``table`` receives its old row
        ``start + accepted[d]`` (``splitspec.spec.acceptance``). One copy of the indices to the
        device and one gather and one scatter a pool for all of them (sequences own disjoint
        blocks), not two copies and four kernels a sequence."""
        sources, targets = [], []
        for table, start, accepted in moves:
            moved = next((d for d, a in enumerate(accepted) if a != d), len(accepted))
            if moved < len(accepted):  # else a decode step, or an accepted first-child chain: all in place
                sources.append(self.slots(table, start + np.asarray(accepted[moved:], dtype=np.int64)))
                targets.append(self.slots(table, start + np.arange(moved, len(accepted))))
        if not sources:
            return
        count = sum(len(x) for x in sources)
        index = torch.from_numpy(np.concatenate(sources + targets)).to(self.k.device)  # [2 * count]: sources, then targets
        src, dst = index[:count], index[count:]
        for pool in (self.k, self.v):
            pool.index_copy_(2, dst, pool.index_select(2, src))  # gathered first: sources may be overwritten


class StateSlots(Protocol):
    """Fixed-size per-sequence state of a recurrent family (one slot per live sequence), beside
    its KV blocks. Slot 0 is the pad slot (padding sequences' state), never given out. A tree pass
    keeps what each row needs (``pending``) until :meth:`commit`."""

    pending: object | None  # the last tree pass's rows; a pass runner sets it after replaying a captured pass

    def allocate(self) -> int | None:
        """A zeroed slot, or None when none is free."""

    def release(self, slot: int) -> None: ...

    def reserve(self, rows: int) -> None:
        """Keep what tree passes of up to ``rows`` rows keep at fixed addresses (captured passes write there)."""

    def commit(self, slot: int, path: Sequence[int]) -> None:
        """Advance ``slot`` to the state after the accepted ``path`` (ragged rows of the last tree
        pass, root first): its deepest row's candidate state."""

    def commit_paths(self, paths: Sequence[tuple[int, Sequence[int]]]) -> None:
        """:meth:`commit` of several ``(slot, path)`` at once (the sequences of one pass)."""

    def read(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's tensors by name (tests and tools)."""


@dataclass
class PagedState:
    """All a target engine keeps for its sequences: KV blocks, and state slots for recurrent families."""

    kv: KVBlockPool
    slots: StateSlots | None = None


@dataclass
class PassLayout:
    """The host side of one pass (see the module docstring); every array is exactly sized."""

    tokens: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64 RoPE positions (start + depth: siblings share one)
    write_slots: np.ndarray  # [N] int64 pool slot of each row's K/V
    parents: np.ndarray  # [N] int64 parent row of each row: a row of its sequence, or -(s + 1) before sequence s's block
    offsets: np.ndarray  # [B + 1] int64 first row of each sequence in the ragged rows
    starts: np.ndarray  # [B] int64 committed positions of each sequence (L_s)
    state_slots: np.ndarray  # [B] int64 recurrent state slot of each sequence (0 where none)
    tables: list[np.ndarray]  # B block tables
    trees: list[np.ndarray]  # B [n_s, n_s] bool: each sequence's own visibility

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def num_sequences(self) -> int:
        return len(self.starts)

    @property
    def max_rows(self) -> int:
        """Rows of the largest sequence block: T before padding."""
        return int(np.diff(self.offsets).max())

    @property
    def max_keys(self) -> int:
        """Key positions of the longest sequence: S before padding."""
        return int((self.starts + np.diff(self.offsets)).max())


def pass_layout(
    pool: KVBlockPool,
    tokens: Sequence[Sequence[int]],  # B lists of n_s row tokens
    parents: Sequence[np.ndarray],  # B [n_s] parent row of each row inside its block, -1 = before it
    starts: Sequence[int],  # B committed positions
    tables: Sequence[Sequence[int]],  # B block tables covering start + n_s positions
    trees: Sequence[np.ndarray],  # B [n_s, n_s] bool visibility inside the block
    state_slots: Sequence[int | None] | None = None,  # B recurrent state slots
) -> PassLayout:
    """The host layout of a pass over ``B`` sequences' blocks; a row's depth (its RoPE position
    past the start) is its distance from the block's start along ``parents``."""
    if all(len(t) == 1 for t in tokens):
        return _decode_layout(pool, tokens, starts, tables, trees, state_slots)
    return _tree_layout(pool, tokens, parents, starts, tables, trees, state_slots)


def _tree_layout(
    pool: KVBlockPool,
    tokens: Sequence[Sequence[int]],
    parents: Sequence[np.ndarray],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    trees: Sequence[np.ndarray],
    state_slots: Sequence[int | None] | None = None,
) -> PassLayout:
    """:func:`pass_layout` of blocks of any shape."""
    counts = np.array([len(t) for t in tokens], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    starts_np = np.asarray(starts, dtype=np.int64)
    rows = []  # [N] ragged parents
    depths = []
    for s, block in enumerate(parents):
        block = np.asarray(block, dtype=np.int64)
        depth: list[int] = []  # a list, not numpy: one pass over a batch's trees walks every row
        for parent in block.tolist():
            depth.append(0 if parent < 0 else depth[parent] + 1)
        depths.append(depth)
        rows.append(np.where(block >= 0, block + offsets[s], -(s + 1)))
    flat_tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    positions = np.concatenate([start + np.asarray(d, dtype=np.int64) for start, d in zip(starts_np, depths)])
    write_slots = np.concatenate(
        [pool.slots(table, start + np.arange(n)) for table, start, n in zip(tables, starts_np, counts)]
    )
    slots = np.array([slot or 0 for slot in state_slots] if state_slots is not None else [0] * len(starts_np), dtype=np.int64)
    return PassLayout(
        flat_tokens, positions, write_slots, np.concatenate(rows), offsets, starts_np, slots,
        [np.asarray(t, dtype=np.int64) for t in tables], [np.asarray(t, dtype=bool) for t in trees],
    )


def _decode_layout(
    pool: KVBlockPool,
    tokens: Sequence[Sequence[int]],  # B lists of one row token: the root
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    trees: Sequence[np.ndarray],
    state_slots: Sequence[int | None] | None,
) -> PassLayout:
    """:func:`pass_layout` of blocks of one row each (decode steps, the batches of many AR users),
    without its per-sequence array work: the engine thread builds it while the event loop needs
    the GIL to turn the last pass's answers around."""
    b = len(tokens)
    starts_np = np.fromiter(starts, dtype=np.int64, count=b)  # [B] and the rows' positions (depth 0)
    blocks = np.fromiter((table[start // pool.block_size] for table, start in zip(tables, starts)), dtype=np.int64, count=b)
    slots = [slot or 0 for slot in state_slots] if state_slots is not None else [0] * b
    return PassLayout(
        np.fromiter((t[0] for t in tokens), dtype=np.int64, count=b),
        starts_np,
        blocks * pool.block_size + starts_np % pool.block_size,
        -np.arange(1, b + 1, dtype=np.int64),  # each row is its block's root
        np.arange(b + 1, dtype=np.int64),
        starts_np.copy(),
        np.array(slots, dtype=np.int64),
        [np.asarray(t, dtype=np.int64) for t in tables],
        [np.asarray(t, dtype=bool) for t in trees],
    )


# PassInputs' fields in its byte buffer, in order: (name, dtype, shape in terms of N, B, T, S / block_size).
_FIELDS = (
    ("tokens", np.int64, lambda n, b, t, w: (n,)),
    ("positions", np.int64, lambda n, b, t, w: (n,)),
    ("write_slots", np.int64, lambda n, b, t, w: (n,)),
    ("row_index", np.int64, lambda n, b, t, w: (b, t)),
    ("out_index", np.int64, lambda n, b, t, w: (n,)),
    ("starts", np.int64, lambda n, b, t, w: (b,)),
    ("tables", np.int64, lambda n, b, t, w: (b, w)),
    ("last_row", np.int64, lambda n, b, t, w: (1,)),
    ("parents", np.int64, lambda n, b, t, w: (n,)),
    ("offsets", np.int64, lambda n, b, t, w: (b + 1,)),
    ("state_slots", np.int64, lambda n, b, t, w: (b,)),
    ("trees", np.bool_, lambda n, b, t, w: (b, t, t)),  # last: the int64 fields stay 8-byte aligned
)


@functools.cache
def _places(rows: int, sequences: int, block_rows: int, table_width: int) -> tuple[dict[str, tuple], int]:
    """Each field's (dtype, shape, byte offset, byte size) in the buffer of a pass of this shape, and
    the buffer's size (cached: a fixed-shape pass asks every step)."""
    places, offset = {}, 0
    for name, dtype, shape_of in _FIELDS:
        shape = shape_of(rows, sequences, block_rows, table_width)
        size = math.prod(shape) * np.dtype(dtype).itemsize
        places[name] = (dtype, shape, offset, size)
        offset += size
    return places, offset


@dataclass
class PassInputs:
    """The device side of a pass of fixed shape ``(N, B, T, S)``: what :meth:`PassInputs.attention`
    and the models read. Rows ``N`` and sequences ``B`` may include padding (pad rows of no sequence
    write to the pad block; pad sequences own only the pad block and the pad state slot 0). Every
    field is a view of one byte ``buffer``, so a pass's inputs reach the device in one copy.
    ``static``: the pass's shape is fixed and its buffers are reused (it may be captured as a CUDA
    graph), so a model must not read these tensors' values on the host or branch on them."""

    buffer: torch.Tensor  # [nbytes] uint8
    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    write_slots: torch.Tensor  # [N] int64
    row_index: torch.Tensor  # [B, T] int64 ragged row at (sequence, row), N for a pad
    out_index: torch.Tensor  # [N] int64 padded position s * T + j of each ragged row
    starts: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, S / block_size] int64, pad block past each sequence's blocks
    last_row: torch.Tensor  # [1] int64 the last real row (a prompt chunk projects only it to logits)
    parents: torch.Tensor  # [N] int64 as PassLayout.parents (-1 for pad rows)
    offsets: torch.Tensor  # [B + 1] int64 (pad sequences own no rows; pad rows, past offsets[B], no sequence)
    state_slots: torch.Tensor  # [B] int64 (0 for pad sequences)
    trees: torch.Tensor  # [B, T, T] bool
    block_size: int
    static: bool = False

    @staticmethod
    def nbytes(rows: int, sequences: int, block_rows: int, keys: int, block_size: int) -> int:
        return _places(rows, sequences, block_rows, keys // block_size)[1]

    @classmethod
    def on(
        cls, buffer: torch.Tensor, rows: int, sequences: int, block_rows: int, keys: int, block_size: int, static: bool = False
    ) -> PassInputs:
        """The inputs of a pass of this shape as views of ``buffer`` (uint8, at least :meth:`nbytes`)."""
        places, _ = _places(rows, sequences, block_rows, keys // block_size)
        views = {}
        for name, (dtype, shape, offset, size) in places.items():
            views[name] = buffer[offset : offset + size].view(torch.from_numpy(np.zeros(0, dtype)).dtype).view(shape)
        return cls(buffer, **views, block_size=block_size, static=static)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(N, B, T, S)``."""
        b, t = self.row_index.shape
        return self.tokens.shape[0], b, t, self.tables.shape[1] * self.block_size

    def fill(self, layout: PassLayout, host: np.ndarray, last_row: int = 0) -> None:
        """Write the bytes of the inputs of ``layout`` (which must fit the shape), padded, into
        ``host`` (uint8, laid out as ``buffer``); the caller copies them to the device."""
        n_pad, b_pad, t_pad, s_pad = self.shape
        places, _ = _places(n_pad, b_pad, t_pad, s_pad // self.block_size)
        f = {name: host[offset : offset + size].view(dtype).reshape(shape) for name, (dtype, shape, offset, size) in places.items()}
        n, b = layout.num_rows, layout.num_sequences
        f["tokens"][:n], f["tokens"][n:] = layout.tokens, 0
        f["positions"][:n], f["positions"][n:] = layout.positions, 0
        f["write_slots"][:n], f["write_slots"][n:] = layout.write_slots, PAD_BLOCK * self.block_size
        f["parents"][:n], f["parents"][n:] = layout.parents, -1
        f["row_index"][:] = n_pad  # the zero row past the last
        f["out_index"][:] = 0
        f["starts"][:] = 1  # a pad sequence: one committed position, in the pad block
        f["tables"][:] = PAD_BLOCK
        f["trees"][:] = np.eye(t_pad, dtype=bool)  # pad rows see themselves
        f["offsets"][: b + 1], f["offsets"][b + 1 :] = layout.offsets, n
        f["state_slots"][:b], f["state_slots"][b:] = layout.state_slots, 0
        f["last_row"][0] = last_row
        counts = np.diff(layout.offsets)  # [B]
        sequence = np.repeat(np.arange(b), counts)  # [n] each row's sequence
        within = np.arange(n) - layout.offsets[sequence]  # [n] each row's place in its block
        f["row_index"][sequence, within] = np.arange(n)
        f["out_index"][:n] = sequence * t_pad + within
        f["starts"][:b] = layout.starts
        for s in range(b):
            width = min(len(layout.tables[s]), f["tables"].shape[1])  # blocks past the pass's keys are not read
            f["tables"][s, :width] = layout.tables[s][:width]
            if counts[s] > 1 or not layout.trees[s][0, 0]:  # else a row that sees itself: the identity above
                f["trees"][s, : counts[s], : counts[s]] = layout.trees[s]

    @classmethod
    def exact(cls, layout: PassLayout, block_size: int, device: torch.device, last_row: int = 0) -> PassInputs:
        """Inputs of exactly the layout's shape (the eager pass), copied to ``device`` at once."""
        keys = -(-layout.max_keys // block_size) * block_size
        shape = (layout.num_rows, layout.num_sequences, layout.max_rows, keys, block_size)
        host = np.zeros(cls.nbytes(*shape), dtype=np.uint8)
        inputs = cls.on(torch.from_numpy(host), *shape)
        inputs.fill(layout, host, last_row)
        return inputs if device.type == "cpu" else cls.on(inputs.buffer.to(device), *shape)

    def attention(self) -> PassAttention:
        """What every attention layer of the pass reads, computed once per pass on the device."""
        _, b, t, s = self.shape
        cols = torch.arange(s, device=self.tables.device)
        key_slots = self.tables[:, cols // self.block_size] * self.block_size + cols % self.block_size  # [B, S]
        offset = cols[None, :] - self.starts[:, None]  # [B, S] column inside the sequence's block
        inside = (offset >= 0) & (offset < t)
        in_tree = self.trees.gather(2, offset.clamp(0, t - 1)[:, None, :].expand(b, t, s))  # [B, T, S]
        visible = (offset < 0)[:, None, :] | (inside[:, None, :] & in_tree)
        return PassAttention(
            self.write_slots, self.row_index, self.out_index, key_slots, visible, self.tables, self.starts, self.block_size
        )


@dataclass
class PassAttention:
    """Per-pass attention indices (see :meth:`PassInputs.attention`)."""

    write_slots: torch.Tensor  # [N] pool slot each ragged row's K/V is written to
    row_index: torch.Tensor  # [B, T] ragged row at each padded place (N: a zero row)
    out_index: torch.Tensor  # [N] padded place s * T + j of each ragged row
    key_slots: torch.Tensor  # [B, S] pool slot of each sequence's key positions
    visible: torch.Tensor  # [B, T, S] bool
    tables: torch.Tensor  # [B, S / block_size] int64 block tables (the native kernel reads keys through them)
    starts: torch.Tensor  # [B] int64 committed positions of each sequence
    block_size: int
    _key_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def key_rows(self, kv_heads: int, pool_slots: int) -> torch.Tensor:
        """[B * H_kv * S] the row of each sequence's keys, head by head, in a ``[H_kv, slots, D]`` pool
        flattened to ``[H_kv * slots, D]``: one ``index_select`` by them gathers the sequences' keys
        as a contiguous ``[B, H_kv, S, D]``. (Gathered along the slots instead, they came out
        strided, and the scores' matmul over them took 6x as long on a CPU: BENCHMARKS.md.) Computed
        once per pass and pool shape."""
        rows = self._key_rows.get((kv_heads, pool_slots))
        if rows is None:
            heads = torch.arange(kv_heads, device=self.key_slots.device) * pool_slots  # [H_kv]
            rows = self._key_rows[kv_heads, pool_slots] = (self.key_slots[:, None, :] + heads[None, :, None]).flatten()
        return rows
