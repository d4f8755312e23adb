"""Gated DeltaNet prefill over a chain by a chunked kernel: flash-linear-attention's on CUDA, else ours.

:func:`chunk_prefill` has exactly the contract of
:func:`splitspec.models.delta_rule.gated_delta_chunked` (same arguments, shapes, pre-normalised
and pre-scaled ``q``, float32 math, returns ``(out, final_state)`` in the math dtype), plus the
keyword ``fallback``: the torch chunked form itself, which the caller hands over because native/
knows no model code (``tests/test_layout.py``). It picks who computes the prefill:

fla
    ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` from the ``fla-core`` package (the ops of
    flash-linear-attention; ``pip install 'splitspec[gpu]'``): Triton kernels of the same chunked
    (WY) form, one launch per stage over all chunks and heads instead of a Python loop of small
    torch ops per chunk. CUDA only: its kernels autotune by timing on a GPU, and under Triton's
    CPU interpreter (``TRITON_INTERPRET=1``, triton 3.6) they do not run (the autotuner needs a GPU
    driver; with that bypassed, the intra-chunk solve kernel fails on a loop bound it computes from
    a program id).
torch
    ``fallback``: :func:`splitspec.models.delta_rule.gated_delta_chunked`, the plain-torch chunked
    form, which is also the reference.

``SPLITSPEC_DELTA_PREFILL`` = ``auto`` (default) | ``fla`` | ``torch`` chooses, read at call time
(benchmarks flip it between calls). ``auto`` takes fla for CUDA tensors when it imports, the math
is not float64, ``Dk <= 256`` and the chunk is 16, 32 or 64 (what fla's kernels take), and
``native.use_triton`` lets kernels run (``SPLITSPEC_NATIVE=0`` or
``SPLITSPEC_NATIVE_OFF=chunked_delta_rule`` turn it off); otherwise torch. ``fla`` forces it and
raises a ``RuntimeError`` saying why where it cannot run (CPU tensors, fla missing, float64, those
shapes), rather than quietly measuring the other path.

fla's conventions and how the call maps onto them
--------------------------------------------------
- Layout ``[B, T, H, D]`` (sequence-major, not head-first; ``head_first`` was removed): ours is
  ``[T, H, D]``, so a batch axis of one is added. ``g`` and ``beta`` are ``[B, T, HV]``.
- ``g``: natural-log decay per token and value head (fla rescales it to log2 itself), as ours.
  ``beta``: post-sigmoid write strength (``use_beta_sigmoid_in_kernel=False``), as ours.
- q/k: fla can L2-normalise them (``use_qk_l2norm_in_kernel``) and scales q by ``scale``
  (``None`` = ``Dk ** -0.5``). Ours arrive normalised and scaled, so: no in-kernel norm,
  ``scale=1.0``.
- Grouped value heads: q/k may have ``H`` heads with ``HV = G * H`` value heads, value head ``h``
  reading key head ``h // G`` (``repeat_interleave``'s order). Our q/k come with every value head's
  copy already, so ``H = HV`` here.
- State ``[N, HV, Dk, Dv]`` (``state_v_first=False``), read as float32; the final state comes back
  float32 and the output in q's dtype.
- Precision: its products run on tensor cores (tf32 for float32 inputs, its triangular solve
  explicitly; bf16 inputs also keep the per-chunk states in bf16), so expect float32 inputs to
  differ from the float32 torch path at tf32's ~1e-3, not float32's ~1e-6;
  ``scripts/gpu_delta_prefill.py`` measures it at the Qwen3.5-27B geometry.
- Written against fla-core 0.6.0 (needs torch >= 2.7, triton >= 3.3, einops; Python >= 3.10).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from native import use_triton

__all__ = ["ENV", "MODES", "chunk_prefill", "choose_backend", "fla_kernel", "fla_prefill", "prefill_backend"]

ENV = "SPLITSPEC_DELTA_PREFILL"
MODES = ("auto", "fla", "torch")
FLA_CHUNKS = (16, 32, 64)  # the chunk sizes fla's gated delta rule kernels take
FLA_MAX_DK = 256  # its state kernel holds at most four 64-wide key tiles
KERNEL_NAME = "chunked_delta_rule"  # for SPLITSPEC_NATIVE_OFF
INSTALL_HINT = "pip install 'splitspec[gpu]' (or fla-core and einops; offline: the wheels in .whl/fla, see scripts/gpu_delta_prefill.py)"


@functools.cache
def fla_kernel() -> tuple[Callable | None, str]:
    """fla's ``chunk_gated_delta_rule`` and ``""``, or ``None`` and why it did not import. Imported
    once, lazily: only a CUDA prefill asks, and importing fla loads all of its ops (seconds)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:  # ModuleNotFoundError (fla, einops) or a broken install
        return None, f"{type(exc).__name__}: {exc}"
    return chunk_gated_delta_rule, ""


