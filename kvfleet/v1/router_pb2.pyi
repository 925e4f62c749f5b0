from kvfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "adapter", "cache_salt", "text", "token_ids", "messages", "sampling", "priority_class", "priority_level", "json_object", "json_schema", "regex", "grammar")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    adapter: str
    cache_salt: str
    text: str
    token_ids: _common_pb2.TokenIds
    messages: _common_pb2.ChatMessages
    sampling: _common_pb2.SamplingParams
    priority_class: str
    priority_level: int
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority_class: _Optional[str] = ..., priority_level: _Optional[int] = ..., json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    messages: _common_pb2.ChatMessages
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "block_size", "num_full_blocks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_full_blocks: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_full_blocks: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_context", "block_size", "identity", "adapters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context: int
    block_size: int
    identity: str
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, name: _Optional[str] = ..., max_context: _Optional[int] = ..., block_size: _Optional[int] = ..., identity: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "revision", "replicas", "resident_replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    revision: str
    replicas: int
    resident_replicas: int
    def __init__(self, name: _Optional[str] = ..., revision: _Optional[str] = ..., replicas: _Optional[int] = ..., resident_replicas: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "model", "epoch", "running", "waiting", "num_free_blocks", "num_total_blocks", "heartbeat_age_s", "tensor_parallel_size", "ranks", "lifecycle")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    model: str
    epoch: int
    running: int
    waiting: int
    num_free_blocks: int
    num_total_blocks: int
    heartbeat_age_s: float
    tensor_parallel_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankStatus]
    lifecycle: ReplicaLifecycle
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., epoch: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankStatus, _Mapping]]] = ..., lifecycle: _Optional[_Union[ReplicaLifecycle, _Mapping]] = ...) -> None: ...

class ReplicaLifecycle(_message.Message):
    __slots__ = ("state", "prefix_hit_rate", "serve_replica", "metrics_address")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SERVE_REPLICA_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    state: str
    prefix_hit_rate: float
    serve_replica: str
    metrics_address: str
    def __init__(self, state: _Optional[str] = ..., prefix_hit_rate: _Optional[float] = ..., serve_replica: _Optional[str] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("router_id", "address", "http_address", "policy", "pid", "started_at_unix_s")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    address: str
    http_address: str
    policy: str
    pid: int
    started_at_unix_s: float
    def __init__(self, router_id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., policy: _Optional[str] = ..., pid: _Optional[int] = ..., started_at_unix_s: _Optional[float] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("replicas", "policy", "index_available", "routers", "redis")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INDEX_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    REDIS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    policy: str
    index_available: bool
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    redis: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., index_available: _Optional[bool] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., redis: _Optional[str] = ...) -> None: ...
