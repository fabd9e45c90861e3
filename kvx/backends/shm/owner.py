"""The inode of the far end of a control connection, as the kernel lists it.

Before a same-host initiator attaches to the process a peer's metadata names
(cross-memory attach, or CUDA IPC inside one process), it must know that
process is the one serving its authenticated connection: the pin answers
that steer its copies come over that connection, and they are trusted only
because they describe the sender's own memory. A peer holding the cluster
secret controls its metadata and every byte it sends, so nothing it says
can prove this; an earlier challenge (the peer wrote a nonce into the named
process's memory) was passed by a peer that could get bytes into a third
process some other way, and so is any check of which process holds a
descriptor of the connection (a descriptor can be passed to another
process, say in a shared-segment answer).

What the kernel says here is the name of the connection: the far end's
socket inode, listed in ``/proc/PID/net/tcp{,6}`` of the named process's
network namespace by the connection's two addresses. The shm backend then
asks the process listening on the peer's local socket (whose pid the kernel
gives, SO_PEERCRED) whether it serves that inode (``prove`` in
kvx/backends/shm/__init__.py).
"""

from __future__ import annotations

import os
import socket
import sys

_ESTABLISHED = "01"


def _hex_address(family: int, host: str, port: int) -> str:
    """An address as ``/proc/net/tcp{,6}`` prints it: the raw network-order
    bytes read as host-order 32-bit words, then the port."""
    raw = socket.inet_pton(family, host)
    words = "".join(f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def _keys(sock: socket.socket) -> list[tuple[str, str, str]]:
    """(table, the far end's local address, its remote address) under which
    the far end of ``sock`` may be listed: an IPv4 connection may end at a
    dual-stack IPv6 listener, where it shows as ``::ffff:a.b.c.d``."""
    family = sock.family
    mine = sock.getsockname()[:2]
    theirs = sock.getpeername()[:2]
    keys = [
        (
            "tcp6" if family == socket.AF_INET6 else "tcp",
            _hex_address(family, theirs[0], theirs[1]),
            _hex_address(family, mine[0], mine[1]),
        )
    ]
    if family == socket.AF_INET:
        keys.append(
            (
                "tcp6",
                _hex_address(socket.AF_INET6, "::ffff:" + theirs[0], theirs[1]),
                _hex_address(socket.AF_INET6, "::ffff:" + mine[0], mine[1]),
            )
        )
    return keys


def _far_inode(sock: socket.socket, pid: int) -> int | None:
    """The inode of the far end of ``sock`` in ``pid``'s network namespace."""
    for table, local, remote in _keys(sock):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)  # the column names
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                        if fields[3] != _ESTABLISHED:
                            return None
                        return int(fields[9])
        except FileNotFoundError:
            continue  # no IPv6 in that namespace
    return None


def far_inode(sock: socket.socket, pid: int) -> tuple[int | None, str]:
    """(the inode of the far end of the connected TCP socket ``sock`` in
    ``pid``'s network namespace, ""), or (None, why not)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None, f"the connection is not TCP (family {sock.family})"
    if not os.path.isdir(f"/proc/{pid}/net"):
        return None, f"no process {pid} in this pid namespace"
    try:
        inode = _far_inode(sock, pid)
    except OSError as exc:
        return None, f"cannot read the connections of pid {pid}: {exc}"
    if inode is None:
        return None, (
            f"pid {pid}'s network namespace has no end of this connection: it runs in another network "
            "namespace reached through address translation, or it is not the peer"
        )
    return inode, ""
