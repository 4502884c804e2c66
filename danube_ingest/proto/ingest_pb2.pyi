from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
    COMPRESSION_LZ4: _ClassVar[Compression]

class SubscriptionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXCLUSIVE: _ClassVar[SubscriptionType]
    SHARED: _ClassVar[SubscriptionType]
    FAILOVER: _ClassVar[SubscriptionType]
    KEY_SHARED: _ClassVar[SubscriptionType]

class StartKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    START_LATEST: _ClassVar[StartKind]
    START_EARLIEST: _ClassVar[StartKind]
    START_OFFSET: _ClassVar[StartKind]
    START_TIME: _ClassVar[StartKind]
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression
COMPRESSION_LZ4: Compression
EXCLUSIVE: SubscriptionType
SHARED: SubscriptionType
FAILOVER: SubscriptionType
KEY_SHARED: SubscriptionType
START_LATEST: StartKind
START_EARLIEST: StartKind
START_OFFSET: StartKind
START_TIME: StartKind

class PublishRequest(_message.Message):
    __slots__ = ("topic", "producer_id", "sequence", "count", "entries", "sizes", "crc32c", "compression", "request_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    producer_id: int
    sequence: int
    count: int
    entries: bytes
    sizes: bytes
    crc32c: int
    compression: Compression
    request_id: int
    def __init__(self, topic: _Optional[str] = ..., producer_id: _Optional[int] = ..., sequence: _Optional[int] = ..., count: _Optional[int] = ..., entries: _Optional[bytes] = ..., sizes: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., request_id: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("request_id", "code", "error", "base_offset", "count", "duplicate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    code: int
    error: str
    base_offset: int
    count: int
    duplicate: bool
    def __init__(self, request_id: _Optional[int] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., base_offset: _Optional[int] = ..., count: _Optional[int] = ..., duplicate: bool = ...) -> None: ...

class ConsumeRequest(_message.Message):
    __slots__ = ("subscribe", "ack")
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    subscribe: Subscribe
    ack: RangeAck
    def __init__(self, subscribe: _Optional[_Union[Subscribe, _Mapping]] = ..., ack: _Optional[_Union[RangeAck, _Mapping]] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("topic", "subscription", "consumer_name", "type", "key_filters", "start", "start_value", "max_batch")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FILTERS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    START_VALUE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subscription: str
    consumer_name: str
    type: SubscriptionType
    key_filters: _containers.RepeatedScalarFieldContainer[str]
    start: StartKind
    start_value: int
    max_batch: int
    def __init__(self, topic: _Optional[str] = ..., subscription: _Optional[str] = ..., consumer_name: _Optional[str] = ..., type: _Optional[_Union[SubscriptionType, str]] = ..., key_filters: _Optional[_Iterable[str]] = ..., start: _Optional[_Union[StartKind, str]] = ..., start_value: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class RangeAck(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class ConsumeResponse(_message.Message):
    __slots__ = ("topic", "entries", "sizes", "offsets", "count", "consumer_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    entries: bytes
    sizes: bytes
    offsets: bytes
    count: int
    consumer_id: int
    def __init__(self, topic: _Optional[str] = ..., entries: _Optional[bytes] = ..., sizes: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., count: _Optional[int] = ..., consumer_id: _Optional[int] = ...) -> None: ...
