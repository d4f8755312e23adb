"""native.chunked_delta_rule: the prefill switch between fla's chunked kernel and our torch chunked
form, on the CPU.

fla's kernels do not run here (CUDA only; not under Triton's interpreter either, module docstring),
so its path is checked in two parts: the layout and convention mapping (:func:`fla_prefill`)
through a stand-in written from fla's documented conventions, and the kernel itself on a GPU by
``scripts/gpu_delta_prefill.py``.
"""

from __future__ import annotations

import pytest
import torch

from native import chunked_delta_rule
from native.chunked_delta_rule import ENV, choose_backend, chunk_prefill, fla_prefill, prefill_backend
from splitspec.fixtures.tiny import TinySpec
from splitspec.fixtures.tiny_qwen35 import tiny_qwen35_config
from splitspec.models.delta_rule import ancestor_table, chain_parents, gated_delta_chunked, gated_delta_tree, l2_normalize
from splitspec.models.qwen35 import GatedDeltaNet

H, DK, DV = 4, 16, 8
F32, F64 = torch.float32, torch.float64


def delta_inputs(n: int, seed: int, dtype: torch.dtype = F32):
    """Inputs of one prefill of ``n`` rows with a nonzero state before it, as the model gives them:
    q and k L2-normalised, q scaled by ``Dk ** -0.5``, decays from ~0 to ~exp(-4)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(n, H, DK, generator=gen, dtype=F64)) * DK**-0.5
    k = l2_normalize(torch.randn(n, H, DK, generator=gen, dtype=F64))
    v = torch.randn(n, H, DV, generator=gen, dtype=F64)
    g = -4 * torch.rand(n, H, generator=gen, dtype=F64)
    beta = torch.rand(n, H, generator=gen, dtype=F64)
    state = torch.randn(H, DK, DV, generator=gen, dtype=F64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state))


def sequential(q, k, v, g, beta, state):
    """The one-token-at-a-time recurrence in float64: outputs [T, H, Dv] and the final state."""
    args = [x.to(F64) for x in (q, k, v, g, beta, state)]
    out, states = gated_delta_tree(*args, chain_parents(q.shape[0]), F64)
    return out, states[-1]


@pytest.mark.parametrize("mode", ["auto", "torch"])
@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_chunk_prefill_equals_sequential_reference(monkeypatch, n, mode):
    """float32 inputs: the chunk boundary at 64 rows falls inside the 100-row prefill."""
    monkeypatch.setenv(ENV, mode)
    q, k, v, g, beta, state = delta_inputs(n, seed=n)
    out, final = chunk_prefill(q, k, v, g, beta, state, fallback=gated_delta_chunked)
    ref_out, ref_final = sequential(q, k, v, g, beta, state)
    assert out.shape == (n, H, DV) and final.shape == (H, DK, DV)
    assert out.dtype == F32 and final.dtype == F32  # the math dtype, as gated_delta_chunked returns
    assert torch.allclose(out.to(F64), ref_out, atol=2e-5, rtol=1e-5)
    assert torch.allclose(final.to(F64), ref_final, atol=2e-5, rtol=1e-5)


def test_chunk_prefill_float64_is_exact():
    q, k, v, g, beta, state = delta_inputs(100, seed=5, dtype=F64)
    out, final = chunk_prefill(q, k, v, g, beta, state, fallback=gated_delta_chunked)
    ref_out, ref_final = sequential(q, k, v, g, beta, state)
    assert out.dtype == F64
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(final, ref_final, atol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "torch", "AUTO", ""])
def test_cpu_calls_take_the_torch_path(monkeypatch, mode):
    """On the CPU auto (also unset or empty) and torch take torch, without importing fla."""
    monkeypatch.setenv(ENV, mode)
    monkeypatch.setattr(chunked_delta_rule, "fla_kernel", lambda: pytest.fail("fla was imported for a CPU call"))
    assert prefill_backend(torch.zeros(3, H, DV), DK) == "torch"


def test_forcing_fla_on_the_cpu_says_why(monkeypatch):
    monkeypatch.setenv(ENV, "fla")
    q, k, v, g, beta, state = delta_inputs(7, seed=1)
    with pytest.raises(RuntimeError, match=f"{ENV}=fla.*not on a CUDA device"):
        chunk_prefill(q, k, v, g, beta, state, fallback=gated_delta_chunked)


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(ValueError, match="auto, fla, torch"):
        prefill_backend(torch.zeros(3, H, DV), DK)


CUDA_FACTS = dict(on_cuda=True, fla_error="", math_dtype=F32, dk=128, chunk=64)


@pytest.mark.parametrize(
    ("mode", "facts", "expected"),
    [
        ("auto", {}, "fla"),
        ("fla", {}, "fla"),
        ("torch", {}, "torch"),
        ("auto", {"on_cuda": False}, "torch"),
        ("auto", {"fla_error": "ModuleNotFoundError: No module named 'fla'"}, "torch"),
        ("auto", {"math_dtype": F64}, "torch"),
        ("auto", {"dk": 512}, "torch"),
        ("auto", {"chunk": 100}, "torch"),
        ("auto", {"kernels_on": False}, "torch"),  # SPLITSPEC_NATIVE=0 turns fla off with the other kernels
        ("fla", {"kernels_on": False}, "fla"),  # ... but an explicit fla wins
    ],
)
def test_choose_backend(mode, facts, expected):
    assert choose_backend(mode, **{**CUDA_FACTS, **facts}) == expected


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        ({"fla_error": "ModuleNotFoundError: No module named 'fla'"}, r"does not import \(ModuleNotFoundError.*splitspec\[gpu\]"),
        ({"math_dtype": F64}, "float64"),
        ({"dk": 512}, "Dk = 512 > 256"),
        ({"chunk": 100}, r"chunk = 100 is not one of \(16, 32, 64\)"),
    ],
)
def test_forced_fla_names_what_stops_it(facts, message):
    with pytest.raises(RuntimeError, match=message):
        choose_backend("fla", **{**CUDA_FACTS, **facts})


def fla_convention_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, chunk_size=64, **unsupported):
    """A stand-in for fla's ``chunk_gated_delta_rule``, written from its documentation: ``[B, T, H, K]``
    layout, key heads ``h // (HV // H)`` per value head ``h``, ``scale`` (None = ``K ** -0.5``) on q,
    optional in-kernel L2 norm, natural-log ``g``, state ``[N, HV, K, V]``; output in q's dtype,
    final state float32. Recurrence per token: decay, write ``beta (v - S^T k)`` along k, read with q."""
    assert not unsupported, unsupported
    assert chunk_size in (16, 32, 64)
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    group = hv // hk
    if scale is None:
        scale = dk**-0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    s = initial_state.float().clone() if initial_state is not None else torch.zeros(b, hv, dk, v.shape[-1])
    o = torch.empty(b, t, hv, v.shape[-1])
    for i in range(t):
        for h in range(hv):
            qi, ki = q[:, i, h // group].float() * scale, k[:, i, h // group].float()  # [B, K]
            s[:, h] *= g[:, i, h].float().exp()[:, None, None]
            written = beta[:, i, h].float()[:, None] * (v[:, i, h].float() - torch.einsum("bkv,bk->bv", s[:, h], ki))
            s[:, h] += ki[:, :, None] * written[:, None, :]
            o[:, i, h] = torch.einsum("bkv,bk->bv", s[:, h], qi)
    return o.to(q.dtype), (s if output_final_state else None)


@pytest.mark.parametrize("n", [1, 7, 70])
def test_fla_prefill_maps_our_conventions_onto_fla(n):
    """Layout, scale, norm flags and the state's axes survive the round trip through fla's conventions."""
    q, k, v, g, beta, state = delta_inputs(n, seed=100 + n)
    out, final = fla_prefill(fla_convention_kernel, q, k, v, g, beta, state)
    ref_out, ref_final = sequential(q, k, v, g, beta, state)
    assert out.dtype == F32 and out.shape == (n, H, DV) and final.shape == (H, DK, DV)
    assert torch.allclose(out.to(F64), ref_out, atol=2e-5, rtol=1e-5)
    assert torch.allclose(final.to(F64), ref_final, atol=2e-5, rtol=1e-5)


def test_qwen35_prefill_goes_through_the_switch(monkeypatch):
    """A Gated DeltaNet layer's prefill (a chain, parents None) takes chunk_prefill: forcing fla on the
    CPU stops it, and the torch path gives what the same rows give as a tree (the recurrent form)."""
    c = tiny_qwen35_config(TinySpec(), vocab_size=64)
    torch.manual_seed(0)
    layer = GatedDeltaNet(c)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.ssm_a.data = -layer.ssm_a.data.abs() - 0.1  # -exp(A_log) < 0: the state decays
    t = 70
    x = torch.randn(t, c.hidden_size)
    history = torch.randn(c.conv_kernel - 1, c.conv_channels)
    state = torch.randn(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    ancestors = ancestor_table(chain_parents(t), c.conv_kernel)
    with torch.no_grad():
        monkeypatch.setenv(ENV, "fla")
        with pytest.raises(RuntimeError, match=f"{ENV}=fla"):
            layer(x, history, state, ancestors, None)
        monkeypatch.setenv(ENV, "torch")
        out, _, final = layer(x, history, state, ancestors, None)  # final [1, Hv, Dk, Dv]
        tree_out, _, states = layer(x, history, state, ancestors, chain_parents(t))  # states [T, Hv, Dk, Dv]
    assert torch.allclose(out, tree_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(final[0], states[-1], atol=1e-4, rtol=1e-4)
