"""Types of the C extension built from csrc/kvx_cma.c; the twin is cma_py.py."""

import array
from typing import Any

from _typeshed import ReadableBuffer

def vm_readv(
    pid: int,
    local_addrs: ReadableBuffer,
    local_lens: ReadableBuffer,
    remote_addrs: ReadableBuffer,
    remote_lens: ReadableBuffer,
    /,
) -> None: ...
def vm_writev(
    pid: int,
    local_addrs: ReadableBuffer,
    local_lens: ReadableBuffer,
    remote_addrs: ReadableBuffer,
    remote_lens: ReadableBuffer,
    /,
) -> None: ...
def memcpyv(dsts: ReadableBuffer, srcs: ReadableBuffer, lens: ReadableBuffer, /) -> None: ...
def descs_bad(descs: ReadableBuffer, flags: ReadableBuffer, sizes: ReadableBuffer, need: int, /) -> int: ...
def leased_copy(
    pid: int,
    writing: bool,
    local_addrs: ReadableBuffer,
    local_lens: ReadableBuffer,
    descs: ReadableBuffer,
    regions: ReadableBuffer,
    lease: ReadableBuffer,
    granted: int,
    /,
) -> int: ...
def leased_post(
    pid: int,
    writing: bool,
    local_descs: ReadableBuffer,
    bases: ReadableBuffer,
    sizes: ReadableBuffer,
    flags: ReadableBuffer,
    need: int,
    mask: int,
    descs: ReadableBuffer,
    regions: ReadableBuffer,
    lease: ReadableBuffer,
    granted: int,
    max_bytes: int,
    /,
) -> int | tuple[int, int]: ...
def conn_leased_post(
    conn: Any,
    pid: int,
    writing: bool,
    local_descs: ReadableBuffer,
    bases: ReadableBuffer,
    sizes: ReadableBuffer,
    flags: ReadableBuffer,
    need: int,
    mask: int,
    descs: ReadableBuffer,
    granted: int,
    max_bytes: int,
    /,
) -> int | tuple[int, int] | None: ...
def leased_triples(
    writing: bool,
    local_descs: ReadableBuffer,
    bases: ReadableBuffer,
    sizes: ReadableBuffer,
    flags: ReadableBuffer,
    devices: ReadableBuffer,
    device: int,
    need: int,
    mask: int,
    descs: ReadableBuffer,
    regions: ReadableBuffer,
    lease: ReadableBuffer,
    granted: int,
    max_bytes: int,
    piece: int,
    out: int,
    out_words: int,
    /,
) -> int | tuple[int, int]: ...
def post_check(
    local_descs: ReadableBuffer,
    bases: ReadableBuffer,
    sizes: ReadableBuffer,
    flags: ReadableBuffer,
    need: int,
    mask: int,
    descs: ReadableBuffer,
    peer_sizes: ReadableBuffer,
    peer_flags: ReadableBuffer,
    peer_need: int,
    max_bytes: int,
    /,
) -> tuple[array.array[int], array.array[int], int] | None: ...
