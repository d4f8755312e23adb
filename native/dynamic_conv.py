"""A DFlash2 draft's two-tap dynamic convolution (``DynamicConv`` in splitspec/models/dflash2.py) in
one launch.

Unfused, one side of one convolution is about ten small kernels (the coefficients' cast and
repeat over each group's channels, the base kernel's add, the input's cast, the shifted copy,
the multiplies and adds, the cast back); a draft layer has four. The kernel reads the input, the
row's coefficients and the base kernel once and writes the output: ``out[r, c] = sum_j (base[j, c]
+ coeff[r, j, c // G]) * x[r - j, c]``, ``x[r - j] = 0`` before the row's block starts, in float32,
rounded once to the input's dtype, as the reference.
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
        x_ptr, coeff_ptr, base_ptr, out_ptr, H, coeff_row_stride, block_size,
        TAPS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    ):
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
        tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def supported(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor) -> bool:
    """Rows of ``x`` [..., Q, H] contiguous; ``coefficients`` [..., Q, taps, H / G] rows of one stride."""
    return (
        x.is_contiguous() and base.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and coefficients.stride(-1) == 1 and coefficients.stride(-2) == coefficients.shape[-1]
        and coefficients.flatten(0, -3).stride(0) >= coefficients.shape[-2] * coefficients.shape[-1]
    )


def dynamic_conv(x: torch.Tensor, coefficients: torch.Tensor, base: torch.Tensor, group: int, block_size: int) -> torch.Tensor:
    """x [..., Q, H] (Q a whole number of blocks), one side's ``coefficients`` [..., Q, taps, H / G]
    and ``base`` kernel [taps, H] -> the convolution [..., Q, H] in x's dtype."""
    h = x.shape[-1]
    taps = base.shape[0]
    rows = x.numel() // h
    flat = coefficients.flatten(0, -3)  # [rows, taps, H / G]: a view (strides checked by supported)
    out = torch.empty_like(x)
    _dynamic_conv_kernel[(rows, triton.cdiv(h, BLOCK))](
        x, flat, base, out, h, flat.stride(0), block_size, TAPS=taps, GROUP=group, BLOCK=BLOCK, num_warps=4,
    )
    return out
