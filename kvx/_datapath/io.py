"""Selects the implementation of the native byte path: socket scatter-gather
(sendv, recvv), a bounded busy-poll of a socket (wait_readable), a look
at what a socket holds (peek), the tcp target's service of a small READ or
WRITE in one call (serve_read, serve_write), the initiator's receipt of an
expected answer in one call (recv_answer), and
cross-memory attach to same-host processes (vm_readv, vm_writev, and
leased_copy: the shm backend's check of descriptors against a lease,
resolution and copy in one call; leased_post: the same with the local
descriptors resolved against this agent's regions in that call too;
conn_leased_post: leased_post with the connection's lease taken and given
back in that call too; leased_triples: leased_post's checks for a copy the
GPU makes, which writes the copy's triples for the kernel instead of moving
bytes), and the checks of a small transfer before it is posted over a
socket in one call (post_check).

KVX_NATIVE=1 requires the C extension, KVX_NATIVE=0 selects the pure-Python
twin, and unset means the C extension when it was built, else the twin (with
a warning: everything works, only slower).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvx._datapath import cma_py as _cma_py
from kvx._datapath import io_py as _io_py
from kvx.errors import ConfigError

logger = logging.getLogger(__name__)


# Bound by use(): the functions of the implementation in use. Buffers are typed Any because
# numpy arrays, bytes and memoryviews all pass (the C side takes any uint64 buffer).
sendv: Callable[[int, bytes, Any, Any, int], None]
recvv: Callable[[int, Any, Any, int], None]
wait_readable: Callable[[int, int], bool]
peek: Callable[[int, int], bytes]
serve_read: Callable[[int, bytes, int, Any, int, int, int], bytes | None]
serve_write: Callable[[int, bytes, int, int, Any, int, int], bytes | None]
recv_answer: Callable[[int, bytes, Any, Any, int], bool]
vm_readv: Callable[[int, Any, Any, Any, Any], None]
vm_writev: Callable[[int, Any, Any, Any, Any], None]
memcpyv: Callable[[Any, Any, Any], None]
descs_bad: Callable[[Any, Any, Any, int], int]
leased_copy: Callable[[int, bool, Any, Any, Any, Any, Any, int], int]
leased_post: Callable[
    [int, bool, Any, Any, Any, Any, int, int, Any, Any, Any, int, int], int | tuple[int, int]
]
conn_leased_post: Callable[
    [Any, int, bool, Any, Any, Any, Any, int, int, Any, int, int], int | tuple[int, int] | None
]
leased_triples: Callable[..., int | tuple[int, int]]
post_check: Callable[[Any, Any, Any, Any, int, int, Any, Any, Any, int, int], tuple[Any, Any, int] | None]


def _select(choice: str) -> tuple[tuple[ModuleType, ModuleType], str]:
    """((socket I/O module, cross-memory module), name) for a KVX_NATIVE value."""
    choice = choice.strip()
    if choice not in ("", "0", "1"):
        raise ConfigError(f"KVX_NATIVE must be 0, 1 or unset, not {choice!r}")
    if choice == "0":
        return (_io_py, _cma_py), "python"
    try:
        from kvx._datapath import _cma, _native
    except ImportError as exc:
        if choice == "1":
            raise ConfigError(
                "KVX_NATIVE=1 but the C extensions kvx._datapath._native/_cma are not built "
                f"({exc}); reinstall kvx with a C compiler present"
            ) from exc
        logger.warning("kvx._datapath._native is not built (%s); using the pure-Python twin", exc)
        return (_io_py, _cma_py), "python"
    return (_native, _cma), "native"


def use(choice: str) -> str:
    """Switch implementations at run time ("1", "0" or ""); returns the one in use.

    Callers reach the functions as ``_io.sendv``, so the switch takes effect
    for the next call.
    """
    global \
        IMPL, \
        sendv, \
        recvv, \
        wait_readable, \
        peek, \
        serve_read, \
        serve_write, \
        recv_answer, \
        vm_readv, \
        vm_writev, \
        memcpyv, \
        descs_bad, \
        leased_copy, \
        leased_post, \
        conn_leased_post, \
        leased_triples, \
        post_check
    (io, cma), IMPL = _select(choice)
    sendv, recvv, wait_readable, peek = io.sendv, io.recvv, io.wait_readable, io.peek
    serve_read, serve_write, recv_answer = io.serve_read, io.serve_write, io.recv_answer
    vm_readv, vm_writev, memcpyv = cma.vm_readv, cma.vm_writev, cma.memcpyv
    descs_bad, leased_copy, leased_post = cma.descs_bad, cma.leased_copy, cma.leased_post
    conn_leased_post, leased_triples = cma.conn_leased_post, cma.leased_triples
    post_check = cma.post_check
    return IMPL


# Bounded busy-polls (KVX_*_SPIN_US): at most 10 ms.
SPIN_US_MAX = 10_000


def spin_us(variable: str, default: int) -> int:
    """A bounded busy-poll's length from the environment, checked: a whole
    number of microseconds from 0 (never poll) to SPIN_US_MAX."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= SPIN_US_MAX:
        raise ConfigError(
            f"{variable} must be a whole number of microseconds from 0 to {SPIN_US_MAX}, not {raw!r}"
        )
    return value


IMPL = ""
use(os.environ.get("KVX_NATIVE", ""))
