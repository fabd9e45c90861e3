"""Shared segments: host memory that same-host peers can map (``kvx.alloc_shared``).

Some hosts forbid cross-memory attach between the agents; memory allocated
here lives in a memfd segment mapped MAP_SHARED, whose descriptor the shm
backend can hand to an authenticated peer (kvx/backends/shm/segments.py).
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import mmap
import os
import threading
import weakref

import numpy as np

from kvx.errors import ConfigError


@dataclasses.dataclass
class _Segment:
    fd: int
    size: int
    address: int


_segments: dict[int, _Segment] = {}  # address -> segment
_lock = threading.Lock()
# Segments whose array died. The finalizer only appends here (atomic): it can
# run inside any allocation, also one made while _lock is held, so it must
# not take the lock; the next user of _segments drops them first.
_dead: collections.deque[int] = collections.deque()


def _drop_dead() -> None:
    """With _lock held."""
    while _dead:
        _segments.pop(_dead.popleft(), None)


def alloc_shared(nbytes: int) -> np.ndarray:
    """Host memory that same-host peers can map even where cross-memory
    attach is not permitted: a zeroed uint8 numpy array of ``nbytes`` in a
    memfd segment. Register it as any array; it is freed with the array."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"alloc_shared takes a positive size in bytes, not {nbytes!r}")
    fd = os.memfd_create("kvx-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        # Its descriptor may go to peers: none of them may resize it (a shrink
        # would turn every mapping's next access into SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    with _lock:
        _drop_dead()
        _segments[address] = _Segment(fd, nbytes, address)
    weakref.finalize(array, _forget, address, fd)
    return array


def _forget(address: int, fd: int) -> None:
    _dead.append(address)
    os.close(fd)


def find(address: int, size: int) -> tuple[int, int] | None:
    """(fd, offset) when [address, address + size) lies in one kvx segment."""
    with _lock:
        _drop_dead()
        for seg in _segments.values():
            if seg.address <= address and address + size <= seg.address + seg.size:
                return seg.fd, address - seg.address
    return None
