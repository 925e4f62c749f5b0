from kvfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_scope", "cache_salt", "adapter", "sampling", "deadline_unix_s", "tenant", "priority", "peer", "json_object", "json_schema", "regex", "grammar")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_scope: str
    cache_salt: str
    adapter: str
    sampling: _common_pb2.SamplingParams
    deadline_unix_s: float
    tenant: str
    priority: int
    peer: PeerHint
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_scope: _Optional[str] = ..., cache_salt: _Optional[str] = ..., adapter: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline_unix_s: _Optional[float] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., peer: _Optional[_Union[PeerHint, _Mapping]] = ..., json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class PeerHint(_message.Message):
    __slots__ = ("replica_id", "address", "num_blocks", "first_block", "tier_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    num_blocks: int
    first_block: int
    tier_id: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., first_block: _Optional[int] = ..., tier_id: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("call_id", "generate", "cancel", "trace_context", "keepalive_s")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    generate: WorkerGenerateRequest
    cancel: bool
    trace_context: _containers.ScalarMap[str, str]
    keepalive_s: float
    def __init__(self, call_id: _Optional[int] = ..., generate: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., keepalive_s: _Optional[float] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("call_id", "message", "done", "status_code", "status_message", "worker_duration_s", "waiting")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    message: _common_pb2.GenerateResponse
    done: bool
    status_code: int
    status_message: str
    worker_duration_s: float
    waiting: bool
    def __init__(self, call_id: _Optional[int] = ..., message: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ..., done: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., worker_duration_s: _Optional[float] = ..., waiting: _Optional[bool] = ...) -> None: ...

class GenerateStreamBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[GenerateStreamResponse]
    def __init__(self, frames: _Optional[_Iterable[_Union[GenerateStreamResponse, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("replica_id", "running", "waiting", "num_free_blocks", "num_total_blocks", "block_size", "epoch", "model", "tensor_parallel_size", "ranks")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    running: int
    waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    epoch: int
    model: str
    tensor_parallel_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankStatus]
    def __init__(self, replica_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., model: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankStatus, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running", "ended_by_timeout")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    running: int
    ended_by_timeout: int
    def __init__(self, running: _Optional[int] = ..., ended_by_timeout: _Optional[int] = ...) -> None: ...

class ExportBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "timeout_s")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    timeout_s: float
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ExportBlocksResponse(_message.Message):
    __slots__ = ("block_hashes", "node_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    node_id: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., node_id: _Optional[str] = ...) -> None: ...
