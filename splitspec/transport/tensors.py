"""Tensors on the wire: dtype name + shape + raw little-endian bytes (``splitspec.v1.Tensor``).

The numpy half is used by the gateway, which never imports torch; the torch half by the
workers. Tap features pass through the gateway as opaque messages, never decoded there.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING

import numpy as np

from splitspec.v1 import common_pb2

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("splitspec's wire format assumes a little-endian host")

_NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64}
ITEM_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


class TensorFormatError(ValueError):
    """A tensor message whose dtype, shape and byte count do not agree."""


def _checked(msg: common_pb2.Tensor) -> tuple[tuple[int, ...], bytes]:
    """The message's shape and bytes, checked against each other. Reading ``msg.data`` copies the
    bytes (protobuf's upb runtime), so it is read here once: a prompt's features are tens of MB."""
    shape, data = tuple(int(d) for d in msg.shape), msg.data
    check_tensor(msg.dtype, shape, len(data))
    return shape, data


def check_tensor(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """Refuses (``TensorFormatError``) a tensor whose dtype, shape and byte count do not agree."""
    if dtype not in ITEM_SIZES:
        raise TensorFormatError(f"unknown tensor dtype {dtype!r} (allowed: {', '.join(ITEM_SIZES)})")
    if any(d < 0 for d in shape):
        raise TensorFormatError(f"negative dimension in tensor shape {shape}")
    expected = math.prod(shape) * ITEM_SIZES[dtype]
    if nbytes != expected:
        raise TensorFormatError(f"tensor of dtype {dtype} and shape {shape} needs {expected} bytes, got {nbytes}")


def concat_rows(first: common_pb2.Tensor, *rest: common_pb2.Tensor) -> common_pb2.Tensor:
    """The rows of ``first`` then of each of ``rest`` (all ``[rows, ...]`` of one dtype and row
    shape), without decoding any, in one copy: the gateway joins the tap features of the steps the
    draft did not see (a run of them at once, not one by one, which would copy the run's rows again
    at each step)."""
    checked = [_checked(t) for t in (first, *rest)]
    shape = checked[0][0]
    for t, (other, _) in zip(rest, checked[1:]):
        if t.dtype != first.dtype or len(shape) < 1 or other[1:] != shape[1:]:
            raise TensorFormatError(f"cannot join rows of {first.dtype} {shape} and {t.dtype} {other}")
    rows = sum(s[0] for s, _ in checked)
    return common_pb2.Tensor(dtype=first.dtype, shape=[rows, *shape[1:]], data=b"".join(data for _, data in checked))


def last_rows(msg: common_pb2.Tensor, rows: int) -> common_pb2.Tensor:
    """The last ``rows`` rows of ``msg`` (``[n, ...]``; all of them when ``n <= rows``), undecoded."""
    shape, data = _checked(msg)
    if shape[0] <= rows:
        return msg
    row_bytes = len(data) // shape[0]  # shape[0] > rows >= 0
    return common_pb2.Tensor(dtype=msg.dtype, shape=[rows, *shape[1:]], data=data[len(data) - rows * row_bytes :])


def array_to_pb(array: np.ndarray) -> common_pb2.Tensor:
    name = np.dtype(array.dtype).name
    if name not in _NUMPY_DTYPES:
        raise TensorFormatError(f"cannot send numpy dtype {name}")
    return common_pb2.Tensor(dtype=name, shape=list(array.shape), data=np.ascontiguousarray(array).tobytes())


def array_from_pb(msg: common_pb2.Tensor) -> np.ndarray:
    shape, data = _checked(msg)
    if msg.dtype == "bfloat16":
        raise TensorFormatError("bfloat16 tensors cannot be decoded without torch")
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[msg.dtype]).reshape(shape)


def tensor_to_pb(tensor: torch.Tensor, dtype: str | None = None) -> common_pb2.Tensor:
    """Serialise a torch tensor, optionally cast to the wire ``dtype`` name first."""
    import torch

    if dtype:
        tensor = tensor.to(getattr(torch, dtype))
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ITEM_SIZES:
        raise TensorFormatError(f"cannot send torch dtype {name}")
    flat = tensor.detach().contiguous().cpu()
    if name == "bfloat16":
        flat = flat.view(torch.int16)
    return common_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=flat.numpy().tobytes())


class TensorSpliced:
    """A message and one ``Tensor`` field of it kept out, serialized in parts (:meth:`wire_parts`):
    the message's own bytes, then the field's encoding with the tensor's bytes by reference. Appended
    to a message's bytes a field reads as set (a protobuf parser takes fields in any order), so the
    receiver parses the whole as the message with the field. The step socket writes the parts one
    after the other: a prompt's tap features (21 MB for the 8B shape) then leave the target with no
    copy on its event loop (the kernel's into the socket aside), where ``tensor_to_pb``, building
    the message and serializing it copied them four times (``scripts/prompt_features_wire.py``,
    BENCHMARKS.md [S17] i). ``tensor`` is a torch tensor (the target's features: its memory is
    written as is) or a ``Tensor`` message (the gateway's relay: its bytes are read out once)."""

    def __init__(self, message, field: str, tensor: torch.Tensor | common_pb2.Tensor) -> None:
        self.message = message
        number = message.DESCRIPTOR.fields_by_name[field].number
        if isinstance(tensor, common_pb2.Tensor):
            shape, self.data = _checked(tensor)
            dtype = tensor.dtype
        else:
            import torch

            flat = tensor.detach().contiguous().cpu()
            dtype, shape = str(flat.dtype).removeprefix("torch."), flat.shape
            if dtype not in ITEM_SIZES:
                raise TensorFormatError(f"cannot send torch dtype {dtype}")
            # A view of the tensor's memory (it keeps the tensor alive until the socket sent it).
            self.data = memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else b""
        head = common_pb2.Tensor(dtype=dtype, shape=list(shape)).SerializeToString() + _varint(_DATA_TAG) + _varint(len(self.data))
        # The field's tag and length, then the Tensor's own fields but its data's bytes.
        self.head = _varint(number << 3 | _LENGTH_DELIMITED) + _varint(len(head) + len(self.data)) + head

    @property
    def sequence_id(self) -> str:  # a step client keys the sequence's connection by it
        return self.message.sequence_id

    def wire_parts(self) -> list:
        """The message's serialization in order: bytes, then the tensor's bytes."""
        return [self.message.SerializeToString() + self.head, self.data]

    def ByteSize(self) -> int:
        return self.message.ByteSize() + len(self.head) + len(self.data)

    def SerializeToString(self) -> bytes:
        """The parts joined (a copy): the bytes a caller that wants one buffer sends."""
        return b"".join(self.wire_parts())


_LENGTH_DELIMITED = 2  # protobuf's wire type of bytes, strings and messages
_DATA_TAG = common_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number << 3 | _LENGTH_DELIMITED


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def wire_parts(message) -> list:
    """A message's serialization as parts to write in order (one, unless it is :class:`TensorSpliced`)."""
    return message.wire_parts() if isinstance(message, TensorSpliced) else [message.SerializeToString()]


def tensor_from_pb(msg: common_pb2.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The message's tensor. On the CPU it views the bytes read out of the message, which nothing
    else holds, without a second copy (a prompt's features are tens of MB): it is read-only."""
    shape, data = _checked(msg)
    return tensor_over(msg.dtype, shape, data).to(device)


def tensor_over(dtype: str, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A CPU tensor over ``data`` (checked against ``dtype`` and ``shape`` by the caller), no copy."""
    import torch

    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # that bytes are not writable: they are not written
        return torch.frombuffer(data, dtype=getattr(torch, dtype)).view(shape)
