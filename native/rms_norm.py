"""RMSNorm, and the residual add that precedes it, as one Triton launch per call.

A decoder layer ends each half with ``h = h + delta`` followed by the next RMSNorm: two kernels
(plus the norm's own reduction) per half, ~150 launches of a few µs each in a 36-layer decode
step. Here one program per row loads the row once, adds, rounds the sum to the storage dtype
(as the separate add would), and normalises it in float32.

Plain-torch reference: ``RMSNorm.forward`` (the CPU path in ``splitspec/models/layers.py``),
which the tests compare it with.

``gated_rms_norm`` is Gated DeltaNet's output norm, ``norm(x) * silu(z)`` (reference:
``GatedDeltaNet.output`` in ``splitspec/models/qwen35.py``): four launches a layer there (the
cast, the norm, the SiLU, the product), one here, each rounding to the storage dtype where the
reference rounds.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, N, eps,
        BLOCK: tl.constexpr, ADD: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * N + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (xf * inv * w).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, z_ptr, z_stride, heads, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (token, head) of x [T, H, N]; z's tokens are z_stride apart
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        z = tl.load(z_ptr + (row // heads) * z_stride + (row % heads) * N + cols, mask=ok, other=0.0)
        xf = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(z.dtype).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        normed = (xf * inv * w).to(z.dtype).to(tl.float32)
        zf = z.to(tl.float32)
        gate = (zf / (1.0 + tl.exp(-zf))).to(z.dtype).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (normed * gate).to(z.dtype), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else y
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, y, total, n, eps,
        BLOCK=block, ADD=residual is not None, num_warps=max(1, min(16, block // 512)),
    )
    return y, total


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows the kernel takes: contiguous, a float dtype, a row of at most 16384 values."""
    return x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[-1] <= 16384 \
        and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, statistics in float32."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + delta), residual + delta)``: the sum rounded to the input dtype first."""
    return _launch(delta, residual, weight, eps)


def gated_supported(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    """``gated_rms_norm``'s operands: x [T, H, N] contiguous, z [T, H, N] with contiguous heads
    (its tokens may lie a fused projection's width apart), both of a float dtype the kernel rounds to."""
    narrow = (torch.bfloat16, torch.float16, torch.float32)
    return (x.is_contiguous() and x.dtype in narrow and z.dtype in narrow and weight.is_contiguous()
            and z.stride(2) == 1 and z.stride(1) == z.shape[2] and x.shape == z.shape and x.shape[-1] <= 16384)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x.to(z.dtype)) * silu(z)`` -> [T, H, N] of z's dtype, each step rounded to it."""
    t, heads, n = x.shape
    y = torch.empty(x.shape, dtype=z.dtype, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        _gated_rms_norm_kernel[(t * heads,)](
            x, z, z.stride(0), heads, weight, y, n, eps, BLOCK=block, num_warps=max(1, min(16, block // 512)),
        )
    return y
