"""``TensorFieldReader``: a message's tensor field read in place equals protobuf's parse of it."""

import random

import pytest
import torch
from google.protobuf.message import DecodeError

from splitspec.transport.received import TensorFieldReader
from splitspec.transport.tensors import TensorFormatError, TensorSpliced, tensor_from_pb, tensor_to_pb
from splitspec.v1 import common_pb2, draft_pb2

READER = TensorFieldReader(draft_pb2.ProposeRequest, "features")


def request(**fields) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        sequence_id="seq-7", anchor_token=11, anchor_position=300, top_k=8, window=64, tokens=[3, 1, 4, 1, 5], context=9, depths=6, **fields
    )


def protobuf_reads(payload: bytes | bytearray):
    """What protobuf's parse gives: the message without the features, and their tensor (None when
    the field is unset or empty); raises as it and ``tensor_from_pb`` do."""
    message = draft_pb2.ProposeRequest.FromString(bytes(payload))
    tensor = tensor_from_pb(message.features) if message.features.ByteSize() else None
    message.ClearField("features")
    return message, tensor


def assert_reads_as_protobuf(payload: bytes | bytearray) -> None:
    message, tensor = protobuf_reads(payload)
    received = READER.FromString(payload)
    assert received.message == message and received.sequence_id == message.sequence_id
    if tensor is None:
        assert received.tensor is None
    else:
        got = received.tensor.to_torch()
        assert got.shape == tensor.shape and torch.equal(got.flatten().view(torch.uint8), tensor.flatten().view(torch.uint8))  # NaNs too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_spliced_and_encoded_fields_read_in_place(dtype, rows):
    """Features spliced after the other fields (the step socket's sender) or encoded in field
    order (a gRPC-style sender) read as protobuf parses them, 300 rows with a multi-byte length."""
    features = (torch.randn(rows, 40) * 10).to(dtype)
    assert_reads_as_protobuf(bytearray(TensorSpliced(request(), "features", features).SerializeToString()))
    assert_reads_as_protobuf(request(features=tensor_to_pb(features)).SerializeToString())


def test_the_tensor_views_the_received_bytes():
    features = torch.randn(4, 8)
    payload = bytearray(TensorSpliced(request(), "features", features).SerializeToString())
    tensor = READER.FromString(payload).tensor.to_torch()
    assert torch.equal(tensor, features)
    payload[-4:] = bytes(4)  # the last float's bytes
    assert tensor[-1, -1] == 0  # no copy was made


def test_no_field_an_empty_field_and_a_field_given_twice():
    assert_reads_as_protobuf(request().SerializeToString())  # not set
    assert_reads_as_protobuf(request(features=common_pb2.Tensor()).SerializeToString())  # set to nothing
    first = request(features=common_pb2.Tensor(dtype="float32", shape=[1, 2], data=bytes(8))).SerializeToString()
    second = draft_pb2.ProposeRequest(features=common_pb2.Tensor(data=bytes(range(8)))).SerializeToString()
    assert_reads_as_protobuf(first + second)  # protobuf merges the two: the reader gives its parse
    empty = request(features=common_pb2.Tensor()).SerializeToString()
    assert_reads_as_protobuf(empty + empty)  # twice, and empty


@pytest.mark.parametrize(
    "tensor,error",
    [
        (common_pb2.Tensor(dtype="float32", shape=[2, 3], data=bytes(20)), "needs 24 bytes, got 20"),
        (common_pb2.Tensor(dtype="float32", shape=[-1, 3], data=bytes(12)), "negative dimension"),
        (common_pb2.Tensor(dtype="complex64", shape=[1], data=bytes(8)), "unknown tensor dtype 'complex64'"),
    ],
)
def test_an_inconsistent_tensor_is_refused(tensor, error):
    with pytest.raises(TensorFormatError, match=error):
        READER.FromString(request(features=tensor).SerializeToString())


def test_damaged_bytes_are_refused_or_read_as_protobuf_reads_them():
    """Every truncation and a few hundred random byte changes of a valid request: the reader raises
    where protobuf's parse (or the tensor's check) raises, and agrees with it otherwise."""
    payload = TensorSpliced(request(), "features", torch.randn(3, 6, generator=torch.Generator().manual_seed(1))).SerializeToString()
    rng = random.Random(5)
    damaged = [payload[:n] for n in range(len(payload))]
    for _ in range(300):
        b = bytearray(payload)
        b[rng.randrange(len(b))] = rng.randrange(256)
        damaged.append(bytes(b))
    refused = 0
    for data in damaged:
        try:
            protobuf_reads(data)
        except (DecodeError, TensorFormatError):
            refused += 1
            with pytest.raises((DecodeError, TensorFormatError)):
                READER.FromString(data)
        else:
            assert_reads_as_protobuf(data)
    assert 0 < refused < len(damaged)
