"""A DFlash2 draft's dynamic convolution kernel against its plain-torch reference
(``DynamicConv.forward``), under Triton's interpreter on the CPU (tests/conftest.py turns it on)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.dflash2 import DynamicConv

pytest.importorskip("triton", reason="triton is not installed")

from native import dynamic_conv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 96), (2, 3, 16, 320)], ids=["one-block", "batched-blocks"])  # 320: a row past one program
@pytest.mark.parametrize("taps", [2, 3])
def test_the_kernel_matches_the_reference(dtype, shape, taps, monkeypatch):
    torch.manual_seed(0)
    h, block = shape[-1], 8
    conv = DynamicConv(h, taps, 16, block)
    torch.nn.init.normal_(conv.base_kernel, 0.5, 0.5)
    torch.nn.init.normal_(conv.kernel_projection.weight, 0.0, 0.3)
    conv.to(dtype)
    u, x = torch.randn(2, *shape, dtype=dtype)
    conv.requires_grad_(False)  # the kernel has no backward: autograd would run the reference
    coefficients = conv.coefficients(u)  # [..., Q, 2, taps, H / 16]
    outs = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        outs.append([conv(x, coefficients, side) for side in (0, 1)])
    assert dynamic_conv.supported(x, coefficients[..., 1, :, :], conv.base_kernel[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the interpreter truncates to bfloat16, a GPU rounds
    for got, want in zip(*outs):
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()
    # Each block's first row has no predecessor: it is its own row times tap 0 only.
    first = outs[0][0].unflatten(-2, (-1, block))[..., 0, :]
    k0 = conv.base_kernel[0, 0].float() + coefficients[..., 0, 0, :].repeat_interleave(16, -1).unflatten(-2, (-1, block))[..., 0, :]
    assert torch.allclose(first.float(), (k0 * x.unflatten(-2, (-1, block))[..., 0, :].float()).to(dtype).float(), atol=tol, rtol=tol)


def test_strided_inputs_take_the_reference(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
    conv = DynamicConv(32, 2, 16, 4)
    x = torch.randn(32, 8).t()  # not contiguous
    assert not dynamic_conv.supported(x, conv.coefficients(torch.randn(8, 32))[..., 0, :, :], conv.base_kernel[0].detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_add_norm_matches_the_unfused_calls(dtype, monkeypatch):
    """The output side's convolution, the residual add and the next norm in one launch, against
    the convolution's reference followed by ``RMSNorm.forward_add``'s reference."""
    from splitspec.models.layers import RMSNorm

    torch.manual_seed(1)
    h, block = 320, 8  # 320: not a power of two, so the row's tail is masked
    conv, norm = DynamicConv(h, 2, 16, block), RMSNorm(h, 1e-6)
    torch.nn.init.normal_(conv.base_kernel, 0.5, 0.5)
    torch.nn.init.normal_(conv.kernel_projection.weight, 0.0, 0.3)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    conv.to(dtype), norm.to(dtype)
    u, x, residual = torch.randn(3, 2, 16, h, dtype=dtype)
    with torch.inference_mode():
        coefficients = conv.coefficients(u)
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "1")
        assert dynamic_conv.add_norm_supported(x, coefficients[..., 1, :, :], conv.base_kernel[1], residual, norm.weight)
        fused = conv.add_norm(x, coefficients, 1, residual, norm)
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", "0")
        unfused = norm.forward_add(conv(x, coefficients, 1), residual)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(fused, unfused):
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()
    assert not dynamic_conv.add_norm_supported(x, coefficients[..., 1, :, :], conv.base_kernel[1], residual.double(), norm.weight)
