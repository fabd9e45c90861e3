from kvx.v1 import agent_pb2 as _agent_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_OTHER: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_OTHER: Role

class AgentRecord(_message.Message):
    __slots__ = ("name", "epoch", "role", "labels", "metadata", "engine_info", "lease_id", "registered_unix_ms", "revision", "started_unix_ms")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EngineInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INFO_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    role: Role
    labels: _containers.ScalarMap[str, str]
    metadata: _agent_pb2.AgentMetadata
    engine_info: _containers.ScalarMap[str, str]
    lease_id: int
    registered_unix_ms: int
    revision: int
    started_unix_ms: int
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., metadata: _Optional[_Union[_agent_pb2.AgentMetadata, _Mapping]] = ..., engine_info: _Optional[_Mapping[str, str]] = ..., lease_id: _Optional[int] = ..., registered_unix_ms: _Optional[int] = ..., revision: _Optional[int] = ..., started_unix_ms: _Optional[int] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("record", "ttl_s", "lease_id")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    record: AgentRecord
    ttl_s: int
    lease_id: int
    def __init__(self, record: _Optional[_Union[AgentRecord, _Mapping]] = ..., ttl_s: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_s", "revision")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_s: int
    revision: int
    def __init__(self, lease_id: _Optional[int] = ..., ttl_s: _Optional[int] = ..., revision: _Optional[int] = ...) -> None: ...

class RegisterAgentsRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RegisterAgentRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[RegisterAgentRequest, _Mapping]]] = ...) -> None: ...

class RegisterAgentsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RegisterAgentResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RegisterAgentResult, _Mapping]]] = ...) -> None: ...

class RegisterAgentResult(_message.Message):
    __slots__ = ("code", "message", "response", "retry_after_ms", "lease_etcd_term")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ETCD_TERM_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    response: RegisterAgentResponse
    retry_after_ms: int
    lease_etcd_term: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[_Union[RegisterAgentResponse, _Mapping]] = ..., retry_after_ms: _Optional[int] = ..., lease_etcd_term: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_s", "ttls_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TTLS_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_s: int
    ttls_s: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., ttl_s: _Optional[int] = ..., ttls_s: _Optional[_Iterable[int]] = ...) -> None: ...

class UnregisterAgentRequest(_message.Message):
    __slots__ = ("name", "epoch", "lease_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    lease_id: int
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class UnregisterAgentResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: bool = ...) -> None: ...

class GetAgentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAgentResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: AgentRecord
    def __init__(self, record: _Optional[_Union[AgentRecord, _Mapping]] = ...) -> None: ...

class GetAgentsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetAgentsResponse(_message.Message):
    __slots__ = ("records", "answered")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AgentRecord]
    answered: int
    def __init__(self, records: _Optional[_Iterable[_Union[AgentRecord, _Mapping]]] = ..., answered: _Optional[int] = ...) -> None: ...

class ListAgentsRequest(_message.Message):
    __slots__ = ("role", "labels", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    role: Role
    labels: _containers.ScalarMap[str, str]
    page_size: int
    page_token: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AgentRecord]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[AgentRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchAgentsRequest(_message.Message):
    __slots__ = ("role", "labels", "names", "batch_bytes")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: Role
    labels: _containers.ScalarMap[str, str]
    names: _containers.RepeatedScalarFieldContainer[str]
    batch_bytes: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., names: _Optional[_Iterable[str]] = ..., batch_bytes: _Optional[int] = ...) -> None: ...

class WatchAgentsResponse(_message.Message):
    __slots__ = ("type", "record", "revision", "events")
    class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EVENT_TYPE_UNSPECIFIED: _ClassVar[WatchAgentsResponse.EventType]
        EVENT_TYPE_PUT: _ClassVar[WatchAgentsResponse.EventType]
        EVENT_TYPE_DELETE: _ClassVar[WatchAgentsResponse.EventType]
        EVENT_TYPE_SYNCED: _ClassVar[WatchAgentsResponse.EventType]
    EVENT_TYPE_UNSPECIFIED: WatchAgentsResponse.EventType
    EVENT_TYPE_PUT: WatchAgentsResponse.EventType
    EVENT_TYPE_DELETE: WatchAgentsResponse.EventType
    EVENT_TYPE_SYNCED: WatchAgentsResponse.EventType
    TYPE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    type: WatchAgentsResponse.EventType
    record: AgentRecord
    revision: int
    events: _containers.RepeatedCompositeFieldContainer[WatchAgentsResponse]
    def __init__(self, type: _Optional[_Union[WatchAgentsResponse.EventType, str]] = ..., record: _Optional[_Union[AgentRecord, _Mapping]] = ..., revision: _Optional[int] = ..., events: _Optional[_Iterable[_Union[WatchAgentsResponse, _Mapping]]] = ...) -> None: ...
