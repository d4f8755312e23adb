"""Read-only access to a Hugging Face model directory: ``config.json`` plus safetensors weights.

The weights are ``model.safetensors`` or shards listed by ``model.safetensors.index.json``; every
shard is memory-mapped by ``safetensors`` and a tensor is read only when asked for. Errors name
the file and the offending key or tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from splitspec.models.gguf_file import ModelFileError

_MISSING = object()


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelFileError(f"{path}: no {what}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: cannot read {what} ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: {what} is not a JSON object")
    return data


class HFDirectory:
    """``config`` is the parsed ``config.json``; tensors are addressed by their checkpoint names."""

    def __init__(self, path: str | os.PathLike, weights: str = "model.safetensors") -> None:
        self.path = Path(path)
        self.config_path = self.path / "config.json"
        self.config = _read_json(self.config_path, "model config")
        index_path = self.path / f"{weights}.index.json"
        if index_path.is_file():
            weight_map = _read_json(index_path, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFileError(f"{index_path}: missing key 'weight_map'")
            files = sorted(set(weight_map.values()))
        else:
            files = [weights]
        self._files: dict[str, Path] = {}
        self._handles = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise ModelFileError(f"{file}: no such file (weights of {self.path})")
            try:
                handle = safe_open(str(file), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError) as exc:
                raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from exc
            self._handles[file] = handle
            for key in keys:
                self._files[key] = file

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A ``config.json`` value, or a clear error naming the key."""
        if key in self.config:
            return self.config[key]
        if default is _MISSING:
            raise ModelFileError(f"{self.config_path}: missing key {key!r}")
        return default

    def has_tensor(self, name: str) -> bool:
        return name in self._files

    def tensor_names(self) -> list[str]:
        return list(self._files)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        file = self._file(name)
        return tuple(self._handles[file].get_slice(name).get_shape())

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor as stored (its own dtype), checked against ``shape`` before it is read."""
        file = self._file(name)
        if shape is not None and self.tensor_shape(name) != tuple(shape):
            raise ModelFileError(f"{file}: tensor {name!r} has shape {self.tensor_shape(name)}, expected {tuple(shape)}")
        try:
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    def _file(self, name: str) -> Path:
        file = self._files.get(name)
        if file is None:
            raise ModelFileError(f"{self.path}: missing tensor {name!r}")
        return file
