"""SwiGLU's activation ``silu(gate) * up`` straight from the fused gate/up projection, one launch.

Unfused it is a chunk, a SiLU and a multiply: two kernels and an intermediate tensor per layer.
The rounding follows the unfused path (SiLU rounded to the storage dtype, then the product): on
an H200 the kernel and its reference, ``SwiGLU.forward`` in ``splitspec/models/layers.py``, agreed
bit for bit in bf16 (``scripts/gpu_fused_kernels.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

BLOCK = 1024

if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(gate_up_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * I + I + cols, mask=ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(out_ptr + row * I + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=ok)


def supported(gate_up: torch.Tensor) -> bool:
    return gate_up.is_contiguous() and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate first, as the fused projection lays it out) -> [..., I]."""
    i = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * i)
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    _silu_mul_kernel[(rows, triton.cdiv(i, BLOCK))](gate_up, out, i, BLOCK=BLOCK, num_warps=4)
    return out
