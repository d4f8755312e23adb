"""The torch dequantizers (native.gguf_dequant) against gguf's numpy reference, bit for bit
(on the GPU too where one is present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference

from native.gguf_dequant import TYPES, dequantize
from splitspec.models.gguf_file import SUPPORTED_TYPES

# Byte offsets of the f16 scales in each block: random bytes there could be NaN or inf.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
F16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0],
}


def test_every_supported_type_has_a_kernel():
    assert TYPES == SUPPORTED_TYPES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int), ids=lambda q: q.name)
def test_random_blocks_match_the_reference_bit_for_bit(qtype, device):
    """Random bytes exercise every bit of every packed field, not only what a quantizer writes."""
    rng = np.random.default_rng(int(qtype))
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (64, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = (rng.standard_normal(64) * 0.01).astype("<f2").view(np.uint8).reshape(64, 2)
    raw = blocks.reshape(4, -1)  # 4 rows of 16 blocks
    expected = reference(raw, qtype)
    ours = dequantize(torch.from_numpy(raw.copy()).to(device), qtype, expected.shape).cpu().numpy()
    assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_types_match_the_reference_bit_for_bit(qtype, device):
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((8, 64)) * 10).astype(np.float32)
    if qtype == Q.F32:
        raw = values.view(np.uint8)
    elif qtype == Q.F16:
        raw = values.astype(np.float16).view(np.uint8)
    else:
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # truncated bf16
    expected = reference(raw, qtype)
    ours = dequantize(torch.from_numpy(raw.copy()).to(device), qtype, expected.shape).cpu().numpy()
    assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_iq4_xs_fields_decode_as_the_format_defines():
    """One hand-built IQ4_XS super-block: each sub-block's 6-bit scale split over the low-nibble
    bytes and the high-bit pairs, and each 4-bit index looked up in the non-linear level table
    (not read as a number), so a swapped nibble or table entry shows up as a wrong value."""
    from gguf.quants import IQ4_NL

    from native.gguf_dequant import IQ4_NL_VALUES

    assert IQ4_NL_VALUES == tuple(IQ4_NL.kvalues)
    scales = np.array([0, 1, 31, 32, 33, 47, 62, 63])  # stored scale s, value s - 32
    q = np.arange(256).reshape(8, 32) * 7 % 16  # [sub-block, value] indices, every one of the 16
    block = np.zeros(136, np.uint8)
    block[0:2] = np.array([0.5], "<f2").view(np.uint8)
    block[2:4] = np.array([sum(int(s >> 4) << (2 * i) for i, s in enumerate(scales))], "<u2").view(np.uint8)
    block[4:8] = (scales[0::2] & 15) | ((scales[1::2] & 15) << 4)
    block[8:] = (q[:, :16] | (q[:, 16:] << 4)).reshape(128)
    expected = 0.5 * (scales[:, None] - 32) * np.array(IQ4_NL_VALUES)[q]
    ours = dequantize(torch.from_numpy(block), Q.IQ4_XS, (256,)).numpy()
    assert np.array_equal(ours, expected.reshape(256).astype(np.float32))
