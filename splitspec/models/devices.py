"""Device and dtype flags shared by the workers (a ROCm build of torch also answers to ``cuda:N``)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


AUTO = "auto"


def auto_device() -> str:
    """What ``--device auto`` means here: the first GPU (``cuda:0``) when this torch build sees one
    (``torch.cuda.is_available()`` is true for CUDA and ROCm builds alike), else ``cpu``."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str) -> torch.device:
    """The device of a ``--device`` flag (``cpu``, ``cuda``, ``cuda:N`` or ``auto``, see
    ``auto_device``); a GPU also becomes the process's current device, which libraries that follow
    it (cuBLAS, CUDA graph capture) then use. ``cuda`` without an index is the current device
    (``cuda:0`` unless ``CUDA_VISIBLE_DEVICES`` or the process chose another): ``torch.cuda.set_device``
    refuses a device without one."""
    if name.strip().lower() == AUTO:
        name = auto_device()
    try:
        device = torch.device(name)
    except RuntimeError as exc:  # torch's own message lists every device type it knows
        raise ValueError(f"--device {name}: use auto, cpu or cuda:N") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch build sees no CUDA/ROCm GPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: use auto, cpu or cuda:N")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on GPUs and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name}: choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def backend_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"
