import numpy as np
import pytest
import torch

from splitspec.transport.tensors import (
    TensorFormatError,
    TensorSpliced,
    array_from_pb,
    array_to_pb,
    concat_rows,
    last_rows,
    tensor_from_pb,
    tensor_to_pb,
    wire_parts,
)
from splitspec.v1 import common_pb2, target_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_tensors_round_trip_exactly_and_come_back_writable(dtype):
    tensor = (torch.randn(3, 5) * 100).to(dtype)
    back = tensor_from_pb(tensor_to_pb(tensor))
    assert back.dtype == dtype and torch.equal(back, tensor)
    back += 1  # owns its memory: no read-only buffer behind it
    assert not torch.equal(back, tensor)


def test_cast_to_a_wire_dtype_and_numpy_side():
    tensor = torch.randn(2, 4)
    assert tensor_from_pb(tensor_to_pb(tensor, "bfloat16")).dtype == torch.bfloat16
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.array_equal(array_from_pb(array_to_pb(array)), array)
    with pytest.raises(TensorFormatError, match="without torch"):
        array_from_pb(tensor_to_pb(tensor, "bfloat16"))


@pytest.mark.parametrize(
    "message,error",
    [
        (common_pb2.Tensor(dtype="float32", shape=[2, 3], data=bytes(20)), "needs 24 bytes, got 20"),
        (common_pb2.Tensor(dtype="float32", shape=[-1, 3], data=bytes(12)), "negative dimension"),
        (common_pb2.Tensor(dtype="complex64", shape=[1], data=bytes(8)), "unknown tensor dtype 'complex64'"),
        (common_pb2.Tensor(dtype="float16", shape=[2**40, 2**40], data=bytes(2)), "needs 2417851639229258349412352 bytes"),  # no overflow
    ],
)
def test_inconsistent_messages_are_refused(message, error):
    with pytest.raises(TensorFormatError, match=error):
        tensor_from_pb(message)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_join_and_cut_without_decoding(dtype):
    """The gateway joins the features of steps the draft missed, and keeps a window's last rows."""
    a, b = torch.randn(3, 2, 5).to(dtype), torch.randn(4, 2, 5).to(dtype)
    joined = concat_rows(tensor_to_pb(a), tensor_to_pb(b))
    assert torch.equal(tensor_from_pb(joined), torch.cat([a, b]))
    assert torch.equal(tensor_from_pb(last_rows(joined, 5)), torch.cat([a, b])[-5:])
    assert last_rows(joined, 7) is joined and last_rows(joined, 9) is joined
    c = torch.randn(1, 2, 5).to(dtype)
    assert torch.equal(tensor_from_pb(concat_rows(*(tensor_to_pb(t) for t in (a, b, c)))), torch.cat([a, b, c]))
    assert torch.equal(tensor_from_pb(concat_rows(tensor_to_pb(a))), a)
    with pytest.raises(TensorFormatError, match="cannot join"):
        concat_rows(tensor_to_pb(a), tensor_to_pb(torch.randn(4, 2, 6).to(dtype)))
    with pytest.raises(TensorFormatError, match="cannot join"):
        concat_rows(tensor_to_pb(a), tensor_to_pb(b.float() if dtype == torch.bfloat16 else b.half()))
    with pytest.raises(TensorFormatError, match="cannot join"):
        concat_rows(tensor_to_pb(a), tensor_to_pb(b), tensor_to_pb(torch.randn(1, 3, 5).to(dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 37, 300])  # 300 rows of 40 columns: a length past one varint byte's
def test_a_spliced_tensor_field_parses_as_the_message_with_it(dtype, rows):
    """The step socket's Prefill sends its features by reference: the message's bytes then the
    field's, written in parts. Parsed, they are the message with the field set, bit for bit."""
    features = (torch.randn(rows, 40) * 100).to(dtype)
    logprob = common_pb2.TokenLogprob(id=5, logprob=-0.25)
    message = target_pb2.PrefillResponse(next_token=7, forward_ns=123, next_token_logprob=logprob)
    spliced = TensorSpliced(message, "features", features)
    parts = wire_parts(spliced)
    assert any(isinstance(part, memoryview) for part in parts) == (rows > 0)  # the rows go by reference
    parsed = target_pb2.PrefillResponse.FromString(b"".join(parts))
    expected = target_pb2.PrefillResponse(next_token=7, forward_ns=123, next_token_logprob=logprob, features=tensor_to_pb(features))
    assert parsed == expected and spliced.SerializeToString() == b"".join(parts) and spliced.ByteSize() == len(b"".join(parts))
    assert torch.equal(tensor_from_pb(parsed.features), features)
    # The gateway's relay splices a Tensor message it received: the same bytes.
    assert b"".join(wire_parts(TensorSpliced(message, "features", tensor_to_pb(features)))) == b"".join(parts)
    assert wire_parts(message) == [message.SerializeToString()]  # any other message: its bytes, whole


def test_a_spliced_tensor_of_a_dtype_the_wire_lacks_or_a_bad_message_is_refused():
    with pytest.raises(TensorFormatError, match="torch dtype bool"):
        TensorSpliced(target_pb2.PrefillResponse(), "features", torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(TensorFormatError, match="needs 24 bytes, got 20"):
        TensorSpliced(target_pb2.PrefillResponse(), "features", common_pb2.Tensor(dtype="float32", shape=[2, 3], data=bytes(20)))
