"""A small numpy quantizer for llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS, for test fixtures only.

``gguf`` can dequantize these types but not write them. This writes the block layouts llama.cpp
defines (super-blocks of 256 values) with a plain min/max choice of scales, not llama.cpp's
iterative search: the files are valid and the error is small, which is all a fixture needs.

Q4_K / Q5_K block: f16 d, f16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, then the
4-bit low parts (two sub-blocks of 32 per 32 bytes) and, for Q5_K, 32 bytes of fifth bits (bit s of
byte l is value l of sub-block s). A value is ``d * scale[s] * q - dmin * min[s]``.
Q6_K block: 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen int8 scales, f16 d; a value
is ``d * scale[j] * (q - 32)`` over sub-blocks of 16.
IQ4_XS block: f16 d, a little-endian uint16 of high scale bits (bits 2s, 2s + 1 for sub-block s), 4
bytes of low scale nibbles (byte s // 2, low nibble for even s), then 16 bytes per sub-block of 32
(values i and 16 + i in the low and high nibble of byte i); a value is ``d * (scale - 32) *
IQ4_NL_VALUES[q]``, a 6-bit scale and an index into sixteen non-linear int8 levels.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[n] float -> [n, 2] little-endian f16 bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _safe_divide(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    return np.divide(x, d, out=np.zeros_like(x), where=d > 0)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block [n, 8] -> [n, 12] bytes."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Blocks [n, 8, 32] -> (d [n], dmin [n], scales [n, 8], mins [n, 8], q [n, 8, 32] in 0..nmax)."""
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / nmax  # [n, 8]
    offset = -lo
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)  # [n]
    dmin = (offset.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_divide(step, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_divide(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    eff_step = (d[:, None] * sc)[..., None]
    eff_offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_safe_divide(x + eff_offset, np.broadcast_to(eff_step, x.shape))), 0, nmax).astype(np.uint8)
    return d, dmin, sc, mn, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values -> [n, 128] bytes: sub-blocks 2j and 2j+1 share 32 bytes (low, high nibble)."""
    q = q & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, 8, 32).astype(np.float32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn), _low_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, 8, 32).astype(np.float32), 31)
    high = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]  # [n, 8, 32]
    qh = np.bitwise_or.reduce(high, axis=1)  # [n, 32]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn), qh, _low_nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    n = blocks.shape[0]
    step = np.abs(blocks).max(-1) / 31  # [n, 16]
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_divide(step, d[:, None])), 0, 127).astype(np.int8)
    eff = np.broadcast_to((d[:, None] * sc)[..., None], blocks.shape)
    u = (np.clip(np.rint(_safe_divide(blocks, eff)), -32, 31) + 32).astype(np.uint8)  # [n, 16, 16] in 0..63
    u = u.reshape(n, 2, 4, 32)  # [block, half, row in half, 32]
    ql = (u[:, :, 0:2] & 15) | ((u[:, :, 2:4] & 15) << 4)  # [n, 2, 2, 32]
    qh = np.bitwise_or.reduce(((u >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


IQ4_NL_VALUES = np.array(IQ4_NL.kvalues, np.float32)  # the sixteen levels (llama.cpp's kvalues_iq4nl)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    n = blocks.shape[0]
    # Each sub-block's ideal scale maps its largest-magnitude value onto the -127 level (the sign
    # of the scale picks which end), so the table's wider negative side takes the largest value.
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]  # [n, 8]
    ideal = -peak / 127
    d = (np.abs(ideal).max(-1) / 32).astype(np.float16).astype(np.float32)  # [n]: |scale - 32| <= 32
    sc = np.clip(np.rint(_safe_divide(ideal, d[:, None])), -32, 31).astype(np.int32)  # [n, 8]
    eff = (d[:, None] * sc)[..., None]  # [n, 8, 1]
    ratio = np.divide(blocks, eff, out=np.zeros_like(blocks), where=eff != 0)
    q = np.abs(ratio[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)  # [n, 8, 32]: the nearest level
    stored = (sc + 32).astype(np.uint16)  # 0 .. 63
    scales_h = np.bitwise_or.reduce((stored >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")  # [n]
    scales_l = (stored[:, 0::2] & 15) | ((stored[:, 1::2] & 15) << 4)  # [n, 4]
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), scales_h.view(np.uint8).reshape(n, 2), scales_l.astype(np.uint8), qs], axis=1)


QUANTIZERS = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
    GGMLQuantizationType.IQ4_XS: quantize_iq4_xs,
}


def quantize_k(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * block bytes] uint8, as ``gguf.quants.quantize`` shapes it."""
    rows, cols = array.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, got {cols}")
    return QUANTIZERS[qtype](array).reshape(rows, -1)
