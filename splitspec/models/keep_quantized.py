"""``--keep-quantized auto|on|off``: whether a GGUF model's quantized weights stay in their blocks.

Terms:

- **dequantized bytes**: what a GGUF file's tensors (or the named ones) take dequantized to the
  compute dtype, from their shapes alone (no data is read).
- **available**: the device memory a worker may use: the free memory of its GPU, or on a CPU the
  machine's physical memory, either held to ``--memory-cap-gb`` where one is set.
- **auto** keeps the blocks when the dequantized weights would take more than ``AUTO_SHARE`` of
  what is available (a 27B Q4_K_M target is 16 GB in blocks and 54 GB in bfloat16: on a 24 GB
  card only its blocks load), and dequantizes otherwise: where bfloat16 weights fit, their matmuls
  are still faster than the quantized kernels (BENCHMARKS.md: an 8B Q4_K_M decode step 6.0 ms kept
  against 4.8 ms in bfloat16 on an H200), so keeping every GGUF quantized by default would make
  most users slower. The rest (``AUTO_SHARE`` leaves a quarter) is for the KV cache, states and
  workspace; the memory plan then checks the whole.
- **on** / **off** keep or dequantize whatever the sizes. A bare ``--keep-quantized`` means on.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `splitspec serve`, which reads the flag, never loads it
    import torch

CHOICES = ("auto", "on", "off")
AUTO_SHARE = 0.75
GiB = 1 << 30


def add_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--keep-quantized [auto|on|off]`` (default auto; bare: on), ``what`` saying what it keeps."""
    p.add_argument(
        "--keep-quantized", nargs="?", const="on", default="auto", choices=CHOICES,
        help=f"{what}. auto (the default) keeps them when, dequantized to --dtype, the weights would take more than "
        f"{AUTO_SHARE * 100:.0f}%% of the memory available (the GPU's free memory, or --memory-cap-gb), and dequantizes "
        "otherwise, where today's bfloat16 matmuls are faster; a bare --keep-quantized means on",
    )


def dequantized_bytes(path: str | os.PathLike, dtype: torch.dtype, names: tuple[str, ...] = ()) -> int | None:
    """Bytes of the GGUF file's tensors (only ``names`` among them, where given) dequantized to
    ``dtype``; None when there is nothing quantized to keep: ``path`` is not a GGUF file (a
    directory of safetensors), or none of those tensors is in blocks (F32, F16, BF16)."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from splitspec.models.gguf_file import GGUFFile

    local = Path(path)
    if not local.is_file() or local.suffix != ".gguf":
        return None
    f = GGUFFile(local)
    chosen = [n for n in f.tensor_names() if not names or n in names]
    if all(f.tensor_type(n) in (Q.F32, Q.F16, Q.BF16) for n in chosen):
        return None
    count = sum(int(torch.Size(f.tensor_shape(n)).numel()) for n in chosen)
    return count * torch.empty((), dtype=dtype).element_size()


def available_bytes(device: torch.device, cap: int | None) -> int:
    """What a worker on ``device`` may use: the GPU's free memory or the machine's physical memory,
    at most ``cap`` bytes."""
    import torch

    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(have, cap) if cap else have


@dataclass(frozen=True)
class KeepDecision:
    keep: bool
    reason: str  # for the log


def decide(choice: str, dequantized: int | None, available: int, dtype: torch.dtype) -> KeepDecision:
    """``--keep-quantized`` ``choice`` for weights of ``dequantized`` bytes (None: not a GGUF) on a
    device with ``available`` bytes. Raises ValueError for a choice not in ``CHOICES``."""
    if choice not in CHOICES:
        raise ValueError(f"--keep-quantized {choice}: choose auto, on or off")
    if dequantized is None:
        return KeepDecision(False, "no quantized GGUF weights to keep")
    if choice != "auto":
        return KeepDecision(choice == "on", f"--keep-quantized {choice}")
    name = str(dtype).removeprefix("torch.")
    size = f"dequantized to {name} the weights would take {dequantized / GiB:.2f} GiB"
    if dequantized > AUTO_SHARE * available:
        return KeepDecision(True, f"--keep-quantized auto: {size}, more than {AUTO_SHARE:.0%} of the "
                                  f"{available / GiB:.2f} GiB available: the GGUF blocks stay quantized")
    return KeepDecision(False, f"--keep-quantized auto: {size} of the {available / GiB:.2f} GiB available: dequantized "
                               "(faster than the quantized kernels where it fits; --keep-quantized on keeps the blocks)")
