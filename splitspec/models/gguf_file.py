"""Read-only access to a GGUF file: typed metadata and dequantized tensors, with strict errors.

The header (metadata and tensor list) is parsed here in one pass and the tensors are
memory-mapped; a tensor is dequantized only when asked for, with the ``gguf`` package's own numpy
dequantizers (bit-exact with llama.cpp's reference). ``gguf.GGUFReader`` builds a numpy array per
element of every list: 10 s for a 248K-token vocabulary and its merges (a Qwen3.5 file's) on this
project's CPU machine, against 0.2 s here, and a worker opens its model file several times while
loading. Files this parser does not take (big-endian ones) go through ``GGUFReader``.

A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00003.gguf`` ...) opens as one file
from any of its parts: metadata comes from the first part, tensors from all of them.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quant_shape_to_byte_shape

# Weight types the loader accepts; anything else is refused at load with the tensor's name.
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_XS,
}

_MISSING = object()
# Tensor families a file may carry beside its text model, which no loader here reads: a vision tower
# and its projector (GGUF "v." and "mm."; Hugging Face "visual." / "model.visual."), and
# multi-token-prediction heads (GGUF "blk.N.nextn."; Hugging Face "mtp."). The group is the match.
_NOT_TEXT_MODEL = re.compile(r"^(?:model\.)?(v\.|mm\.|visual\.|mtp\.)|^blk\.\d+\.(nextn\.)")

logger = logging.getLogger(__name__)
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and the offending key."""


def skip_other_tensors(where: str | os.PathLike, available: Iterable[str], read: Iterable[str], model: str) -> list[str]:
    """The tensors of ``available`` outside ``read`` that belong to a vision tower or a
    multi-token-prediction head, logged once by family as skipped (the text model loads without
    them); returns them. Any other unread tensor is an error naming it: a file this loader does
    not understand must not load half-read."""
    others = sorted(set(available) - set(read))
    unknown = [name for name in others if not _NOT_TEXT_MODEL.match(name)]
    if unknown:
        raise ModelFileError(f"{where}: unexpected tensor {unknown[0]!r} for a {model} model")
    if others:
        families = Counter(next(g for g in _NOT_TEXT_MODEL.match(name).groups() if g) for name in others)
        logger.info(
            "%s: loading the text model; skipping %d tensors it does not use (%s)", where, len(others),
            ", ".join(f"{count} {family}*" for family, count in sorted(families.items())),
        )
    return others


def split_parts(path: str | os.PathLike) -> list[Path]:
    """All parts of a split GGUF given any one of them, first part first; ``[path]`` if not split."""
    path = Path(path)
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # value type: struct code
_STRING, _ARRAY = 8, 9
# Tensor types whose data gguf's reader gives element-wise; every other type comes as bytes, a row
# of blocks per row of the tensor.
_ELEMENTS = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class _Tensor:
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major
    data: np.ndarray  # a read-only view of the memory map, as GGUFReader's ``ReaderTensor.data``


def _little_endian_v2_or_v3(head: bytes) -> bool:
    return len(head) >= 24 and head[:4] == b"GGUF" and struct.unpack_from("<I", head, 4)[0] in (2, 3)


