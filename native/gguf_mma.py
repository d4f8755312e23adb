"""``y = x @ W^T`` from Q4_K, Q6_K and IQ4_XS blocks on tensor cores, for 1 to 64 bf16 rows (CUDA C++).

Decode and tree verify multiply a few rows by every weight once, so their time is the weight's
bytes over the card's bandwidth, provided that expanding the bytes costs fewer instructions than
the memory system takes to deliver them. ``native.gguf_matmul``'s Triton kernels reach 27-32% of
copy bandwidth at one row and take 2.3-4.0x that time at 23 rows on ``tl.dot`` tiles (27B shapes,
BENCHMARKS.md). The kernels here take the weights as the file's blocks (Q4_K's and Q6_K's at
most moved at load, 16 features' super-blocks side by side: ``gguf_matmul.interleave``) into
registers and feed ``mma.sync.m16n8k16`` without a tile of expanded weights in shared
memory, so the tensor cores take 8 or 16 rows of x for the price of one.

**Q4_K and Q6_K** (``gguf_q4k.cu``, ``gguf_q6k.cu``: nearly all of a Q4_K_M file's bytes): the
weights are the A operand, 16 features a warp, x the B operand, 8 rows an n-tile. Q4_K: a lane
turns two 4-bit values into the fp16 integers sc * q exactly with one OR into fp16 1024 + q and
one packed fused multiply-add, about 1.4 instructions a value; the sub-blocks' minimums go
through a second mma against x's 32-value sums. Q6_K: a byte permute puts two 4-bit low parts
under their 2-bit high parts, one LOP3 makes fp16 1024 + 16 q and one packed fused multiply-add
sc (q - 32), about two instructions a value; its 2-byte aligned blocks are loaded as aligned
8-byte pairs of words (up to 8 rows; 32-bit words above, where registers are short) and
funnel-shifted. In both, the super-block's d and x's scale are applied in float32 once
a super-block. A launch before the matmul writes x as fp16 scaled by a power of two per row and
256 values (so fp16's range holds every value and sum) in the operand's order; on sm_90 the
matmul is launched as that launch's programmatic dependent, so its blocks start and load their
first weights while x is prepared (about 4% of the 27B decode step on an H100, BENCHMARKS.md).
From 17 rows a block copies each super-block's x into shared memory once for its warps
(``XStages`` in ``gguf_mma.cuh``: 7-17% off the 27B verify's 23-row calls, BENCHMARKS.md [Z2]),
six of them on Q4_K's interleaved blocks (8-17% off again at 23-32 rows, [K10]).

**x made inside its preparation** (``produce``). Each Q4_K/Q6_K matmul launch is preceded by x's
preparation, and x by its producer: an RMSNorm (after the residual add), or SwiGLU's activation,
each a launch of its own that writes x only for the preparation to read it back. A producer linked
to its readers' block type (``splitspec.models.quantized.link_producers``) runs inside the
preparation instead: ``gguf_prepare`` computes x's values from the producer's inputs as it stages
them, so one launch does both (about 190 fewer a 27B decode step). A norm's 1 / rms needs its
whole row, so a norm's preparation runs a block a row: its warps stage x * weight a super-block
at a time and add their squares in shared memory, and 1 / rms multiplies the row's scales, which
the matmul multiplies its float32 sums by anyway. So the matmul is unchanged, and x enters it as
fp16 of x * weight (11 significant bits) where the separate norm rounded x * w / rms to bf16 (8)
first: the results differ from the separate launches' in their last bits (not bit for bit, the
residual sum and SwiGLU's activation aside, which round as their kernels do). The tensor the
producer returns is only a placeholder carrying the arrays (``Prepared``): every reader of it
must be a quantized matmul (``link_producers`` links only such producers), and a reader of
another block type or kernel gets the values from the producer's own kernels. Up to 32 rows (one
launch's rows). Off unless ``SPLITSPEC_NATIVE_ON=gguf_prepare``: on an H100 a first form (a warp
a row and super-block, the row's last warp to finish folding 1 / rms in after a fence and an
atomic) removed 192 of a 27B decode step's 1,122 launches but took as long (BENCHMARKS.md
[K17]), its preparations 4.0 µs a launch against 1.8 apart; the block-a-row form is not yet
measured. On the CPU the same switch runs the reference path, which CI runs through the services
with NaN placeholders.

**IQ4_XS** (``gguf_mma.cu``): each lane expands its bytes to float32 in registers (a byte
permute, a subtract and one fused multiply-add a value, exact as the dequantizer's arithmetic)
and rounds them to bf16 straight into the B operand, x (permuted once per call into the A
operand's order) being the A operand. Its 4-bit values index sixteen non-linear levels: a lane
looks four of them up at once with three byte permutes of the level table held in registers.

Numerics. x is exact wherever its value lies within 2^-24 of its 256-value block's largest (fp16
then holds bf16's 8 bits), products are exact and sums float32. Q4_K: every weight is exact (d *
sc * q - dmin * m with the products in float32, not rounded to bf16). Q6_K: d * fp16(sc (q - 32)),
the integer product rounded to fp16 (exact up to 2048 in magnitude, 11 significant bits above, of
at most 4096), d applied in float32: 8x closer than a bf16 copy. IQ4_XS: each weight is the
dequantizer's float32 value rounded to bf16 (as a bf16 model holds it, and as ``gguf_matmul``'s
``tl.dot`` path rounds it), products accumulate in float32. A row's result does not depend on the
other rows (M) nor on the run: K is split over programs by the shape only, and split partial sums
are added in split order by whichever program finishes last; so a verify pass's logits equal a
decode step's bit for bit.

Built at first use with ``torch.utils.cpp_extension`` (nvcc, for the GPU at hand; cached under
``TORCH_EXTENSIONS_DIR``); where it cannot be built or the GPU predates bf16 tensor cores (sm_80),
``gguf_matmul`` keeps its Triton kernels. ``SPLITSPEC_NATIVE_OFF=gguf_mma`` turns it off, and
``SPLITSPEC_NATIVE_OFF=gguf_mma_pdl`` builds it without the dependent launch (each matmul waits
for its x preparation to finish: a benchmark's comparison, for one, of a graph's launch time).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from native import sm_count, switched_off, switched_on, use_triton

log = logging.getLogger(__name__)

MMA_TYPES = {Q.Q4_K: 12, Q.Q6_K: 14, Q.IQ4_XS: 23}  # gguf's type numbers, as the extension takes them
ALIGNMENT = {Q.Q4_K: 16, Q.Q6_K: 2, Q.IQ4_XS: 8}  # bytes: the kernel's loads of a row's blocks
MAX_ROWS = 64
WARPS = 4  # warps per program (kWarps in gguf_mma.cuh)
A_OPERAND_TYPES = (Q.Q4_K, Q.Q6_K)  # their kernels take the weights as the A operand, 32 rows of x a launch
A_OPERAND_FEATURES = 16 * WARPS  # features a program of those kernels computes
MAX_TILES = 1 << 15  # programs along N that the split counters cover (a 248K vocabulary at 1 tile: 7,760)
SOURCES = [Path(__file__).with_name(name) for name in ("gguf_mma.cu", "gguf_q4k.cu", "gguf_q6k.cu")]
SILU_MUL, NORM, ADD_NORM = 1, 2, 3  # x's producers that ``gguf_prepare`` computes (mma_common::SourceKind)
PREPARED_MAX_ROWS = 32  # the rows of one launch of the A-operand kernels


def default_n_tiles(m: int) -> int:
    """8-feature tiles per warp of the IQ4_XS kernel for ``m`` rows: 1 up to 32 rows (2-16% faster
    there on the 27B and 8B layers of an H200, ``scripts/gpu_gguf_mma.py``, BENCHMARKS.md), 2
    above, where the tensor-core work per loaded byte grows. The Q4_K and Q6_K kernels have one shape."""
    return 1 if m <= 32 else 2


@functools.cache
def _extension(min_blocks: int):
    """The compiled extension, or None (logged once) where it cannot be built. ``min_blocks`` > 0
    builds a variant whose IQ4_XS kernel must fit that many blocks a multiprocessor (benchmarks).
    (No default: the cache keys ``f()`` and ``f(0)`` apart, and each loaded the extension again.)"""
    dependent = not switched_off("gguf_mma_pdl")
    name = "splitspec_gguf_mma" + (f"_mb{min_blocks}" if min_blocks else "") + ("" if dependent else "_nopdl")
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        log.info("building %s for this GPU (first use; later starts load it from %s)",
                 " and ".join(s.name for s in SOURCES), _get_build_directory(name, verbose=False))
        flags = ["-O3"] + ([f"-DMIN_BLOCKS={min_blocks}"] if min_blocks else []) + ([] if dependent else ["-DMMA_PDL=0"])
        return load(name=name, sources=[str(s) for s in SOURCES], extra_cuda_cflags=flags, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the Triton kernels
        log.warning("gguf_mma not built (%s: %s); quantized matmuls use the Triton kernels", type(exc).__name__, str(exc)[-500:])
        return None


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def usable(x: torch.Tensor, raw: torch.Tensor, qtype: Q) -> bool:
    """Whether ``matmul`` takes x [M, K] (rows contiguous) and ``raw``: a Q4_K/Q6_K/IQ4_XS weight, bf16 x
    of 1-64 rows on a CUDA GPU with bf16 tensor cores, aligned as the kernels load, and built."""
    if qtype not in MMA_TYPES or x.dtype != torch.bfloat16 or not x.is_cuda or not 1 <= x.shape[0] <= MAX_ROWS:
        return False
    if not use_triton(x, "gguf_mma") or not _capable(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return False
    aligned = ALIGNMENT[qtype]
    if raw.data_ptr() % aligned or raw.stride(0) % aligned:
        return False
    if qtype not in A_OPERAND_TYPES and (x.data_ptr() % 4 or x.stride(0) % 2):  # the others: ``matmul`` aligns x itself
        return False
    return _extension(0) is not None


def runs_on(device: torch.device) -> bool:
    """Whether ``matmul`` can run on ``device`` at all (a CUDA GPU with bf16 tensor cores, the
    kernels not switched off, the extension built): what ``usable`` asks beyond the call's shapes."""
    if device.type != "cuda" or not use_triton(torch.empty(0, device=device), "gguf_mma"):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device()) and _extension(0) is not None


