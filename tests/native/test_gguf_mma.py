"""``native.gguf_mma``'s host side, which runs everywhere: when it takes a matmul, how it splits K,
and that it declines what it cannot take (``gguf_matmul`` then runs its Triton kernels). The CUDA kernel
itself needs a GPU and nvcc: ``scripts/gpu_gguf_mma.py`` checks it against the dequantizer
(BENCHMARKS.md holds its PASS and timings)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from native import gguf_mma
from native.gguf_matmul import quant_linear, row_bytes
from tests.kquants import quantize_k


def test_type_numbers_are_ggufs():
    # The extension dispatches on these numbers; they must be gguf's own.
    assert gguf_mma.MMA_TYPES == {Q.Q4_K: Q.Q4_K.value, Q.Q6_K: Q.Q6_K.value, Q.IQ4_XS: Q.IQ4_XS.value}
    assert gguf_mma.ALIGNMENT.keys() == gguf_mma.MMA_TYPES.keys()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.Q8_0])
def test_not_usable_off_cuda(qtype):
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    raw = torch.zeros(8, row_bytes(qtype, 256), dtype=torch.uint8)
    assert not gguf_mma.usable(x, raw, qtype)


def test_runs_on_no_cpu():
    # So a CPU load keeps every weight in the file's layout (splitspec.models.quantized.interleave_layers).
    assert not gguf_mma.runs_on(torch.device("cpu"))


@pytest.mark.parametrize("programs", [1, 40, 160, 1088, 7760])
@pytest.mark.parametrize("super_blocks", [1, 2, 20, 68])
def test_default_splits(programs, super_blocks):
    splits = gguf_mma.default_splits(programs, super_blocks, sms=132)
    assert 1 <= splits <= max(1, super_blocks // 2)
    assert splits <= 32
    if splits > 1:  # split only while programs are short of four a multiprocessor
        assert programs * (splits - 1) < 4 * 132
    elif super_blocks >= 4:  # a K of four super-blocks or more is split unless N alone fills the device
        assert programs >= 4 * 132


def test_n_tiles_by_rows():
    assert [gguf_mma.default_n_tiles(m) for m in (1, 16, 23, 32, 33, 64)] == [1, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("shape, splits", [
    ((34816, 5120), 1), ((5120, 17408), 4), ((10240, 5120), 2), ((5120, 6144), 4),  # 27B gate/up, down, q/k/v, o
    ((24576, 4096), 1), ((6144, 4096), 3),  # 8B gate/up, q/k/v
    ((248320, 5120), 1), ((4096, 12288), 5),  # Q6_K: 27B LM head, 8B down
])
def test_a_operand_splits_of_the_measured_shapes(shape, splits):
    # The split counts the H200 (Q4_K) and H100 (Q6_K) runs found best, or within 7%, at 1 and 23 rows.
    n, k = shape
    assert gguf_mma.a_operand_splits(-(-n // gguf_mma.A_OPERAND_FEATURES), k // 256, sms=132) == splits


@pytest.mark.parametrize("programs", [1, 80, 3880])
@pytest.mark.parametrize("super_blocks", [1, 2, 68, 1000])
def test_a_operand_splits_bounds(programs, super_blocks):
    splits = gguf_mma.a_operand_splits(programs, super_blocks, sms=132)
    assert 1 <= splits <= max(1, min(super_blocks // 2, 32))


def _norm_producer(kind: int, a: torch.Tensor, b: torch.Tensor | None = None) -> gguf_mma.Producer:
    weight = torch.linspace(0.5, 1.5, a.shape[1])

    def plain():
        x = a + b if b is not None else a
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight), (x if b is not None else None)

    return gguf_mma.Producer(kind, a, plain, b, weight, 1e-6)


def test_produces_only_what_one_preparation_takes(monkeypatch):
    a = torch.randn(32, 512)
    assert not gguf_mma.produces(gguf_mma.NORM, a)  # the CPU: only where asked for
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    assert gguf_mma.produces(gguf_mma.NORM, a) and gguf_mma.produces(gguf_mma.SILU_MUL, a)
    assert not gguf_mma.produces(gguf_mma.NORM, torch.randn(33, 512))  # more rows than one launch takes
    assert not gguf_mma.produces(gguf_mma.NORM, torch.randn(8, 384))  # not whole 256-value blocks
    assert not gguf_mma.produces(gguf_mma.SILU_MUL, torch.randn(8, 768))  # x 384 wide
    assert not gguf_mma.produces(gguf_mma.NORM, torch.randn(1, 8, 512))
    assert not gguf_mma.produces(gguf_mma.NORM, a, torch.ones(512, requires_grad=True))  # training: the launches apart


def test_reference_produce_returns_a_nan_placeholder_carrying_the_values(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    a, b = torch.randn(5, 512), torch.randn(5, 512)
    p = _norm_producer(gguf_mma.ADD_NORM, a, b)
    x, total = gguf_mma.produce(p, Q.Q4_K)
    assert x.shape == (5, 512) and x.isnan().all()
    assert torch.equal(total, a + b)
    prepared = gguf_mma.prepared_for(x)
    assert prepared.qtype == Q.Q4_K and prepared.arrays == [] and torch.equal(prepared.plain(), p.plain()[0])
    assert gguf_mma.prepared_for(x[:2]) is None and gguf_mma.prepared_for(x.clone()) is None  # only the placeholder itself


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K])
def test_quant_linear_reads_a_placeholders_values(monkeypatch, qtype):
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    raw = torch.from_numpy(quantize_k(np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32), qtype))
    p = _norm_producer(gguf_mma.NORM, torch.randn(3, 512))
    x, _ = gguf_mma.produce(p, Q.Q4_K)
    got = quant_linear(x, raw, qtype)
    assert not got.isnan().any() and torch.equal(got, quant_linear(p.plain()[0], raw, qtype))
