"""Read-only access to a GGUF file: typed metadata and dequantized tensors, with strict errors.

Tensors are memory-mapped by ``gguf.GGUFReader``; a tensor is dequantized only when asked for,
with the ``gguf`` package's own numpy dequantizers (bit-exact with llama.cpp's reference).

A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00003.gguf`` ...) opens as one file
from any of its parts: metadata comes from the first part, tensors from all of them.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

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


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from exc


class GGUFFile:
    def __init__(self, path: str | os.PathLike) -> None:
        parts = split_parts(path)
        self.path = parts[0]
        readers = [_open(p) for p in parts]
        self._reader = readers[0]
        count = self.get("split.count", 1)
        if count != len(parts):
            raise ModelFileError(f"{self.path}: metadata 'split.count' is {count} but the file name says {len(parts)} parts")
        self._tensors = {}
        self._tensor_file: dict[str, Path] = {}
        for part, reader in zip(parts, readers):
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise ModelFileError(f"{part}: tensor {t.name!r} appears twice in the split model")
                self._tensors[t.name] = t
                self._tensor_file[t.name] = part

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelFileError(f"{self.path}: missing metadata key {key!r}")
            return default
        return field.contents()

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape of a tensor, without reading its data."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        return tuple(int(d) for d in reversed(info.shape.tolist()))

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
