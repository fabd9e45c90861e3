"""Checksums of scattered host memory, for transfers with ``verify=True``.

One CRC-32C (Castagnoli) per segment of a byte stream laid out in local
pieces: the stream is the concatenation of the pieces ``(addrs, lens)``, and
the segments are its consecutive runs of ``seg_lens`` bytes (one per remote
descriptor). The CRC itself comes from the ``crc32c`` package (hardware
CRC32 instructions where the CPU has them; its own C fallback otherwise),
installed with the ``verify`` extra.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvx.errors import ConfigError

EXTRA = "pip install 'kvx[verify]'"

# A read-only memoryview of raw memory, without a ctypes array per piece.
_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100


def _crc32c() -> Any:
    try:
        import crc32c
    except ImportError:
        raise ConfigError(f"verify=True needs the crc32c package: {EXTRA}") from None
    return crc32c.crc32c


def available() -> bool:
    try:
        _crc32c()
    except ConfigError:
        return False
    return True


def segments(addrs: Any, lens: Any, seg_lens: Any) -> np.ndarray:
    """CRC-32C of each segment (uint32), for pieces and segments that cover
    the same number of bytes; the memory must stay registered meanwhile."""
    crc = _crc32c()
    pieces = list(
        zip(np.asarray(addrs, np.uint64).tolist(), np.asarray(lens, np.uint64).tolist(), strict=True)
    )
    wanted = np.asarray(seg_lens, np.uint64).tolist()
    assert sum(n for _, n in pieces) == sum(wanted), "pieces and segments cover different byte counts"
    out = np.zeros(len(wanted), np.uint32)
    at = 0  # the piece being read
    used = 0  # bytes of it already hashed
    for i, left in enumerate(wanted):
        value = 0
        while left:
            address, length = pieces[at]
            take = min(left, length - used)
            value = crc(_from_memory(address + used, take, _PYBUF_READ), value)
            left -= take
            used += take
            if used == length:
                at, used = at + 1, 0
        out[i] = value
    return out
