"""GPU kernels (Triton, and one CUDA C++ extension) for the hot paths, each with a plain-torch
reference that runs on the CPU.

A kernel runs when its inputs are on a GPU (CUDA, or ROCm through the same Triton code), or on
the CPU when ``SPLITSPEC_NATIVE_CPU=1`` under Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is first imported), which is how CI checks kernels against their references;
otherwise the reference runs.

Kernels: ``qkv_rope`` (q/k norm, RoPE and K/V cache writes in one launch); ``rms_norm`` (RMSNorm
and the residual add before it); ``silu_mul`` (SwiGLU's activation); ``tree_attention`` (masked
grouped-query attention for decode and verify shapes); ``gguf_matmul``
(``x @ W^T`` with W kept in its GGUF blocks: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS) and ``QuantLinear``,
which hand Q4_K, Q6_K and IQ4_XS calls of 1-64 bf16 rows to ``gguf_mma`` (CUDA C++ on tensor cores,
built at first use with nvcc; checked on a GPU by ``scripts/gpu_gguf_mma.py``) and calls of
many rows to ``gguf_expand`` (the blocks expanded tile by tile for cuBLAS);
``tree_delta_rule`` (the tree-aware Gated DeltaNet conv and delta rule; references in
``splitspec.models.delta_rule``, which dispatches to them); ``tree_chunk_delta`` (a tree pass's
delta-rule outputs in chunked form, products over the block instead of a walk over its rows; off
unless ``SPLITSPEC_NATIVE_ON=tree_chunk_delta``: slower than the walk so far); ``delta_inputs`` (a Gated DeltaNet
row's normalised q and k, beta and log-decay in one launch); ``top_k`` (the draft's top-K of
log-softmax over the vocabulary in two launches); ``dynamic_conv`` (a DFlash2 draft's two-tap
dynamic convolution in one launch); ``selector`` (a DFlash2 draft's pair scores in one launch).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def use_triton(tensor: torch.Tensor, kernel: str = "", *weights: torch.Tensor) -> bool:
    """Whether a kernel should run for inputs like ``tensor``. ``SPLITSPEC_NATIVE=0`` turns every
    kernel off and ``SPLITSPEC_NATIVE_OFF=rms_norm,tree_attention`` the named ones (the
    plain-torch references run instead, on GPUs too: for comparisons and debugging). The switch
    is read at call time; a CUDA graph keeps the kernels it was captured with.

    The kernels have no backward pass: where autograd records the call (``tensor`` or one of the
    call's ``weights`` needs a gradient, as in ``splitspec train-draft``) the reference runs, so
    that gradients reach every parameter."""
    # The CPU's answer first: a CPU pass asks this ~40 times a step, and each lookup reads the environment.
    if not HAVE_TRITON or not (tensor.is_cuda or os.environ.get("SPLITSPEC_NATIVE_CPU") == "1"):
        return False
    if torch.is_grad_enabled() and (tensor.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return not switched_off(kernel)


def switched_off(name: str = "") -> bool:
    """Whether ``SPLITSPEC_NATIVE=0`` or ``SPLITSPEC_NATIVE_OFF`` (comma-separated) turns ``name`` off
    (a kernel, or a layout the kernels read: ``interleave``); ``name`` empty: only the first."""
    if os.environ.get("SPLITSPEC_NATIVE") == "0":
        return True
    return bool(name) and name in os.environ.get("SPLITSPEC_NATIVE_OFF", "").split(",")


def switched_on(name: str) -> bool:
    """Whether ``SPLITSPEC_NATIVE_ON`` (comma-separated) names ``name``: a kernel that stays off
    unless asked for (an experiment that has not yet beaten what it would replace on a GPU)."""
    return name in os.environ.get("SPLITSPEC_NATIVE_ON", "").split(",")


INTERPRETER_SMS = 132  # an H100/H200's multiprocessors: the CPU interpreter (CI) splits work as they would


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``, which kernels size their split of the work by."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
