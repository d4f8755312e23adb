"""Gated DeltaNet's per-row delta-rule inputs from the conv output and the b/a projections, in one launch.

The reference, ``GatedDeltaNet.project`` in ``splitspec/models/qwen35.py``, is a chain of small
torch operations: q and k converted to float32, L2-normalised (square, sum, add, rsqrt, multiply)
and q scaled by ``Dk^-0.5``; ``beta = sigmoid(b)``; ``g = ssm_a * softplus(a + dt_bias)``, each
parameter converted first. On a GPU that is about twenty launches a layer, a thousand in one
decode step of a 48-DeltaNet-layer model, each of them a few microseconds of launch for a few
kilobytes of work (the 27B step's kernel list, BENCHMARKS.md). Here one program per row computes
all four outputs in float32, with the reference's roundings in the reference's order (the norm's
sum aside, which adds in the kernel's order).
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
    def _log1p(e):
        """log(1 + e) accurate for small e (Goldberg's trick): log(u) * e / (u - 1), u = 1 + e rounded."""
        u = 1.0 + e
        exact = u == 1.0
        return tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))

    @triton.jit
    def _delta_inputs_kernel(
        mixed_ptr, mixed_stride, b_ptr, b_stride, a_ptr, a_stride, ssm_a_ptr, dt_bias_ptr,
        q_ptr, k_ptr, beta_ptr, g_ptr, HK, HV, scale, eps,
        DK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < HK) & (d < DK)
        at = h * DK + d  # [BLOCK_H, BLOCK_D] within q (then k, HK * DK further)
        q = tl.load(mixed_ptr + row * mixed_stride + at, mask=ok, other=0.0).to(tl.float32)
        k = tl.load(mixed_ptr + row * mixed_stride + HK * DK + at, mask=ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 1) + eps)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
        tl.store(q_ptr + row * HK * DK + at, q, mask=ok)
        tl.store(k_ptr + row * HK * DK + at, k, mask=ok)

        v = tl.arange(0, BLOCK_V)
        vok = v < HV
        b = tl.load(b_ptr + row * b_stride + v, mask=vok, other=0.0).to(tl.float32)
        tl.store(beta_ptr + row * HV + v, 1.0 / (1.0 + tl.exp(-b)), mask=vok)
        x = tl.load(a_ptr + row * a_stride + v, mask=vok, other=0.0).to(tl.float32)
        x = x + tl.load(dt_bias_ptr + v, mask=vok, other=0.0).to(tl.float32)
        soft = tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0))))  # F.softplus: x itself above its threshold 20
        g = tl.load(ssm_a_ptr + v, mask=vok, other=0.0).to(tl.float32) * soft
        tl.store(g_ptr + row * HV + v, g, mask=vok)


def supported(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> bool:
    """The kernel computes in float32: inputs of a wider dtype (float64 checks) take the reference."""
    narrow = (torch.bfloat16, torch.float16, torch.float32)
    return mixed.dtype in narrow and mixed.stride(-1) == 1 and b.stride(-1) == 1 and a.stride(-1) == 1


def delta_inputs(
    mixed: torch.Tensor,  # [T, C] conv output: q [Hk * Dk] | k [Hk * Dk] | v
    b: torch.Tensor,  # [T, Hv] write-strength logits (rows may be strided: a split of the fused projection)
    a: torch.Tensor,  # [T, Hv] decay inputs
    ssm_a: torch.Tensor,  # [Hv] -exp(A_log)
    dt_bias: torch.Tensor,  # [Hv]
    key_heads: int,
    key_dim: int,
    eps: float,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [T, Hk, Dk] (normalised, scaled by Dk^-0.5), k [T, Hk, Dk] (normalised), beta [T, Hv]
    and g [T, Hv], all float32. ``into``: contiguous float32 (k, g, beta) to write those three in."""
    t, hv = mixed.shape[0], b.shape[-1]
    q = torch.empty(t, key_heads, key_dim, dtype=torch.float32, device=mixed.device)
    if into is None:
        k = torch.empty_like(q)
        g = torch.empty(t, hv, dtype=torch.float32, device=mixed.device)
        beta = torch.empty_like(g)
    else:
        k, g, beta = into
        if not all(x.is_contiguous() and x.dtype == torch.float32 for x in into):
            raise ValueError("delta_inputs: `into` must be contiguous float32 tensors")
    if t:
        _delta_inputs_kernel[(t,)](
            mixed, mixed.stride(0), b, b.stride(0), a, a.stride(0), ssm_a, dt_bias, q, k, beta, g,
            key_heads, hv, key_dim**-0.5, eps,
            DK=key_dim, BLOCK_H=triton.next_power_of_2(key_heads), BLOCK_D=triton.next_power_of_2(key_dim),
            BLOCK_V=triton.next_power_of_2(hv), num_warps=4,
        )
    return q, k, beta, g