def choose_backend(mode: str, *, on_cuda: bool, fla_error: str, math_dtype: torch.dtype, dk: int, chunk: int, kernels_on: bool = True) -> str:
    """``"fla"`` or ``"torch"`` for a call, from the switch's ``mode`` and the facts about it:
    ``on_cuda`` (the tensors' device), ``fla_error`` (``""`` when fla imported, else why not),
    ``math_dtype``, the key width ``dk``, the ``chunk`` size and ``kernels_on``
    (``native.use_triton``). ``auto`` falls back to torch; ``fla`` raises where fla cannot run."""
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "torch":
        return "torch"
    why_not = []
    if not on_cuda:
        why_not.append("the tensors are not on a CUDA device (fla's Triton kernels do not run on the CPU, not even under TRITON_INTERPRET=1)")
    elif fla_error:
        why_not.append(f"flash-linear-attention does not import ({fla_error}); {INSTALL_HINT}")
    if math_dtype == torch.float64:
        why_not.append("the math is float64 (fla computes in float32 at most)")
    if dk > FLA_MAX_DK:
        why_not.append(f"Dk = {dk} > {FLA_MAX_DK}")
    if chunk not in FLA_CHUNKS:
        why_not.append(f"chunk = {chunk} is not one of {FLA_CHUNKS}")
    if mode == "fla":
        if why_not:
            raise RuntimeError(f"{ENV}=fla, but fla's chunked kernel cannot run here: " + "; ".join(why_not))
        return "fla"
    return "fla" if not why_not and kernels_on else "torch"


def prefill_backend(v: torch.Tensor, dk: int, chunk: int = 64) -> str:
    """The backend :func:`chunk_prefill` takes for values like ``v`` ``[T, H, Dv]`` and key width ``dk``
    under the current ``SPLITSPEC_DELTA_PREFILL``."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    kernels_on = use_triton(v, KERNEL_NAME)
    # Import fla only where it could run: a CPU call, torch, or auto with kernels off never touch it.
    wanted = v.is_cuda and (mode == "fla" or (mode == "auto" and kernels_on))
    fla_error = fla_kernel()[1] if wanted else "not imported"
    return choose_backend(
        mode, on_cuda=v.is_cuda, fla_error=fla_error, math_dtype=torch.promote_types(v.dtype, torch.float32),
        dk=dk, chunk=chunk, kernels_on=kernels_on,
    )


def fla_prefill(
    kernel: Callable,
    q: torch.Tensor,  # [T, H, Dk] normalised and scaled
    k: torch.Tensor,  # [T, H, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv]
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_prefill` through ``kernel``, a function with the signature and conventions of
    fla's ``chunk_gated_delta_rule`` (module docstring): our layout and conventions in, theirs out."""
    math = torch.promote_types(v.dtype, torch.float32)
    # q, k, v share one dtype (their tensor-core products need it); the gates go in float32.
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    out, final = kernel(
        q.to(dtype)[None], k.to(dtype)[None], v.to(dtype)[None],  # [1, T, H, D]
        g.float()[None], beta.to(dtype)[None],  # [1, T, H]
        scale=1.0,  # q comes scaled by Dk ** -0.5 already
        initial_state=state.float()[None],  # [1, H, Dk, Dv]
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,  # q and k come normalised already
        chunk_size=chunk,
    )
    return out[0].to(math), final[0].to(math)  # [T, H, Dv], [H, Dk, Dv]


def chunk_prefill(
    q: torch.Tensor,  # [T, H, Dk] normalised and scaled
    k: torch.Tensor,  # [T, H, Dk] normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log-decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] the state before the chain
    chunk: int = 64,
    *,
    fallback: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[T, H, Dv]`` and the final state ``[H, Dk, Dv]`` (math dtype), as
    ``fallback(q, k, v, g, beta, state, chunk=chunk)`` (``gated_delta_chunked``) gives them: by fla's
    kernel where :func:`prefill_backend` says so, else by ``fallback``."""
    if v.shape[0] > 0 and prefill_backend(v, q.shape[-1], chunk) == "fla":
        return fla_prefill(fla_kernel()[0], q, k, v, g, beta, state, chunk)
    return fallback(q, k, v, g, beta, state, chunk=chunk)
