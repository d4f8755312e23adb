"""Reading weights out of model files onto a device, shared by the loaders of every family."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from native.gguf_dequant import dequantize
from splitspec.models.gguf_file import GGUFFile


def progress(items: list, desc: str):
    """``items`` with a progress bar on a terminal (one line that fills as tensors load)."""
    # tqdm hides itself when stderr is not a terminal (disable=None).
    return tqdm(items, desc=desc, unit="tensor", disable=None, leave=False)


def load_gguf_raw(f: GGUFFile, name: str, shape: tuple[int, ...], device: torch.device | str) -> tuple[torch.Tensor, Q]:
    """A GGUF tensor's packed bytes on ``device``, one row per ``shape[0]`` (uint8 [rows, row_bytes]
    for the block types), and its type."""
    data, qtype = f.raw(name, shape)
    raw = torch.from_numpy(np.array(data, copy=True)).to(device)  # the memory map is read-only
    return raw.reshape(shape[0], -1), qtype


def load_gguf_tensor(f: GGUFFile, name: str, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """A GGUF tensor as float32 on ``device``: the packed bytes move there and expand there."""
    raw, qtype = load_gguf_raw(f, name, shape, device)
    return dequantize(raw, qtype, shape)
