"""GGUF blocks expanded to float32 inside Triton kernels: one function per weight type, shared by
the kernels that multiply from blocks (``native.gguf_matmul``'s ``tl.dot`` path) and the one that
expands tiles of them for cuBLAS (``native.gguf_expand``).

Each ``*_chunk`` function returns ``CHUNK`` consecutive values of ``BLOCK_N`` weight rows as
float32 [BLOCK_N, CHUNK], computed with the same operations as ``gguf``'s numpy dequantizer
(``native.gguf_dequant`` says so for its torch twin), so an expanded weight is the dequantizer's
value bit for bit. Terms: a *block* is GGUF's unit of quantization (32 values for Q8_0, a
256-value *super-block* for the K-quants and IQ4_XS); a *sub-block* shares one scale inside a
super-block (32 values for Q4_K, Q5_K and IQ4_XS, 16 for Q6_K). A chunk of a K-quant or IQ4_XS
lies inside one super-block. IQ4_XS's 4-bit values are *indices* into sixteen non-linear int8
levels, read from a float32 table in device memory (``levels``).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from native.gguf_dequant import iq4_nl_levels

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton run the references only
    triton = None

TYPE_IDS = {Q.Q8_0: 0, Q.Q4_K: 1, Q.Q6_K: 2, Q.Q5_K: 3, Q.IQ4_XS: 4}  # the kernels' QTYPE constant

_LEVELS: dict[torch.device, torch.Tensor] = {}


def levels(device: torch.device) -> torch.Tensor:
    """IQ4_XS's sixteen levels as float32 on ``device``: float32, not int8, so a lookup needs no
    integer-to-float conversion. Made by the first IQ4_XS call on a device, which must then come
    before any CUDA graph capture, as the kernel's first compilation must anyway."""
    if device not in _LEVELS:
        _LEVELS[device] = iq4_nl_levels(device)
    return _LEVELS[device]


