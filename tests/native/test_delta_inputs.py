"""``native.delta_inputs`` (Gated DeltaNet's q, k, beta and g in one launch) against its reference,
``GatedDeltaNet.project``'s torch path, under Triton's interpreter on the CPU (tests/conftest.py
turns it on; the same kernel source runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.qwen35 import GatedDeltaNet, Qwen35Config

pytest.importorskip("triton", reason="triton is not installed")

from native import delta_inputs  # noqa: E402

TOL = 2e-6  # the outputs are float32 whatever the inputs


def config(key_heads: int, value_heads: int, key_dim: int) -> Qwen35Config:
    return Qwen35Config(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
        rotary_dim=8, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=key_dim,
        linear_value_head_dim=8,
    )


def layer(c: Qwen35Config, dtype: torch.dtype, fused: bool) -> GatedDeltaNet:
    torch.manual_seed(0)
    net = GatedDeltaNet(c)
    for p in net.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    with torch.no_grad():
        net.ssm_a.copy_(-torch.rand(c.linear_num_value_heads).exp())
        net.dt_bias.mul_(8.0)  # a + dt_bias over softplus's whole range, past its threshold 20 too
        net.in_proj_a.weight.mul_(8.0)
    net.to(dtype)
    if fused:  # b and a arrive as strided splits of the fused projection
        net.fuse()
    return net


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4, 16), (3, 6, 12)])  # (3, 6, 12): heads and dims short of their power-of-two blocks
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_matches_the_reference(dtype, heads, fused, monkeypatch):
    c = config(*heads)
    net = layer(c, dtype, fused)
    x = torch.randn(5, c.hidden_size, dtype=dtype)
    with torch.no_grad():
        if fused:  # b and a as the model gets them: strided splits of the fused projection
            _, _, b, a = net._in_proj(x).split([c.conv_channels, c.value_dim, c.linear_num_value_heads, c.linear_num_value_heads], dim=-1)
            assert b.stride(0) != b.shape[1]
        else:
            b, a = net.in_proj_b(x), net.in_proj_a(x)
        mixed = torch.randn(5, c.conv_channels, dtype=dtype)
        results = {}
        for native in ("1", "0"):
            monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
            results[native] = net.gates(mixed, b, a)
    for name, got, want in zip(("q", "k", "beta", "g"), results["1"], results["0"]):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.allclose(got, want, atol=TOL, rtol=TOL), (name, (got - want).abs().max())
    q, k, beta, g = results["0"]
    assert torch.allclose(k.norm(dim=-1), torch.ones(()), atol=1e-5)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()
    assert (net.dt_bias.float() + a.float() > 20).any()  # softplus's linear branch was taken


def test_the_projection_takes_the_kernel_in_float32(monkeypatch):
    """Through ``project`` (conv kernel and all): the same inputs as the torch path."""
    c = config(2, 4, 16)
    net = layer(c, torch.float32, True)
    rows = 5
    x = torch.randn(rows, c.hidden_size)
    history = torch.randn(c.conv_kernel - 1, c.conv_channels)
    ancestors = torch.tensor([[i - (c.conv_kernel - 1 - j) for j in range(c.conv_kernel)] for i in range(rows)])  # a chain
    results = {}
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        with torch.no_grad():
            results[native] = net.project(x, history, ancestors)
    for name in ("q", "k", "v", "beta", "g", "z"):
        got, want = getattr(results["1"], name), getattr(results["0"], name)
        assert torch.allclose(got, want, atol=TOL, rtol=TOL), (name, (got - want).abs().max())


def test_wide_dtypes_take_the_reference():
    x = torch.zeros(2, 8, dtype=torch.float64)
    assert not delta_inputs.supported(x, x[:, :2], x[:, 2:4])
    assert delta_inputs.supported(x.float(), x.float()[:, :2], x.float()[:, 2:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_gated_output_norm_matches_the_reference(dtype, fused, monkeypatch):
    """``GatedDeltaNet.output``: ``norm(out) * silu(z)`` by ``rms_norm.gated_rms_norm`` (z strided
    where it is a split of the fused projection) against the reference's four operations."""
    from splitspec.models.qwen35 import DeltaInputs

    c = config(3, 6, 12)
    net = layer(c, dtype, fused)
    x = torch.randn(4, c.hidden_size, dtype=dtype)
    with torch.no_grad():
        net.out_proj = torch.nn.Identity()  # compare the normed, gated rows themselves
        z = net._in_proj(x).split([c.conv_channels, c.value_dim, 6, 6], dim=-1)[1] if fused else net.in_proj_z(x)
        d = DeltaInputs(None, None, None, None, None, None, z)
        out = torch.randn(4, 6, c.linear_value_head_dim)  # the delta rule's float32 output
        results = {}
        for native in ("1", "0"):
            monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
            results[native] = net.output(d, out)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # the interpreter rounds bf16 by truncation (3 roundings), a GPU to nearest
    got, want = results["1"], results["0"]
    assert got.dtype == want.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("native", ["1", "0"])
def test_gates_write_into_the_kept_rows(native, monkeypatch):
    """A tree pass's k, g and beta land in ``TreeRows``' buffers, so ``record`` copies only the rest."""
    from splitspec.models.qwen35 import TreeRows

    c = config(2, 4, 16)
    net = layer(c, torch.float32, True)
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
    kept = TreeRows.empty(c, 8, torch.device("cpu"), torch.float32).head(5)
    x = torch.randn(5, c.hidden_size)
    with torch.no_grad():
        _, _, b, a = net._in_proj(x).split([c.conv_channels, c.value_dim, 4, 4], dim=-1)
        mixed = torch.randn(5, c.conv_channels)
        _, k, beta, g = net.gates(mixed, b, a, kept.gate_buffers(2))
        fresh = net.gates(mixed, b, a)
    assert k.data_ptr() == kept.keys[2].data_ptr() and g.data_ptr() == kept.decays[2].data_ptr()
    assert beta.data_ptr() == kept.betas[2].data_ptr()
    for got, want in zip((k, beta, g), fresh[1:]):
        assert torch.equal(got, want)
