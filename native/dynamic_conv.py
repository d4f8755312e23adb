"""A DFlash2 draft's two-tap dynamic convolution (``DynamicConv`` in splitspec/models/dflash2.py) in
one launch.

Unfused, one side of one convolution is about ten small kernels (the coefficients' cast and
repeat over each group's channels, the base kernel's add, the input's cast, the shifted copy,
the multiplies and adds, the cast back); a draft layer has four. The kernel reads the input, the
row's coefficients and the base kernel once and writes the output: ``out[r, c] = sum_j (base[j, c]
+ coeff[r, j, c // G]) * x[r - j, c]``, ``x[r - j] = 0`` before the row's block starts, in float32,
rounded once to the input's dtype, as the reference.

``conv_add_rms_norm`` ends a sublayer: the output side's convolution, the residual add and the
next RMSNorm (``RMSNorm.forward_add``) in one launch, one program per row, each step rounded to
the storage dtype where the unfused calls round (the convolution's output, then the sum).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

BLOCK = 256  # channels per program

if triton is not None:

    @triton.jit
    def _dynamic_conv_kernel(
        x_ptr, coeff_ptr, base_ptr, out_ptr, res_ptr, w_ptr, sum_ptr, H, coeff_row_stride, block_size, eps,
        TAPS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, ADD_NORM: tl.constexpr,
    ):
        # ADD_NORM: one whole row a program (the norm needs all of it); out_ptr gets the norm,
        # sum_ptr the residual sum. Else out_ptr gets the convolution (res, w and sum unused).
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        in_block = row % block_size
        groups = H // GROUP
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            k = tl.load(base_ptr + j * H + cols, mask=ok, other=0.0).to(tl.float32)
            k += tl.load(coeff_ptr + row * coeff_row_stride + j * groups + cols // GROUP, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + (row - j) * H + cols, mask=ok & (in_block >= j), other=0.0).to(tl.float32)
            acc += k * x
        conv = acc.to(out_ptr.dtype.element_ty)
        if ADD_NORM:
            total = (conv.to(tl.float32) + tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)).to(conv.dtype)
            tl.store(sum_ptr + row * H + cols, total, mask=ok)
            tf = total.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(tf * tf, 0) / H + eps)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + cols, (tf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(out_ptr + row * H + cols, conv, mask=ok)

def supported(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor) -> bool:
    """Rows of ``x`` [..., Q, H] contiguous; ``coefficients`` [..., Q, taps, H / G] rows of one stride."""
    return (
        x.is_contiguous() and base.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and coefficients.stride(-1) == 1 and coefficients.stride(-2) == coefficients.shape[-1]
        and coefficients.flatten(0, -3).stride(0) >= coefficients.shape[-2] * coefficients.shape[-1]
    )


def add_norm_supported(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """``conv_add_rms_norm``'s operands: ``supported``'s, a contiguous residual of x's dtype and
    shape, and rows of at most 16384 values."""
    return (supported(x, coefficients, base) and residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape
            and weight.is_contiguous() and x.shape[-1] <= 16384)


def conv_add_rms_norm(
    x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor, group: int, block_size: int,
    residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + conv(x)), residual + conv(x))`` with ``conv`` as ``dynamic_conv``'s."""
    h = x.shape[-1]
    rows = x.numel() // h
    flat = coefficients.flatten(0, -3)
    y, total = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _dynamic_conv_kernel[(rows, 1)](
        x, flat, base, y, residual, weight, total, h, flat.stride(0), block_size, eps,
        TAPS=base.shape[0], GROUP=group, BLOCK=block, ADD_NORM=True, num_warps=max(1, min(16, block // 512)),
    )
    return y, total


def dynamic_conv(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor, group: int, block_size: int) -> torch.Tensor:
    """x [..., Q, H] (Q a whole number of blocks), one side's ``coefficients`` [..., Q, taps, H / G]
    and ``base`` kernel [taps, H] -> the convolution [..., Q, H] in x's dtype."""
    h = x.shape[-1]
    taps = base.shape[0]
    rows = x.numel() // h
    flat = coefficients.flatten(0, -3)  # [rows, taps, H / G]: a view (strides checked by supported)
    out = torch.empty_like(x)
    _dynamic_conv_kernel[(rows, triton.cdiv(h, BLOCK))](
        x, flat, base, out, x, base, out, h, flat.stride(0), block_size, 0.0,
        TAPS=taps, GROUP=group, BLOCK=BLOCK, ADD_NORM=False, num_warps=4,
    )
    return out
