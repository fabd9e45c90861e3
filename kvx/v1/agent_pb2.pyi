from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_TCP: _ClassVar[Backend]
    BACKEND_SHM: _ClassVar[Backend]
    BACKEND_CUDA_IPC: _ClassVar[Backend]
    BACKEND_RDMA: _ClassVar[Backend]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_HOST: _ClassVar[MemoryKind]
    MEMORY_KIND_CUDA: _ClassVar[MemoryKind]
BACKEND_UNSPECIFIED: Backend
BACKEND_TCP: Backend
BACKEND_SHM: Backend
BACKEND_CUDA_IPC: Backend
BACKEND_RDMA: Backend
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_HOST: MemoryKind
MEMORY_KIND_CUDA: MemoryKind

class Endpoint(_message.Message):
    __slots__ = ("backend", "address")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    address: str
    def __init__(self, backend: _Optional[_Union[Backend, str]] = ..., address: _Optional[str] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("id", "size_bytes", "memory_kind", "device", "address", "remote_read", "remote_write", "cuda_ipc", "shared_segment")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READ_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHARED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    size_bytes: int
    memory_kind: MemoryKind
    device: int
    address: int
    remote_read: bool
    remote_write: bool
    cuda_ipc: bool
    shared_segment: bool
    def __init__(self, id: _Optional[int] = ..., size_bytes: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., device: _Optional[int] = ..., address: _Optional[int] = ..., remote_read: bool = ..., remote_write: bool = ..., cuda_ipc: bool = ..., shared_segment: bool = ...) -> None: ...

class AgentMetadata(_message.Message):
    __slots__ = ("protocol_version", "name", "epoch", "endpoints", "regions", "host_name", "boot_id", "pid", "auth_required", "shm_probe_address", "segment_socket")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    name: str
    epoch: int
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    host_name: str
    boot_id: str
    pid: int
    auth_required: bool
    shm_probe_address: int
    segment_socket: str
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ..., epoch: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., host_name: _Optional[str] = ..., boot_id: _Optional[str] = ..., pid: _Optional[int] = ..., auth_required: bool = ..., shm_probe_address: _Optional[int] = ..., segment_socket: _Optional[str] = ...) -> None: ...
