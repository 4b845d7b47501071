from kvstore._proto.kvstore.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class UcxBindRequest(_message.Message):
    __slots__ = ("client_ids", "versions")
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    client_ids: _containers.RepeatedScalarFieldContainer[bytes]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_ids: _Optional[_Iterable[bytes]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class UcxBindResponse(_message.Message):
    __slots__ = ("key", "version", "max_message_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    version: int
    max_message_bytes: int
    def __init__(self, key: _Optional[bytes] = ..., version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class UcxGetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "client_id", "transfer_id", "sizes", "sealed", "lanes", "joined", "receive_any", "messages")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_ANY_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    client_id: bytes
    transfer_id: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    sealed: bool
    lanes: _containers.RepeatedScalarFieldContainer[bytes]
    joined: _containers.RepeatedScalarFieldContainer[bool]
    receive_any: bool
    messages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., client_id: _Optional[bytes] = ..., transfer_id: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., sealed: _Optional[bool] = ..., lanes: _Optional[_Iterable[bytes]] = ..., joined: _Optional[_Iterable[bool]] = ..., receive_any: _Optional[bool] = ..., messages: _Optional[_Iterable[int]] = ...) -> None: ...

class UcxGetResponse(_message.Message):
    __slots__ = ("lengths", "sent", "tiers", "checksums", "headers", "messages")
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    sent: _containers.RepeatedScalarFieldContainer[bool]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    headers: _containers.RepeatedScalarFieldContainer[bytes]
    messages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lengths: _Optional[_Iterable[int]] = ..., sent: _Optional[_Iterable[bool]] = ..., tiers: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ..., headers: _Optional[_Iterable[bytes]] = ..., messages: _Optional[_Iterable[int]] = ...) -> None: ...

class UcxPutRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lengths", "client_id", "transfer_id", "lanes", "messages")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    client_id: bytes
    transfer_id: int
    lanes: _containers.RepeatedScalarFieldContainer[bytes]
    messages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lengths: _Optional[_Iterable[int]] = ..., client_id: _Optional[bytes] = ..., transfer_id: _Optional[int] = ..., lanes: _Optional[_Iterable[bytes]] = ..., messages: _Optional[_Iterable[int]] = ...) -> None: ...