def default_splits(n_programs: int, super_blocks: int, sms: int) -> int:
    """How many programs share one tile's K range, for ``n_programs`` tiles of one n-tile a warp
    (IQ4_XS): enough for about four programs a multiprocessor (so the last wave leaves
    little idle), each keeping two super-blocks at least."""
    wanted = -(-4 * sms // n_programs)  # ceil
    return max(1, min(wanted, super_blocks // 2, 32))


def a_operand_splits(n_programs: int, super_blocks: int, sms: int) -> int:
    """The same for the Q4_K and Q6_K kernels' ``n_programs`` tiles of 64 features: about 2.5
    programs a multiprocessor, the best of 1, 2 and 4 splits (or within 7% of it) at 1 and 23 rows
    on the 27B and 8B layer shapes (Q4_K on an H200, Q6_K on an H100: BENCHMARKS.md); their
    programs hold three to four times the registers."""
    wanted = round(2.5 * sms / n_programs)
    return max(1, min(wanted, super_blocks // 2, 32))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of split programs, one per program along N, zero between launches (the last
    program of a tile resets its own). Made by the first call on a device, which must come before
    any CUDA graph capture, as the extension's build must (the engines' warm-up runs each shape
    eagerly first). One matmul at a time a device: the engines run their passes in one stream."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, out_features: int, n_tiles: int = 0,
           splits: int = 0, min_blocks: int = 0, interleaved: bool = False, prepared: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T for W [out_features, K] in ``raw`` blocks -> [M, out_features] bf16
    (``usable`` must hold); ``interleaved``: Q4_K or Q6_K blocks in ``gguf_matmul.interleave``'s layout;
    ``prepared``: x's arrays for ``qtype`` (``Prepared.arrays_for``), which are read instead of x.
    ``n_tiles`` (1 or 2; 0: ``default_n_tiles``), ``splits`` (0: ``default_splits``/``a_operand_splits``)
    and ``min_blocks`` (``_extension``) are for benchmarks."""
    M, K = x.shape
    one_tile_programs = -(-out_features // (WARPS * 8))
    if one_tile_programs > MAX_TILES:
        raise ValueError(f"{out_features} features need {one_tile_programs} programs, more than the {MAX_TILES} counters")
    # Splits follow the shape alone, not M or n_tiles: a row's sums then run in the same order
    # whatever else is in the batch, so a verify pass's logits equal a decode step's bit for bit.
    if qtype in A_OPERAND_TYPES:
        splits = splits or a_operand_splits(-(-out_features // A_OPERAND_FEATURES), K // 256, sm_count(x.device))
        if x.data_ptr() % 16 or x.stride(0) % 8:
            x = x.clone(memory_format=torch.contiguous_format)  # the kernel reads x 16 bytes at a time; a fresh copy is aligned
        partial_rows = min(M, 32)  # the kernel takes 32 rows at a time
    else:
        splits = splits or default_splits(one_tile_programs, K // 256, sm_count(x.device))
        partial_rows = M
    n_tiles = n_tiles or default_n_tiles(M)
    out = torch.empty(M, out_features, dtype=torch.bfloat16, device=x.device)
    partial = torch.empty(splits, partial_rows, out_features, dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = _counters(x.device)  # made at the first call, whatever its splits: before any capture
    _extension(min_blocks).gguf_mma(x, raw, out, partial, counters, MMA_TYPES[qtype], splits, n_tiles, interleaved, prepared or [])
    return out


@dataclass(frozen=True, eq=False)
class Producer:
    """The launch that makes x, as ``produce`` takes it: ``kind`` SILU_MUL (``a`` the fused
    gate/up projection's output [M, 2K]), NORM (RMSNorm of ``a`` [M, K] by ``weight``) or
    ADD_NORM (the same of ``a + b``, the residual step before a norm). ``plain()``: what the
    launch itself returns, (x, the residual sum or None), for readers that are no Q4_K/Q6_K
    matmul (and as the reference path's values)."""

    kind: int
    a: torch.Tensor
    plain: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    b: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    eps: float = 0.0


@dataclass(eq=False)
class Prepared:
    """What ``produce`` attaches to the placeholder x it returns: x's arrays for the Q4_K/Q6_K
    matmul of ``qtype`` (the kernel's; empty on the reference path, where ``values`` holds x
    instead), the residual sum (ADD_NORM), and x for any other reader on demand."""

    producer: Producer
    qtype: Q
    arrays: list[torch.Tensor]
    total: torch.Tensor | None = None
    values: torch.Tensor | None = None
    _others: dict[Q, list[torch.Tensor]] = field(default_factory=dict)

    def arrays_for(self, qtype: Q) -> list[torch.Tensor]:
        """x's arrays for a Q4_K or Q6_K matmul: ``arrays``, or for the other type made once more
        from the producer's inputs (a norm's residual sum is not added again)."""
        if qtype == self.qtype:
            return self.arrays
        if qtype not in self._others:
            p = self.producer
            if p.kind == ADD_NORM:
                p = Producer(NORM, self.total, p.plain, weight=p.weight, eps=p.eps)
            self._others[qtype] = _prepare(p, qtype)
        return self._others[qtype]

    def plain(self) -> torch.Tensor:
        """x itself, made once by the producer's own launch, for readers that take x's values."""
        if self.values is None:
            self.values = self.producer.plain()[0]
        return self.values


def _width(kind: int, a: torch.Tensor) -> int:
    """x's width from its producer's input ``a`` (SwiGLU's: gate and up side by side)."""
    return a.shape[-1] // 2 if kind == SILU_MUL else a.shape[-1]


def _prepare(p: Producer, qtype: Q, total: torch.Tensor | None = None) -> list[torch.Tensor]:
    return _extension(0).gguf_prepare(MMA_TYPES[qtype], p.kind, p.a, p.b, p.weight, total, p.eps, _width(p.kind, p.a))


def produces(kind: int, a: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether ``produce`` takes a producer of ``kind`` with input ``a`` (and ``others``: a norm's
    weight, the residual): 1-32 rows of x of whole 256-value blocks, bf16 rows 16-byte aligned on
    a GPU (the CPU's reference path takes any float dtype), where ``prepares_on`` the device."""
    if a.dim() != 2 or not 1 <= a.shape[0] <= PREPARED_MAX_ROWS or a.shape[1] % (512 if kind == SILU_MUL else 256):
        return False
    if not prepares_on(a.device) or (torch.is_grad_enabled() and any(t.requires_grad for t in (a, *others))):
        return False
    return not a.is_cuda or all(
        t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.dim() == 1 or t.stride(0) % 8 == 0)
        for t in (a, *others))


def prepares_on(device: torch.device) -> bool:
    """Whether ``produces`` can hold on ``device`` at all: where ``SPLITSPEC_NATIVE_ON=gguf_prepare``
    asks for it (on a GPU it has not yet beaten the launches apart: BENCHMARKS.md [K17]) and
    ``SPLITSPEC_NATIVE_OFF`` does not name it, on a GPU where ``runs_on``, or on the CPU by the
    reference path."""
    if not switched_on("gguf_prepare") or switched_off("gguf_prepare"):
        return False
    return device.type != "cuda" or runs_on(device)


def produce(p: Producer, qtype: Q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x's producer ``p`` run inside x's preparation for the Q4_K or Q6_K matmul of ``qtype``
    (``produces`` must hold for its inputs) -> (x, the residual sum for ADD_NORM else None). x
    [M, K] is a placeholder: its values are only in the arrays attached to it (``prepared_for``),
    which the matmuls read. On the reference path (the CPU) the values are ``p.plain()``'s, and
    the placeholder is NaN, so that a reader that is no matmul shows. The sum is written."""
    M, K = p.a.shape[0], _width(p.kind, p.a)
    if not p.a.is_cuda:
        values, total = p.plain()
        x = torch.full((M, K), float("nan"), dtype=p.a.dtype)
        x._splitspec_prepared = Prepared(p, qtype, [], total, values)
        return x, total
    total = torch.empty(p.a.shape, dtype=p.a.dtype, device=p.a.device) if p.kind == ADD_NORM else None
    x = torch.empty(M, K, dtype=p.a.dtype, device=p.a.device)
    x._splitspec_prepared = Prepared(p, qtype, _prepare(p, qtype, total), total)
    return x, total


def prepared_for(x: torch.Tensor) -> Prepared | None:
    """The ``Prepared`` of a placeholder that ``produce`` returned (None for any other tensor: a
    view or copy of it has none, and must not be made)."""
    return getattr(x, "_splitspec_prepared", None)
