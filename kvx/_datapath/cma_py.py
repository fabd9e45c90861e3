"""Pure-Python twin of kvx._datapath._cma (csrc/kvx_cma.c), through ctypes.

Same functions, same errors; one Python object per range. Tests run both.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import os

from kvx._datapath.io_py import IOV_MAX

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _fn.restype = ctypes.c_ssize_t


def _pairs(addrs, lens) -> list[list[int]]:
    a, b = memoryview(addrs), memoryview(lens)
    if a.itemsize != 8 or b.itemsize != 8 or a.nbytes != b.nbytes:
        raise ValueError("addresses and lengths must be uint64 buffers of equal length")
    return [
        [x, n]
        for x, n in zip(a.cast("B").cast("Q").tolist(), b.cast("B").cast("Q").tolist(), strict=True)
        if n
    ]


def _batch(ranges: list[list[int]]):
    n = min(len(ranges), IOV_MAX)
    return (_Iovec * n)(*[_Iovec(x, n_) for x, n_ in ranges[:n]]), n


def _advance(ranges: list[list[int]], moved: int) -> None:
    while moved and ranges:
        if moved < ranges[0][1]:
            ranges[0][0] += moved
            ranges[0][1] -= moved
            return
        moved -= ranges.pop(0)[1]


def _move(fn, pid: int, local_addrs, local_lens, remote_addrs, remote_lens) -> None:
    local, remote = _pairs(local_addrs, local_lens), _pairs(remote_addrs, remote_lens)
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("local and remote ranges must cover the same number of bytes")
    _move_ranges(fn, pid, local, remote)


def _move_ranges(fn, pid: int, local: list[list[int]], remote: list[list[int]]) -> None:
    while local:
        liov, ln = _batch(local)
        riov, rn = _batch(remote)
        n = fn(pid, liov, ln, riov, rn, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err == 4:  # EINTR
                continue
            raise OSError(err, os.strerror(err))
        if n == 0:
            raise OSError(14, os.strerror(14))  # EFAULT: no progress
        _advance(local, n)
        _advance(remote, n)


def vm_readv(pid: int, local_addrs, local_lens, remote_addrs, remote_lens) -> None:
    """Copy the remote ranges of process ``pid`` into the local ranges."""
    _move(_libc.process_vm_readv, pid, local_addrs, local_lens, remote_addrs, remote_lens)


def vm_writev(pid: int, local_addrs, local_lens, remote_addrs, remote_lens) -> None:
    """Copy the local ranges into the remote ranges of process ``pid``."""
    _move(_libc.process_vm_writev, pid, local_addrs, local_lens, remote_addrs, remote_lens)


def memcpyv(dsts, srcs, lens) -> None:
    """memcpy of (dst, src, len) triples in this process; see csrc/kvx_cma.c."""
    d, s, n = (memoryview(x).cast("B").cast("Q") for x in (dsts, srcs, lens))
    if not (len(d) == len(s) == len(n)):
        raise ValueError("dsts, srcs and lens must be uint64 buffers of equal length")
    for dst, src, length in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
        ctypes.memmove(dst, src, length)


def descs_bad(descs, flags, sizes, need: int) -> int:
    """The twin of the C descs_bad: the index of the first descriptor that
    names a region (into ``flags``/``sizes``) without the ``need`` bits or
    lies outside it; -1 when all are good."""
    import numpy as np

    ids = descs["region"].astype(np.int64)
    known = ids < len(flags)
    safe = np.where(known, ids, 0)
    size = sizes[safe]
    offsets, lengths = descs["offset"], descs["length"]
    bad = (
        ~known
        | ((flags[safe] & need) != need)
        | (offsets > size)
        | (lengths > size - np.minimum(offsets, size))
    )
    return int(np.argmax(bad)) if bad.any() else -1


# Access bits of a lease, as kvx.memory names them (REMOTE_READ, REMOTE_WRITE).
_LEASE_READ, _LEASE_WRITE = 2, 4
_U64_MAX = (1 << 64) - 1


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    """Join pieces where the next starts where one ends; drop empty ones."""
    out: list[list[int]] = []
    for addr, n in ranges:
        if not n:
            continue
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1][1] += n
        else:
            out.append([addr, n])
    return out


def leased_copy(pid: int, writing: bool, local_addrs, local_lens, descs, regions, lease, granted: int) -> int:
    """The twin of the C leased_copy (csrc/kvx_cma.c): check every remote
    descriptor against the lease (region leased, access granted, range inside
    the leased size, no address overflow), resolve, merge adjacent pieces,
    move. -1 once the bytes moved, else the index of the first descriptor
    refused, before any byte moved."""
    d = memoryview(descs).cast("B")
    r = memoryview(regions).cast("B")
    w = memoryview(lease).cast("B")
    la, ll = memoryview(local_addrs).cast("B"), memoryview(local_lens).cast("B")
    nregions = r.nbytes // 4
    if (
        la.nbytes % 8
        or ll.nbytes != la.nbytes
        or d.nbytes % 24
        or r.nbytes % 4
        or w.nbytes % 8
        or w.nbytes // 8 < 2 * nregions
    ):
        raise ValueError("leased_copy: malformed address, descriptor, region or lease buffers")
    ids = r.cast("I").tolist()
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError("leased_copy: region ids must be sorted and distinct")
    got = _resolve_remote(d, ids, w, granted, writing)
    if isinstance(got, int):
        return got
    remote, total = got
    local = _pairs(local_addrs, local_lens)
    if sum(n for _, n in local) != total:
        raise ValueError("local and remote ranges must cover the same number of bytes")
    _move_ranges(
        _libc.process_vm_writev if writing else _libc.process_vm_readv, pid, _merge(local), _merge(remote)
    )
    return -1


def _resolve_local(ld, b, z, f, need: int, mask: int) -> tuple[list[list[int]], int] | int:
    """The local descriptors against the region table: ([address, length]
    per descriptor, total), or the index of the first one refused."""
    base_of, size_of, flags_of = b.cast("Q"), z.cast("Q"), f
    fields = ld.cast("Q").tolist()
    local: list[list[int]] = []
    total = 0
    for i in range(ld.nbytes // 24):
        region, offset, length = fields[3 * i] & 0xFFFFFFFF, fields[3 * i + 1], fields[3 * i + 2]
        if region >= len(flags_of) or flags_of[region] & mask != need:
            return i
        base, size = base_of[region], size_of[region]
        total += length
        if offset > size or length > size - offset or base + offset + length > _U64_MAX or total > _U64_MAX:
            return i
        local.append([base + offset, length])
    return local, total


def post_check(
    local_descs,
    bases,
    sizes,
    flags,
    need: int,
    mask: int,
    descs,
    peer_sizes,
    peer_flags,
    peer_need: int,
    max_bytes: int,
) -> tuple[array.array, array.array, int] | None:
    """The twin of the C post_check (csrc/kvx_cma.c): the local descriptors
    resolved against the region table (``_resolve_local``), the remote ones
    checked against the peer's published table (``peer_flags`` carry
    ``peer_need``, each range inside ``peer_sizes``), the totals equal, above
    0 and at most ``max_bytes``: (addrs, lens, total), or None when anything
    is refused."""
    ld = memoryview(local_descs).cast("B")
    b, z, f = (memoryview(x).cast("B") for x in (bases, sizes, flags))
    d, pz, pf = (memoryview(x).cast("B") for x in (descs, peer_sizes, peer_flags))
    if (
        ld.nbytes % 24
        or b.nbytes != f.nbytes * 8
        or z.nbytes != b.nbytes
        or d.nbytes % 24
        or pz.nbytes != pf.nbytes * 8
    ):
        raise ValueError("post_check: malformed descriptor or table buffers")
    got = _resolve_local(ld, b, z, f, need, mask)
    if isinstance(got, int):
        return None
    local, total = got
    size_of = pz.cast("Q")
    fields = d.cast("Q").tolist()
    remote_total = 0
    for i in range(d.nbytes // 24):
        region, offset, length = fields[3 * i] & 0xFFFFFFFF, fields[3 * i + 1], fields[3 * i + 2]
        if region >= len(pf) or pf[region] & peer_need != peer_need:
            return None
        size = size_of[region]
        if offset > size or length > size - offset:
            return None
        remote_total += length
    if total != remote_total or total == 0 or total > max_bytes:
        return None
    return array.array("Q", [a for a, _ in local]), array.array("Q", [n for _, n in local]), total


def _resolve_remote(d, ids: list[int], w, granted: int, writing: bool) -> tuple[list[list[int]], int] | int:
    """The remote descriptors against the lease: ([address, length] per
    descriptor, total), or the index of the first one refused."""
    words = w.cast("Q").tolist()
    leased = {rid: (words[2 * k], words[2 * k + 1]) for k, rid in enumerate(ids)}
    access = _LEASE_WRITE if writing else _LEASE_READ
    fields = d.cast("Q").tolist()
    remote: list[list[int]] = []
    total = 0
    for i in range(d.nbytes // 24):
        region, offset, length = fields[3 * i] & 0xFFFFFFFF, fields[3 * i + 1], fields[3 * i + 2]
        got = leased.get(region)
        if got is None or granted & access != access:
            return i
        base, size = got
        total += length
        if offset > size or length > size - offset or base + offset + length > _U64_MAX or total > _U64_MAX:
            return i
        remote.append([base + offset, length])
    return remote, total


def _leased_resolve(
    name: str,
    writing: bool,
    local_descs,
    bases,
    sizes,
    flags,
    devices,
    device: int,
    need: int,
    mask: int,
    descs,
    regions,
    lease,
    granted: int,
    max_bytes: int,
) -> tuple[int, int, tuple[list[list[int]], list[list[int]], int] | None]:
    """What leased_post and leased_triples share (the C's leased_prepare and
    leased_resolve): the buffers checked (ValueError naming ``name``), the
    local descriptors resolved against the region table (``flags`` masked by
    ``mask`` equal ``need``, each range inside its region; each region on
    ``device`` too when ``devices`` is given), the remote ones against the
    lease, the totals compared (equal, above 0, at most ``max_bytes``).
    (-1, -1, (local, remote, total)) when all passed; else (side, index,
    None): (0, i) local descriptor i refused, (1, i) remote descriptor i,
    (2, -1) the totals."""
    ld = memoryview(local_descs).cast("B")
    b, z, f = (memoryview(x).cast("B") for x in (bases, sizes, flags))
    d, r, w = (memoryview(x).cast("B") for x in (descs, regions, lease))
    nregions = r.nbytes // 4
    if (
        ld.nbytes % 24
        or b.nbytes != f.nbytes * 8
        or z.nbytes != b.nbytes
        or d.nbytes % 24
        or r.nbytes % 4
        or w.nbytes % 8
        or w.nbytes // 8 < 2 * nregions
    ):
        raise ValueError(f"{name}: malformed descriptor, table, region or lease buffers")
    ids = r.cast("I").tolist()
    if any(y <= x for x, y in zip(ids, ids[1:], strict=False)):
        raise ValueError(f"{name}: region ids must be sorted and distinct")
    got = _resolve_local(ld, b, z, f, need, mask)
    if isinstance(got, int):
        return 0, got, None
    local, total = got
    if devices is not None:
        device_of = memoryview(devices).cast("B").cast("i")
        fields = ld.cast("Q").tolist()
        for i in range(len(local)):
            if device_of[fields[3 * i] & 0xFFFFFFFF] != device:
                return 0, i, None
    got = _resolve_remote(d, ids, w, granted, writing)
    if isinstance(got, int):
        return 1, got, None
    remote, remote_total = got
    if total != remote_total or total == 0 or total > max_bytes:
        return 2, -1, None
    return -1, -1, (local, remote, total)


def leased_post(
    pid: int,
    writing: bool,
    local_descs,
    bases,
    sizes,
    flags,
    need: int,
    mask: int,
    descs,
    regions,
    lease,
    granted: int,
    max_bytes: int,
) -> int | tuple[int, int]:
    """The twin of the C leased_post (csrc/kvx_cma.c): both lists resolved
    and checked (``_leased_resolve``), then the bytes moved. The bytes moved
    once they moved; else, with nothing moved, (side, index) as
    ``_leased_resolve`` says."""
    side, index, lists = _leased_resolve(
        "leased_post", writing, local_descs, bases, sizes, flags, None, 0, need, mask, descs, regions, lease,
        granted, max_bytes,
    )  # fmt: skip
    if lists is None:
        return side, index
    local, remote, total = lists
    _move_ranges(
        _libc.process_vm_writev if writing else _libc.process_vm_readv, pid, _merge(local), _merge(remote)
    )
    return total


def conn_leased_post(
    conn,
    pid: int,
    writing: bool,
    local_descs,
    bases,
    sizes,
    flags,
    need: int,
    mask: int,
    descs,
    granted: int,
    max_bytes: int,
) -> int | tuple[int, int] | None:
    """The twin of the C conn_leased_post (csrc/kvx_cma.c): ``leased_post``
    through what connection ``conn`` leases (``Connection.lease``, which
    counts the uses, and ``unlease``). None, with nothing done, when a region
    is not leased or the connection broke."""
    d = memoryview(descs).cast("B")
    if d.nbytes % 24:
        raise ValueError("conn_leased_post: malformed descriptor buffer")
    fields = d.cast("Q").tolist()
    rids = sorted({fields[3 * i] & 0xFFFFFFFF for i in range(len(fields) // 3)})
    pairs = conn.lease(rids, writing)
    if pairs is None:
        return None
    try:
        lease = array.array("Q", pairs[: 2 * len(rids)])
        got = leased_post(
            pid, writing, local_descs, bases, sizes, flags, need, mask, descs, array.array("I", rids), lease,
            granted, max_bytes,
        )  # fmt: skip
    except BaseException:
        with contextlib.suppress(Exception):  # the copy's error is the one raised, as in C
            conn.unlease(rids)
        raise
    conn.unlease(rids)
    return got


def leased_triples(
    writing: bool,
    local_descs,
    bases,
    sizes,
    flags,
    devices,
    device: int,
    need: int,
    mask: int,
    descs,
    regions,
    lease,
    granted: int,
    max_bytes: int,
    piece: int,
    out: int,
    out_words: int,
) -> int | tuple[int, int]:
    """The twin of the C leased_triples (csrc/kvx_cma.c): the checks of
    ``leased_post``, each local region on ``device`` too, then the copy's
    (dst, src, len) triples, each at most ``piece`` bytes, written at the
    address ``out`` (srcs, then dsts, then lens; ``out_words`` uint64 words
    there). The triples written; else, with nothing written, (side, index)
    as ``leased_post``, or (3, n) when ``out`` is too short for n triples."""
    if (
        memoryview(devices).nbytes != memoryview(flags).nbytes * 4
        or piece <= 0
        or (out == 0 and out_words != 0)
    ):
        raise ValueError("leased_triples: malformed descriptor, table, region or lease buffers")
    side, index, lists = _leased_resolve(
        "leased_triples", writing, local_descs, bases, sizes, flags, devices, device, need, mask, descs,
        regions, lease, granted, max_bytes,
    )  # fmt: skip
    if lists is None:
        return side, index
    local, remote, _ = lists
    triples: list[tuple[int, int, int]] = []
    i = j = li = rj = 0
    while i < len(local) and j < len(remote):
        if li == local[i][1]:
            i, li = i + 1, 0
            continue
        if rj == remote[j][1]:
            j, rj = j + 1, 0
            continue
        take = min(local[i][1] - li, remote[j][1] - rj, piece)
        mine, theirs = local[i][0] + li, remote[j][0] + rj
        triples.append((theirs, mine, take) if writing else (mine, theirs, take))
        li, rj = li + take, rj + take
    n = len(triples)
    if 3 * n > out_words:
        return 3, n
    if not n:
        return 0
    words = (ctypes.c_uint64 * (3 * n)).from_address(out)
    for k, (dst, src, length) in enumerate(triples):
        words[k], words[n + k], words[2 * n + k] = src, dst, length
    return n