if triton is not None:

    @triton.jit
    def f16(w_ptr, byte_offset):
        """The little-endian f16 at ``byte_offset`` (even: every block starts 2-byte aligned) -> f32."""
        return tl.load(w_ptr.to(tl.pointer_type(tl.float16)) + byte_offset // 2).to(tl.float32)

    @triton.jit
    def exact_f32(q, offset: tl.constexpr):
        """int32 0 <= q < 2**23 -> float32 ``q - offset``, exactly: q ORed into the mantissa of 2**23
        (bits 0x4B000000) is the float 2**23 + q. Two full-rate ALU operations, where an integer
        to float conversion runs at a quarter of the rate on NVIDIA GPUs and would bound the kernel."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def q8_0_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
        """Values k0 .. k0 + CHUNK of ``rows`` [BLOCK_N] -> f32 [BLOCK_N, CHUNK]; CHUNK / 32 blocks
        of f16 d + 32 int8 q, value = d * q."""
        G: tl.constexpr = CHUNK // 32
        blocks = k0 // 32 + tl.arange(0, G)
        base = rows[:, None] * row_nbytes + blocks[None, :] * 34  # [BLOCK_N, G]
        d = f16(w_ptr, base)
        q = tl.load(w_ptr + base[:, :, None] + 2 + tl.arange(0, 32)[None, None, :]).to(tl.int32)
        return tl.reshape(exact_f32(q ^ 128, 128.0) * d[:, :, None], (BLOCK_N, CHUNK))  # q ^ 128: int8 + 128

    @triton.jit
    def super_block(rows, row_nbytes, k0, BLOCK_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Byte offset [BLOCK_N] of the super-block (``BLOCK_BYTES``) holding value k0 of ``rows``
        [BLOCK_N]: row by row as in the file, or ``INTERLEAVED`` as ``native.gguf_matmul.interleave``
        lays it out (16 features' super-blocks side by side)."""
        if INTERLEAVED:
            base = (rows // 16) * (16 * row_nbytes) + (k0 // 256) * (16 * BLOCK_BYTES) + (rows % 16) * BLOCK_BYTES
        else:
            base = rows * row_nbytes + (k0 // 256) * BLOCK_BYTES
        return base

    @triton.jit
    def q4_k_scale_min(w_ptr, block_byte, s):
        """Sub-block ``s`` [G] of the Q4_K super-blocks at ``block_byte`` [BLOCK_N, G] -> its 6-bit
        (scale, min) as int32 [BLOCK_N, G]: bytes 4 .. 15 hold scale s and min s in the low 6 bits of
        bytes s and s + 4 for s < 4; for s >= 4 the low and high nibbles of byte s + 4 plus the top two
        bits of bytes s - 4 and s."""
        scale_bytes = block_byte + 4
        lo = tl.load(w_ptr + scale_bytes + s[None, :]).to(tl.int32)  # byte s
        hi = tl.load(w_ptr + scale_bytes + 4 + s[None, :]).to(tl.int32)  # byte s + 4
        low = tl.load(w_ptr + scale_bytes + (s % 4)[None, :]).to(tl.int32)  # byte s - 4 for s >= 4
        first = (s < 4)[None, :]
        scale = tl.where(first, lo & 63, (hi & 15) | ((low >> 6) << 4))
        minimum = tl.where(first, hi & 63, (hi >> 4) | ((lo >> 6) << 4))
        return scale, minimum

    @triton.jit
    def q4_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Values k0 .. k0 + CHUNK (inside one super-block) -> f32 [BLOCK_N, CHUNK]. A super-block
        is f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, then 128 bytes where 32-byte
        group j holds sub-block 2j in its low nibbles and 2j + 1 in its high nibbles;
        value = d * scale[s] * q - dmin * min[s]. ``INTERLEAVED``: see ``super_block``."""
        G: tl.constexpr = CHUNK // 32
        s = (k0 % 256) // 32 + tl.arange(0, G)  # [G] sub-blocks of this chunk
        base = super_block(rows, row_nbytes, k0, 144, INTERLEAVED)  # [BLOCK_N]
        scale, minimum = q4_k_scale_min(w_ptr, base[:, None], s)
        d = f16(w_ptr, base)[:, None] * scale.to(tl.float32)  # [BLOCK_N, G]
        dmin = f16(w_ptr, base + 2)[:, None] * minimum.to(tl.float32)
        offsets = 16 + 32 * (s // 2)[:, None] + tl.arange(0, 32)[None, :]  # [G, 32]
        shifts = (4 * (s % 2))[:, None]
        q = (tl.load(w_ptr + base[:, None, None] + offsets[None, :, :]).to(tl.int32) >> shifts[None, :, :]) & 15
        return tl.reshape(d[:, :, None] * exact_f32(q, 0.0) - dmin[:, :, None], (BLOCK_N, CHUNK))

    @triton.jit
    def q5_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
        """Values k0 .. k0 + CHUNK (inside one super-block) -> f32 [BLOCK_N, CHUNK]. A super-block
        is Q4_K's f16 d, f16 dmin and 12 scale bytes, then 32 bytes of fifth bits (bit s of byte l:
        value l of sub-block s), then Q4_K's 128 bytes of low nibbles;
        value = d * scale[s] * q - dmin * min[s], q = low | fifth bit << 4 in 0 .. 31."""
        G: tl.constexpr = CHUNK // 32
        s = (k0 % 256) // 32 + tl.arange(0, G)  # [G] sub-blocks of this chunk
        lane = tl.arange(0, 32)[None, :]
        base = rows * row_nbytes + (k0 // 256) * 176  # [BLOCK_N]
        scale, minimum = q4_k_scale_min(w_ptr, base[:, None], s)
        d = f16(w_ptr, base)[:, None] * scale.to(tl.float32)  # [BLOCK_N, G]
        dmin = f16(w_ptr, base + 2)[:, None] * minimum.to(tl.float32)
        low_at = 48 + 32 * (s // 2)[:, None] + lane  # [G, 32]
        low = (tl.load(w_ptr + base[:, None, None] + low_at[None]).to(tl.int32) >> (4 * (s % 2))[None, :, None]) & 15
        high = (tl.load(w_ptr + base[:, None, None] + 16 + lane[None]).to(tl.int32) >> s[None, :, None]) & 1  # [BLOCK_N, G, 32]
        q = exact_f32(low | (high << 4), 0.0)
        return tl.reshape(d[:, :, None] * q - dmin[:, :, None], (BLOCK_N, CHUNK))

    @triton.jit
    def iq4_xs_scale(w_ptr, block_byte, s):
        """Sub-block ``s`` [G] of the IQ4_XS super-blocks at ``block_byte`` [BLOCK_N, G] -> its stored
        6-bit scale (the value plus 32) as int32 [BLOCK_N, G]: low nibble s % 2 of byte 4 + s // 2,
        high two bits 2 (s % 4) of byte 2 + s // 4 (the little-endian uint16 at byte 2)."""
        low = (tl.load(w_ptr + block_byte + 4 + (s // 2)[None, :]).to(tl.int32) >> (4 * (s % 2))[None, :]) & 15
        high = (tl.load(w_ptr + block_byte + 2 + (s // 4)[None, :]).to(tl.int32) >> (2 * (s % 4))[None, :]) & 3
        return low | (high << 4)

    @triton.jit
    def iq4_xs_chunk(w_ptr, levels_ptr, rows, row_nbytes, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
        """Values k0 .. k0 + CHUNK (inside one super-block) -> f32 [BLOCK_N, CHUNK]. A super-block is
        f16 d, 6 bytes of eight 6-bit scales (``iq4_xs_scale``), then sixteen bytes per sub-block s
        at 8 + 16 s, whose byte i holds the indices of values i (low nibble) and 16 + i (high);
        value = d * (scale - 32) * levels[index]."""
        G: tl.constexpr = CHUNK // 32
        s = (k0 % 256) // 32 + tl.arange(0, G)  # [G] sub-blocks of this chunk
        lane = tl.arange(0, 32)
        base = rows * row_nbytes + (k0 // 256) * 136  # [BLOCK_N]
        dl = f16(w_ptr, base)[:, None] * exact_f32(iq4_xs_scale(w_ptr, base[:, None], s), 32.0)  # [BLOCK_N, G]
        at = (8 + 16 * s)[:, None] + (lane % 16)[None, :]  # [G, 32]
        index = (tl.load(w_ptr + base[:, None, None] + at[None]).to(tl.int32) >> (4 * (lane // 16))[None, None, :]) & 15
        return tl.reshape(dl[:, :, None] * tl.load(levels_ptr + index), (BLOCK_N, CHUNK))

    @triton.jit
    def q6_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Values k0 .. k0 + CHUNK (inside one super-block) -> f32 [BLOCK_N, CHUNK]. A super-block
        is 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, f16 d. Value
        v = 128 h + 32 r + l (h < 2, r < 4, l < 32) has its low bits in nibble r // 2 of byte
        64 h + 32 (r % 2) + l, its high bits at bit 2 r of byte 128 + 32 h + l, and scale v // 16;
        value = d * scale * (q - 32). ``INTERLEAVED``: see ``super_block``."""
        G: tl.constexpr = CHUNK // 32
        g = (k0 % 256) // 32 + tl.arange(0, G)  # [G] groups of 32 values: g = 4 h + r
        h, r = g // 4, g % 4
        lane = tl.arange(0, 32)[None, :]
        base = super_block(rows, row_nbytes, k0, 210, INTERLEAVED)  # [BLOCK_N]
        low_at = (64 * h + 32 * (r % 2))[:, None] + lane  # [G, 32]
        high_at = 128 + (32 * h)[:, None] + lane
        low = (tl.load(w_ptr + base[:, None, None] + low_at[None]).to(tl.int32) >> (4 * (r // 2))[None, :, None]) & 15
        high = (tl.load(w_ptr + base[:, None, None] + high_at[None]).to(tl.int32) >> (2 * r)[None, :, None]) & 3
        q = exact_f32(low | (high << 4), 32.0)  # [BLOCK_N, G, 32]
        scales = w_ptr + base[:, None] + 192 + 2 * g[None, :]  # [BLOCK_N, G]: sub-blocks 2g, 2g + 1
        first = tl.load(scales).to(tl.int8, bitcast=True).to(tl.float32)
        second = tl.load(scales + 1).to(tl.int8, bitcast=True).to(tl.float32)
        d = f16(w_ptr, base + 208)[:, None, None]
        scale = tl.where(lane[None] < 16, (d * first[:, :, None]), (d * second[:, :, None]))
        return tl.reshape(scale * q, (BLOCK_N, CHUNK))

    @triton.jit
    def chunk(w_ptr, levels_ptr, rows, row_nbytes, k0, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
              INTERLEAVED: tl.constexpr):
        """Values k0 .. k0 + CHUNK of ``rows`` [BLOCK_N] of a weight of type ``QTYPE`` (``TYPE_IDS``)
        -> f32 [BLOCK_N, CHUNK]; ``levels_ptr`` is read for IQ4_XS only; ``INTERLEAVED`` (Q4_K and
        Q6_K only): see ``super_block``."""
        if QTYPE == 0:
            w = q8_0_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N, CHUNK)
        elif QTYPE == 1:
            w = q4_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N, CHUNK, INTERLEAVED)
        elif QTYPE == 2:
            w = q6_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N, CHUNK, INTERLEAVED)
        elif QTYPE == 3:
            w = q5_k_chunk(w_ptr, rows, row_nbytes, k0, BLOCK_N, CHUNK)
        else:
            w = iq4_xs_chunk(w_ptr, levels_ptr, rows, row_nbytes, k0, BLOCK_N, CHUNK)
        return w
