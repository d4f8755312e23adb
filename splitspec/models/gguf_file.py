"""Read-only access to a GGUF file: typed metadata and dequantized tensors, with strict errors.

Tensors are memory-mapped by ``gguf.GGUFReader``; a tensor is dequantized only when asked for,
with the ``gguf`` package's own numpy dequantizers (bit-exact with llama.cpp's reference).
"""

from __future__ import annotations

import os
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
}

_MISSING = object()


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and the offending key."""


class GGUFFile:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as exc:
            raise ModelFileError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}

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

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Dequantized float32 array in row-major (numpy/PyTorch) order, e.g. [out, in] for a matmul."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        if info.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(f"{self.path}: tensor {name!r} has unsupported type {info.tensor_type.name}")
        array = dequantize(info.data, info.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(self.tensor_shape(name))
        if not array.flags.writeable:  # F32/F16 come back as views of the read-only memory map
            array = array.copy()
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {array.shape}, expected {shape}")
        return array
