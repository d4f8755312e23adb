from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfo(_message.Message):
    __slots__ = ("geometry", "eos_token_ids", "max_tree_nodes", "live_sequences", "tokenizer_path", "kv_reserved_tokens", "kv_capacity_tokens")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    geometry: _common_pb2.ModelGeometry
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tree_nodes: int
    live_sequences: int
    tokenizer_path: str
    kv_reserved_tokens: int
    kv_capacity_tokens: int
    def __init__(self, geometry: _Optional[_Union[_common_pb2.ModelGeometry, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_tree_nodes: _Optional[int] = ..., live_sequences: _Optional[int] = ..., tokenizer_path: _Optional[str] = ..., kv_reserved_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("sequence_id", "tokens", "sampling", "tap_layer_ids", "reserve_tokens", "feature_rows", "feature_dtype")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Sampling
    tap_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    reserve_tokens: int
    feature_rows: int
    feature_dtype: str
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., tap_layer_ids: _Optional[_Iterable[int]] = ..., reserve_tokens: _Optional[int] = ..., feature_rows: _Optional[int] = ..., feature_dtype: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("next_token", "features", "forward_ns")
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    next_token: int
    features: _common_pb2.Tensor
    forward_ns: int
    def __init__(self, next_token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sequence_id", "tokens", "parents", "return_features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("committed_tokens", "accepted_nodes", "next_token", "features", "forward_ns", "committed_length")
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    committed_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    features: _common_pb2.Tensor
    forward_ns: int
    committed_length: int
    def __init__(self, committed_tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., forward_ns: _Optional[int] = ..., committed_length: _Optional[int] = ...) -> None: ...
