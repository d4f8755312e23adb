"""A received message whose one large ``Tensor`` field is read in place: the receiving end of
``TensorSpliced``.

Parsing a 512-row prompt's features (21 MB for the 8B shape) into a protobuf message and reading
its ``data`` out again copied them twice into fresh memory, 30 ms on the 2-core CPU, most of it
first touches of new pages (``scripts/prompt_features_wire.py``). Here the message's other fields
are parsed by protobuf from their own few bytes, and the tensor's bytes stay where the frame was
received: a ``TensorView`` is a view of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitspec.transport.tensors import check_tensor, tensor_over
from splitspec.v1 import common_pb2

if TYPE_CHECKING:
    import torch

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5  # protobuf's wire types (groups: not used here)
_DATA = common_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number


@dataclass(frozen=True)
class TensorView:
    """A ``Tensor`` message's dtype and shape, checked against its bytes, which are a view of the
    buffer they came in (``data``)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def of(cls, dtype: str, shape: tuple[int, ...], data: memoryview) -> TensorView:
        check_tensor(dtype, shape, len(data))
        return cls(dtype, shape, data)

    def to_torch(self) -> torch.Tensor:
        """The tensor over the same bytes (no copy; it keeps the received buffer alive)."""
        return tensor_over(self.dtype, self.shape, self.data)


@dataclass(frozen=True)
class Received:
    """A message parsed without its tensor field (``message``) and that field (``tensor``; None:
    not set)."""

    message: Any
    tensor: TensorView | None

    @property
    def sequence_id(self) -> str:  # the step socket's server keys a sequence's calls by it
        return self.message.sequence_id


class TensorFieldReader:
    """Reads ``message_type`` with its ``Tensor`` field ``field`` in place: ``FromString(payload)``
    gives a :class:`Received` (the step socket's server calls it as it calls a message type's)."""

    def __init__(self, message_type, field: str) -> None:
        self.message_type, self.field = message_type, field
        self.number = message_type.DESCRIPTOR.fields_by_name[field].number

    def FromString(self, payload: bytes | bytearray | memoryview) -> Received:
        buf = memoryview(payload).cast("B")
        try:
            spans = [(start, value, end) for number, start, value, end in _fields(buf, 0, len(buf)) if number == self.number]
            if len(spans) == 1:
                start, value, end = spans[0]
                message = self.message_type.FromString(bytes(buf[:start]) + bytes(buf[end:]))
                return Received(message, _tensor_view(buf[value:end]))
            if not spans:
                return Received(self.message_type.FromString(buf), None)
        except _Unusual:
            pass
        return self._parsed_whole(buf)

    def _parsed_whole(self, buf: memoryview) -> Received:
        """Protobuf's own parse (which raises on bad bytes) and the field copied out: for what a
        splicing sender never writes, a field given twice (merged) or a group."""
        message = self.message_type.FromString(buf)
        tensor = getattr(message, self.field)
        view = TensorView.of(tensor.dtype, tuple(tensor.shape), memoryview(tensor.data)) if tensor.ByteSize() else None
        message.ClearField(self.field)
        return Received(message, view)


class _Unusual(ValueError):
    """Bytes this reader leaves to protobuf's parse: malformed, or valid in ways it does not read."""


def _tensor_view(buf: memoryview) -> TensorView | None:
    """The view of a ``Tensor`` message's bytes ``buf``; None for an empty one (the field set to
    nothing, as a sender with no rows may)."""
    if not buf:
        return None
    spans = [(start, value, end) for number, start, value, end in _fields(buf, 0, len(buf)) if number == _DATA]
    if len(spans) > 1:
        raise _Unusual("data given twice")
    start, value, end = spans[0] if spans else (len(buf), len(buf), len(buf))
    header = common_pb2.Tensor.FromString(bytes(buf[:start]) + bytes(buf[end:]))
    return TensorView.of(header.dtype, tuple(int(d) for d in header.shape), buf[value:end])


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Each top-level field of ``buf[pos:end]``: (number, where its tag starts, where its value
    starts (a length-delimited one's after its length), where it ends)."""
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos, end)
        wire = key & 7
        if wire == _VARINT:
            value = pos
            _, pos = _varint(buf, pos, end)
        elif wire == _LENGTH_DELIMITED:
            size, value = _varint(buf, pos, end)
            pos = value + size
        elif wire in (_FIXED64, _FIXED32):
            value = pos
            pos += 8 if wire == _FIXED64 else 4
        else:
            raise _Unusual(f"wire type {wire}")
        if pos > end:
            raise _Unusual("a field runs past the message")
        yield key >> 3, start, value, pos


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Unusual("a varint runs past the message")
