"""The test-only K-quant quantizer (tests/kquants.py) against gguf's reference dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tests.kquants import quantize_k

# Relative RMS error bounds: about one quantization step over the value range, per bit width.
BOUNDS = {Q.Q4_K: 0.12, Q.Q5_K: 0.06, Q.Q6_K: 0.03}
ROUND_TRIP_BOUNDS = {**BOUNDS, Q.IQ4_XS: 0.12}  # IQ4_XS's simple scale choice is not idempotent, so no requantizing check


def _weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    x[0] = 0.0  # an all-zero super-block
    x[1] = -np.abs(x[1])  # only negative values
    x[2, :256] = 3.0  # a constant block
    x[3] *= 100.0  # a large range
    return x


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUNDS), ids=lambda q: q.name)
def test_round_trip_error_is_small(qtype):
    x = _weights()
    y = dequantize(quantize_k(x, qtype), qtype)
    assert y.shape == x.shape
    for row in range(len(x)):
        scale = max(np.abs(x[row]).max(), 1e-12)
        assert np.sqrt(np.mean((y[row] - x[row]) ** 2)) / scale < ROUND_TRIP_BOUNDS[qtype], row
    assert np.array_equal(y[0], x[0])
    assert np.allclose(y[2, :256], 3.0, rtol=2e-3)


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda q: q.name)
def test_requantizing_dequantized_values_is_bit_exact(qtype):
    y = dequantize(quantize_k(_weights(), qtype), qtype)
    again = dequantize(quantize_k(y, qtype), qtype)
    assert np.array_equal(again.view(np.uint32), y.view(np.uint32))


def test_rejects_rows_that_are_not_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 100), np.float32), Q.Q4_K)