def _parse_header(data: mmap.mmap, with_tensors: bool) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """A little-endian GGUF (version 2 or 3) header: its metadata, its tensors as (name, dims
    fastest-first, type number, offset from the data section) and where that section starts (or
    only the metadata, if not ``with_tensors``)."""
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        if pos > len(data):
            raise ValueError("a string runs past the end of the file")
        return data[pos - n : pos].decode("utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            inner, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if inner in _SCALARS:
                fmt = f"<{count}{_SCALARS[inner]}"
                items = list(struct.unpack_from(fmt, data, pos))
                pos += struct.calcsize(fmt)
                return items
            return [value(inner) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        fmt = "<" + _SCALARS[kind]
        (item,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return item

    metadata = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        metadata[key] = value(kind)
    if not with_tensors:
        return metadata, [], pos
    tensors = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        kind, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append((name, dims, kind, offset))
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    return metadata, tensors, -(-pos // alignment) * alignment


def _tensors(path: Path, infos: list[tuple[str, tuple[int, ...], int, int]], start: int) -> dict[str, _Tensor]:
    mapped = np.memmap(path, mode="r") if infos else None
    tensors = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        qtype = GGMLQuantizationType(kind)
        shape = tuple(reversed(dims))
        count = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[qtype]
        item = _ELEMENTS.get(qtype)
        if item is None:
            item, count, view_shape = np.uint8, count * size // block, quant_shape_to_byte_shape(shape, qtype)
        else:
            view_shape = shape
        begin = start + offset
        end = begin + count * np.dtype(item).itemsize
        if end > len(mapped):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors[name] = _Tensor(qtype, shape, mapped[begin:end].view(item).reshape(view_shape))
    return tensors


def _with_gguf_reader(path: Path, with_tensors: bool) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    reader = GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    if with_tensors:
        for t in reader.tensors:
            tensors[t.name] = _Tensor(t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
    return metadata, tensors


def read_gguf(path: str | os.PathLike, with_tensors: bool = True) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    """One GGUF file's metadata (``{key: value}``: strings, numbers, bools, lists of them) and, if
    ``with_tensors``, its tensors by name, memory-mapped (see the module docstring). Raises
    ValueError, OSError or struct.error on a file that is not one, truncated or corrupt."""
    path = Path(path)
    with open(path, "rb") as f:
        if not _little_endian_v2_or_v3(f.read(24)):
            return _with_gguf_reader(path, with_tensors)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # only the pages read are loaded
            metadata, infos, start = _parse_header(data, with_tensors)
    return metadata, _tensors(path, infos, start)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's metadata only (:func:`read_gguf`)."""
    return read_gguf(path, with_tensors=False)[0]


def _open(path: Path) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    try:
        return read_gguf(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from exc


class GGUFFile:
    def __init__(self, path: str | os.PathLike) -> None:
        parts = split_parts(path)
        self.path = parts[0]
        opened = [_open(p) for p in parts]
        self._metadata = opened[0][0]
        count = self.get("split.count", 1)
        if count != len(parts):
            raise ModelFileError(f"{self.path}: metadata 'split.count' is {count} but the file name says {len(parts)} parts")
        self._tensors: dict[str, _Tensor] = {}
        self._tensor_file: dict[str, Path] = {}
        for part, (_, tensors) in zip(parts, opened):
            for name, t in tensors.items():
                if name in self._tensors:
                    raise ModelFileError(f"{part}: tensor {name!r} appears twice in the split model")
                self._tensors[name] = t
                self._tensor_file[name] = part

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self._metadata:
            if default is _MISSING:
                raise ModelFileError(f"{self.path}: missing metadata key {key!r}")
            return default
        return self._metadata[key]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape of a tensor, without reading its data."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        return info.shape

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        """A tensor's type (F32, Q4_K, ...), without reading its data."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        return info.tensor_type

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, GGMLQuantizationType]:
        """A tensor's packed bytes (a read-only view of the memory map) and its type, checked
        against ``shape`` (row-major) and the supported types."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        where = self._tensor_file[name]
        if info.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(f"{where}: tensor {name!r} has unsupported type {info.tensor_type.name}")
        if shape is not None and self.tensor_shape(name) != tuple(shape):
            raise ModelFileError(f"{where}: tensor {name!r} has shape {self.tensor_shape(name)}, expected {tuple(shape)}")
        return info.data, info.tensor_type

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Dequantized float32 array in row-major (numpy/PyTorch) order, e.g. [out, in] for a matmul,
        by gguf's numpy reference (the loader uses the bit-identical ``models.dequant`` instead)."""
        data, qtype = self.raw(name, shape)
        array = dequantize(data, qtype).astype(np.float32, copy=False)
        array = array.reshape(self.tensor_shape(name))
        if not array.flags.writeable:  # F32/F16 come back as views of the read-only memory map
            array = array.copy()
        return array
