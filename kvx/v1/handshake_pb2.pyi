from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("name", "epoch", "target_name", "target_epoch", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    target_name: str
    target_epoch: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., target_name: _Optional[str] = ..., target_epoch: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("name", "epoch", "nonce", "auth_required", "proof", "max_message_bytes", "max_descs_per_message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DESCS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    nonce: bytes
    auth_required: bool
    proof: bytes
    max_message_bytes: int
    max_descs_per_message: int
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., nonce: _Optional[bytes] = ..., auth_required: bool = ..., proof: _Optional[bytes] = ..., max_message_bytes: _Optional[int] = ..., max_descs_per_message: _Optional[int] = ...) -> None: ...

class Auth(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...
