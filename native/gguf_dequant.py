"""GGUF weight types dequantized with torch, on whatever device the raw bytes are on.

Loading a quantized model moves the packed bytes to the GPU and expands them there, which is much
faster than expanding on the CPU first (and moves 2-8x fewer bytes). Each function computes in
float32 with the same operations, in the same order, as ``gguf``'s numpy reference, so the result
is bit-for-bit the same (tests/models/test_dequant.py checks every type).

Block layouts (llama.cpp's ``ggml-common.h``): a block of 32 values (Q4_0 ... Q8_0) or 256 values
(K-quants, IQ4_XS) starts with f16 scale(s); 4-bit values pack two per byte, the low nibbles first.
IQ4_XS's 4-bit values are not levels of a uniform grid but indices into ``IQ4_NL_VALUES``, sixteen
int8 levels spaced more finely near zero, where most weights lie.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

QK_K = 256
# The levels an IQ4_NL / IQ4_XS index selects (llama.cpp's ``kvalues_iq4nl``): a fixed format constant.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The same as two int64 words of eight bytes each (byte i of word h: level 8 h + i, two's complement).
_IQ4_NL_WORDS = tuple(
    int.from_bytes(bytes(v & 255 for v in IQ4_NL_VALUES[8 * h : 8 * h + 8]), "little", signed=True) for h in range(2)
)


def iq4_nl_levels(device: torch.device) -> torch.Tensor:
    """``IQ4_NL_VALUES`` as float32 [16] on ``device``, unpacked there from two scalar fills: a
    host list would be copied over, which a CUDA graph capture refuses."""
    words = torch.cat([torch.full((8,), w, dtype=torch.int64, device=device) for w in _IQ4_NL_WORDS])
    shifts = 8 * (torch.arange(16, dtype=torch.int64, device=device) % 8)
    return ((words >> shifts) & 255).to(torch.uint8).view(torch.int8).float()


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian f16 at byte ``start`` of every block [n, B] -> float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(values: list[int], device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``values``, an arithmetic run (0, 4 or 0, 2, 4, 6 ...), made on ``device`` by ``arange``: a
    host list would be copied over, which a CUDA graph capture refuses (a kept-quantized embedding
    dequantizes its rows inside the captured passes)."""
    step = values[1] - values[0] if len(values) > 1 else 1
    assert list(values) == list(range(values[0], values[-1] + 1, step)), values
    return torch.arange(values[0], values[-1] + 1, step, dtype=dtype, device=device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., width] packed bytes -> [n, ..., 2, width]: low nibbles, then high nibbles."""
    return (qs.unsqueeze(-2) >> _shifts([0, 4], qs.device).view(2, 1)) & 15


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).float()
    return (_f16(b, 0) * q) + _f16(b, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits, bit j for value j."""
    return ((qh.unsqueeze(-1) >> _shifts(list(range(8)), qh.device)) & 1).reshape(len(qh), 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]).reshape(len(b), 32) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]).reshape(len(b), 32) | (_fifth_bits(b[:, 4:8]) << 4)
    return (_f16(b, 0) * q.float()) + _f16(b, 2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [n, 12] -> eight 6-bit scales and eight 6-bit mins, each float32 [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return scales.float(), mins.float()


def _affine_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d * scale * q - dmin * min`` over eight sub-blocks of 32; q [n, 8, 32]."""
    scales, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * scales).reshape(len(b), 8, 1)
    dm = (_f16(b, 2) * mins).reshape(len(b), 8, 1)
    return (d * q.float() - dm).reshape(len(b), QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _affine_k(b, _nibbles(b[:, 16:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32)
    high = (b[:, 16:48].unsqueeze(1) >> _shifts(list(range(8)), b.device).view(1, 8, 1)) & 1  # [n, 8, 32]
    return _affine_k(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    q = ((low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q).reshape(n, QK_K)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """f16 d, 2 bytes of high scale bits (bits 2s, 2s + 1 of the little-endian uint16 for sub-block
    s), 4 bytes of low scale nibbles (byte s // 2, the low nibble for even s), then 8 runs of 16
    bytes: run s holds values 0-15 of sub-block s in its low nibbles and 16-31 in its high ones;
    value = d * (6-bit scale - 32) * IQ4_NL_VALUES[q]."""
    n = len(b)
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)  # [n, 2, 4] -> [n, 8]: byte s // 2, nibble s % 2
    high = (b[:, 2:4].unsqueeze(-1) >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4)) & 3  # [n, 2, 4] -> s = 4 byte + k
    scales = (low | (high.reshape(n, 8) << 4)).float() - 32.0  # exact: small integers
    dl = (_f16(b, 0) * scales).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
    return (dl * iq4_nl_levels(b.device)[q.long()]).reshape(n, QK_K)


_BLOCK_KERNELS = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs,
}
TYPES = frozenset({Q.F32, Q.F16, Q.BF16, *_BLOCK_KERNELS})  # == gguf_file.SUPPORTED_TYPES


def dequantize(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """The packed bytes ``raw`` (uint8, any shape) of a tensor of ``qtype`` -> float32 ``shape``."""
    flat = raw.reshape(-1)
    if qtype == Q.F32:
        out = flat.view(torch.float32)
    elif qtype == Q.F16:
        out = flat.view(torch.float16).float()
    elif qtype == Q.BF16:
        out = (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    else:
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        out = _BLOCK_KERNELS[qtype](flat.view(-1, block_bytes))
    return out.reshape(shape)
