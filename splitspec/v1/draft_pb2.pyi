from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfo(_message.Message):
    __slots__ = ("target_geometry", "block_size", "mask_token_id", "target_layer_ids", "num_layers", "path", "live_sequences", "max_top_k", "context_bytes")
    TARGET_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_geometry: _common_pb2.ModelGeometry
    block_size: int
    mask_token_id: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    path: str
    live_sequences: int
    max_top_k: int
    context_bytes: int
    def __init__(self, target_geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., block_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., path: _Optional[str] = ..., live_sequences: _Optional[int] = ..., max_top_k: _Optional[int] = ..., context_bytes: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequence_id", "anchor_token", "anchor_position", "features", "top_k", "window", "tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    anchor_token: int
    anchor_position: int
    features: _common_pb2.Tensor
    top_k: int
    window: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., anchor_token: _Optional[int] = ..., anchor_position: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_k: _Optional[int] = ..., window: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("top_ids", "top_logprobs", "forward_ns")
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    top_ids: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    forward_ns: int
    def __init__(self, top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., forward_ns: _Optional[int] = ...) -> None: ...
