"""Types of the C extension built from csrc/kvx_cma.c; the twin is cma_py.py."""

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
