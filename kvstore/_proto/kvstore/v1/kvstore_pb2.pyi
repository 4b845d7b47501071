from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATE_UNSPECIFIED: _ClassVar[PrefetchState]
    PREFETCH_STATE_QUEUED: _ClassVar[PrefetchState]
    PREFETCH_STATE_RUNNING: _ClassVar[PrefetchState]
    PREFETCH_STATE_DONE: _ClassVar[PrefetchState]
    PREFETCH_STATE_CANCELLED: _ClassVar[PrefetchState]
PREFETCH_STATE_UNSPECIFIED: PrefetchState
PREFETCH_STATE_QUEUED: PrefetchState
PREFETCH_STATE_RUNNING: PrefetchState
PREFETCH_STATE_DONE: PrefetchState
PREFETCH_STATE_CANCELLED: PrefetchState

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "tiers")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hits: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "retention_s", "retention_tiers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    RETENTION_TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    retention_s: float
    retention_tiers: str
    def __init__(self, namespace: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., retention_s: _Optional[float] = ..., retention_tiers: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "dropped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    dropped: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "sealed")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sealed: bool
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., sealed: _Optional[bool] = ...) -> None: ...

class GetResult(_message.Message):
    __slots__ = ("index", "found", "value", "tier", "header")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    value: bytes
    tier: str
    header: bytes
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., value: _Optional[bytes] = ..., tier: _Optional[str] = ..., header: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GetResult, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys", "namespace")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "blocks")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    blocks: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., blocks: _Optional[int] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("shm_socket", "ucx_address", "instance_id")
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    shm_socket: str
    ucx_address: str
    instance_id: bytes
    def __init__(self, shm_socket: _Optional[str] = ..., ucx_address: _Optional[str] = ..., instance_id: _Optional[bytes] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class PrefetchStatusRequest(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class PrefetchStatusResponse(_message.Message):
    __slots__ = ("state", "total", "ready", "missing", "failed")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    state: PrefetchState
    total: int
    ready: int
    missing: int
    failed: int
    def __init__(self, state: _Optional[_Union[PrefetchState, str]] = ..., total: _Optional[int] = ..., ready: _Optional[int] = ..., missing: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class CancelPrefetchRequest(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class CancelPrefetchResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class KeySchemeRequest(_message.Message):
    __slots__ = ("namespace", "secret_check")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SECRET_CHECK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    secret_check: str
    def __init__(self, namespace: _Optional[str] = ..., secret_check: _Optional[str] = ...) -> None: ...

class KeySchemeResponse(_message.Message):
    __slots__ = ("chunk_size", "hash_algorithm", "secret_env", "secret_check")
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SECRET_ENV_FIELD_NUMBER: _ClassVar[int]
    SECRET_CHECK_FIELD_NUMBER: _ClassVar[int]
    chunk_size: int
    hash_algorithm: str
    secret_env: str
    secret_check: str
    def __init__(self, chunk_size: _Optional[int] = ..., hash_algorithm: _Optional[str] = ..., secret_env: _Optional[str] = ..., secret_check: _Optional[str] = ...) -> None: ...
