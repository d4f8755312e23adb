"""Reading weights out of model files onto a device, shared by the loaders of every family."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from native.gguf_dequant import dequantize
from splitspec.models.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

PROGRESS_LOG_S = 10.0  # without a terminal, a progress line this often while a load lasts


def progress(items: list, desc: str, every_s: float = PROGRESS_LOG_S):
    """``items`` with their loading progress: a bar on a terminal (one line that fills as tensors
    load); in a log (a service under ``serve``, docker, Kubernetes), a line every ``every_s``
    seconds with the tensors done and the time taken, so a long load shows it is moving."""
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, unit="tensor", leave=False)
    return _logged(items, desc, every_s)


def _logged(items: list, desc: str, every_s: float) -> Iterator:
    start = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s and done < len(items):
            logger.info("%s: %d of %d tensors after %.0f s", desc, done, len(items), now - start)
            last = now


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
