"""The shm backend's own cases: when it is chosen and why, what the target
checks before an initiator may copy, and how pins hold deregister.

The transfer, fault and chaos suites (test_transfer.py, test_faults.py,
test_chaos.py) run over shm as well as tcp.
"""

import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import kvx
from kvx import Descs
from kvx._datapath import io as _io
from kvx._spawn import CANNOT_DROP, launched
from kvx.agent import parse_metadata
from kvx.backends import shm as shm_backend
from kvx.backends.control import wire as _wire
from kvx.backends.control.wire import MsgType
from tests.conftest import SECRET
from tests.integration.test_faults import _expect_error_then_close, _read_message, _recv, _session, _tampered

BLOCK = 4096


def test_same_host_peers_get_shm_and_say_why(make_worker, make_agent, caplog):
    worker = make_worker(auth_secret=SECRET)
    agent = make_agent(auth_secret=SECRET)
    pool = np.zeros(1 << 20, np.uint8)
    region = agent.register(pool)
    with caplog.at_level(logging.INFO, logger="kvx.agent"):
        peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm"
    assert f"pid {worker.pid} permitted" in peer.backend_reason
    assert any("over shm" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    ids = np.array([9, 2, 200, 31])
    peer.read(
        Descs.from_blocks(region, np.arange(4), BLOCK), Descs.from_blocks(peer.regions[0], ids, BLOCK)
    ).wait(10)
    expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)
    assert np.array_equal(pool[: 4 * BLOCK].reshape(-1, BLOCK), expected[ids])
    assert not pool[4 * BLOCK :].any()


def test_a_target_that_does_not_offer_shm_gets_tcp(make_worker, make_agent):
    worker = make_worker(backend="tcp")
    assert parse_metadata(worker.metadata).shm_probe_address == 0
    peer = make_agent("auto").add_peer(worker.metadata)
    assert peer.backend == "tcp" and "does not offer shm" in peer.backend_reason
    with pytest.raises(kvx.ConnectError, match="backend=shm was configured.*does not offer shm"):
        make_agent("forced", backend="shm").add_peer(worker.metadata)
    peer = make_agent("auto-2").add_peer(worker.metadata, backend="tcp")
    assert peer.backend_reason == "backend=tcp was configured"


def test_peers_on_another_host_get_tcp(make_worker, make_agent):
    worker = make_worker()
    elsewhere = _tampered(worker.metadata, lambda md: setattr(md, "boot_id", "another-kernel"))
    peer = make_agent("a").add_peer(elsewhere)
    assert peer.backend == "tcp" and "another host" in peer.backend_reason
    with pytest.raises(kvx.ConnectError, match="another host"):
        make_agent("b", backend="shm").add_peer(elsewhere)


def test_a_pid_from_another_namespace_is_detected(make_worker, make_agent):
    worker = make_worker()
    gone = multiprocessing.get_context("spawn").Process(target=int)
    gone.start()
    gone.join()
    # The metadata's pid names no process here (as for a peer in another pid namespace).
    stranger = _tampered(worker.metadata, lambda md: setattr(md, "pid", gone.pid))
    peer = make_agent("a").add_peer(stranger)
    assert peer.backend == "tcp" and "pid namespace" in peer.backend_reason
    # A pid that names another process here: the probe does not find the epoch.
    impostor = _tampered(worker.metadata, lambda md: setattr(md, "pid", os.getpid()))
    peer = make_agent("b").add_peer(impostor)
    assert peer.backend == "tcp" and f"pid {os.getpid()}" in peer.backend_reason
    with pytest.raises(kvx.ConnectError, match="pid"):
        make_agent("c", backend="shm").add_peer(impostor)


def test_stale_metadata_fails_the_handshake_not_the_probe(make_worker, make_agent):
    worker = make_worker()
    stale = _tampered(worker.metadata, lambda md: setattr(md, "epoch", md.epoch ^ 1))
    with pytest.raises(kvx.EpochError):
        make_agent(backend="shm").add_peer(stale)


_UNPRIVILEGED = """
import json, sys, kvx
agent = kvx.Agent("unprivileged")
peer = agent.add_peer(bytes.fromhex(sys.argv[1]))
out = {"backend": peer.backend, "reason": peer.backend_reason}
try:
    kvx.Agent("unprivileged-forced", backend="shm").add_peer(bytes.fromhex(sys.argv[1]))
except kvx.ConnectError as exc:
    out["forced"] = str(exc)
print(json.dumps(out))
"""


CAP_SYS_PTRACE = 19
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="drops a capability root has (CI runs as root); as "
    "another user the test would need a second account",
)


def _run_without_ptrace(script: str, metadata: bytes) -> dict:
    """Run ``script`` (given the peer's metadata) without CAP_SYS_PTRACE; its JSON output."""
    proc = subprocess.run(
        # root, after exec, may no longer attach to processes that keep CAP_SYS_PTRACE
        launched([sys.executable, "-c", script, metadata.hex()], drop_capabilities=[CAP_SYS_PTRACE]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == CANNOT_DROP:
        pytest.skip("this container may not drop capabilities (no CAP_SETPCAP)")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@needs_root
def test_attach_not_permitted_is_explained(make_worker):
    worker = make_worker()
    out = _run_without_ptrace(_UNPRIVILEGED, worker.metadata)
    assert out["backend"] == "tcp"
    assert "not permitted (EPERM)" in out["reason"] and "CAP_SYS_PTRACE" in out["reason"]
    assert "not permitted (EPERM)" in out["forced"], out


# What the target checks: SHM_PIN and SHM_UNPIN on a raw connection.


def _pin(sock, request_id, *regions, aux=_wire.PIN_READ):
    ids = np.array(regions, "<u4").tobytes()
    sock.sendall(_wire.pack(MsgType.SHM_PIN, request_id, payload_len=len(ids), aux=aux) + ids)
    return _read_message(sock)


def test_pins_are_checked_and_hold_deregister(make_worker):
    worker = make_worker()
    rid = worker.call("register", 1 << 16, True)
    md = parse_metadata(worker.call("metadata"))
    base = next(r.address for r in md.regions if r.id == rid)
    sock, _ = _session(worker)
    (msg_type, _), body = _pin(sock, 1, rid, worker.region_id, aux=_wire.PIN_WRITE)
    assert msg_type == MsgType.SHM_PIN_OK
    pool = next(r for r in md.regions if r.id == worker.region_id)
    assert np.frombuffer(body, np.uint64).tolist() == [base, 1 << 16, pool.address, pool.size_bytes]
    # An unknown region, and one pinned for an access it does not allow: refused, the connection lives on.
    (msg_type, aux), text = _pin(sock, 2, rid, 999)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"unknown region 999" in text
    private = worker.call("register", 4096, False)
    (msg_type, aux), text = _pin(sock, 3, private)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"without remote access" in text
    # Deregister waits while the pin is held...
    done = threading.Event()
    threading.Thread(target=lambda: (worker.call("deregister", rid), done.set()), daemon=True).start()
    assert not done.wait(0.5), "deregister went through a held pin"
    # ...and goes through once it is released.
    sock.sendall(_wire.pack(MsgType.SHM_UNPIN, 1))
    assert done.wait(10)
    (msg_type, aux), _ = _pin(sock, 4, rid)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS)
    sock.close()


def test_a_pin_held_back_holds_back_only_the_regions_it_names(make_worker):
    """A pin for one transfer (SHM_PIN without PIN_KEEP) that its peer never
    releases: the deregistration of its regions waits (above), that of any
    other region, one without remote access included, does not. Before, any
    such pin, an empty one too, held back every deregistration on the agent."""
    worker = make_worker()
    pinned, other = (worker.call("register", 1 << 16, True) for _ in range(2))
    private = worker.call("register", 4096, False)
    sock, _ = _session(worker)
    for request_id, regions in ((1, (pinned,)), (2, ())):
        (msg_type, _), _ = _pin(sock, request_id, *regions)
        assert msg_type == MsgType.SHM_PIN_OK
    for rid in (other, private):
        started = time.monotonic()
        worker.call("deregister", rid)
        assert time.monotonic() - started < 5
    done = threading.Event()
    threading.Thread(target=lambda: (worker.call("deregister", pinned), done.set()), daemon=True).start()
    assert not done.wait(0.5), "deregister went through a held pin"
    sock.close()  # the pin goes with the connection
    assert done.wait(10)


def test_a_connection_that_ends_releases_its_pins(make_worker):
    worker = make_worker()
    rid = worker.call("register", 1 << 16, True)
    sock, _ = _session(worker)
    (msg_type, _), _ = _pin(sock, 1, rid)
    assert msg_type == MsgType.SHM_PIN_OK
    sock.close()
    started = time.monotonic()
    worker.call("deregister", rid)
    assert time.monotonic() - started < 5


def test_malformed_pin_messages_close_the_connection(make_worker, make_agent):
    worker = make_worker()
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.SHM_UNPIN, 7))  # holds no pin
    assert "holds no pin" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    ids = np.array([worker.region_id], "<u4").tobytes()
    sock.sendall(
        _wire.pack(MsgType.SHM_PIN, 1, payload_len=len(ids), aux=65) + ids
    )  # unknown bit (16 is PIN_RDMA)
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    ipc_rdma = _wire.PIN_READ | _wire.PIN_IPC | _wire.PIN_RDMA  # IPC handles or rdma keys, not both
    sock.sendall(_wire.pack(MsgType.SHM_PIN, 1, payload_len=len(ids), aux=ipc_rdma) + ids)
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    # An IPC lease of host memory is refused, and the connection lives on.
    (msg_type, aux), text = _pin(
        sock, 1, worker.region_id, aux=_wire.PIN_READ | _wire.PIN_KEEP | _wire.PIN_IPC
    )
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"through CUDA IPC" in text
    assert _pin(sock, 2, worker.region_id)[0][0] == MsgType.SHM_PIN_OK
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.SHM_RELEASE, worker.region_id, payload_len=4) + b"\0" * 4)
    assert "SHM_RELEASE carries nothing" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    sock.sendall(
        _wire.pack(MsgType.SHM_PIN, 1, payload_len=6, aux=_wire.PIN_READ) + b"\0" * 6
    )  # not whole ids
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    assert _pin(sock, 5, worker.region_id)[0][0] == MsgType.SHM_PIN_OK
    sock.sendall(_wire.pack(MsgType.SHM_PIN, 5, payload_len=len(ids), aux=_wire.PIN_READ) + ids)
    assert "reuses" in _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    # The agent serves on.
    peer = make_agent().add_peer(worker.metadata)
    pool = np.zeros(BLOCK, np.uint8)
    region = peer.agent.register(pool)
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(BLOCK, BLOCK)).wait(10)
    assert peer.backend == "shm" and pool.tobytes() == worker.expected(BLOCK, BLOCK).tobytes()


def test_pins_are_refused_when_shm_is_not_offered(make_worker):
    worker = make_worker(backend="tcp")
    sock, _ = _session(worker)
    (msg_type, aux), text = _pin(sock, 1, worker.region_id)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"does not offer shm" in text
    sock.close()


def test_many_small_blocks_over_several_streams(make_worker, make_agent):
    size = 8 << 20
    worker = make_worker(pool_bytes=size)
    agent = make_agent(streams=4)
    pool = np.zeros(size, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm"
    rng = np.random.default_rng(5)
    blocks = size // BLOCK
    remote_ids = rng.permutation(blocks)[: blocks // 2]
    local_ids = rng.permutation(blocks)[: blocks // 2]
    peer.read(
        Descs.from_blocks(region, local_ids, BLOCK),
        Descs.from_blocks(peer.regions[0], remote_ids, BLOCK),
        notify=b"read-done",
    ).wait(20)
    expected = worker.expected(0, size).reshape(-1, BLOCK)
    assert np.array_equal(pool.reshape(-1, BLOCK)[local_ids], expected[remote_ids])
    assert worker.call("notifications", 5.0) == [("initiator", b"read-done")]
    # And back: a scattered write lands where asked, nowhere else.
    pool[:] = 0xAB
    peer.write(
        Descs.from_blocks(region, [0, 1], BLOCK), Descs.from_blocks(peer.regions[0], [7, 3], BLOCK)
    ).wait(10)
    assert worker.call("peek", 3 * BLOCK, BLOCK) == b"\xab" * BLOCK
    assert worker.call("peek", 4 * BLOCK, 3 * BLOCK) == worker.expected(4 * BLOCK, 3 * BLOCK).tobytes()


# Shared segments: where cross-memory attach is refused.

_SEGMENTS = """
import json, sys, numpy as np, kvx
md = bytes.fromhex(sys.argv[1])
agent = kvx.Agent("no-ptrace")
pool = np.zeros(1 << 20, np.uint8)
region = agent.register(pool)
peer = agent.add_peer(md)
out = {"backend": peer.backend, "reason": peer.backend_reason}
ids = np.array([7, 0, 200, 31, 100])
peer.read(kvx.Descs.from_blocks(region, np.arange(5), 4096), kvx.Descs.from_blocks(peer.regions[0], ids, 4096)).wait(10)
out["read"] = pool[:5 * 4096].tobytes().hex()
pool[:4096] = 0xAB
peer.write(region.descs(0, 4096), peer.regions[0].descs(4096 * 255, 4096), notify=b"seg").wait(10)
forced = kvx.Agent("no-ptrace-forced", backend="shm").add_peer(md)
out["forced"] = forced.backend_reason
out["tcp"] = kvx.Agent("no-ptrace-tcp").add_peer(md, backend="tcp").backend
print(json.dumps(out))
"""


@needs_root
def test_without_attach_shared_segments_carry_the_bytes(make_worker):
    worker = make_worker(shared=True, auth_secret=None)
    md = parse_metadata(worker.metadata)
    assert md.segment_socket and md.regions[0].shared_segment
    out = _run_without_ptrace(_SEGMENTS, worker.metadata)
    assert out["backend"] == "shm"
    assert "not permitted (EPERM)" in out["reason"] and "shared segments" in out["reason"]
    assert "shared segments" in out["forced"] and out["tcp"] == "tcp"
    expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)
    assert bytes.fromhex(out["read"]) == expected[[7, 0, 200, 31, 100]].tobytes()
    assert worker.call("peek", 4096 * 255, 4096) == bytes([0xAB]) * 4096
    assert worker.call("notifications", 5.0) == [("no-ptrace", b"seg")]


def test_segment_descriptors_go_only_to_token_holders(make_agent):
    from kvx.backends.shm import segments

    target = make_agent("seg-target")
    shared = kvx.alloc_shared(1 << 16)
    shared[:] = 3
    region = target.register(shared)
    private = target.register(kvx.alloc_shared(4096), remote_access=False)
    plain = target.register(np.zeros(4096, np.uint8))
    server = target._backends["shm"]._segment_server
    name = target.metadata_message().segment_socket
    assert name == server.name
    with pytest.raises(kvx.AccessError, match="refused"):
        segments.fetch(name, b"x" * segments.TOKEN_BYTES, [region.id], "seg-target")
    token = server.issue("someone")
    maps = segments.fetch(name, token, [region.id, private.id, plain.id, 999], "seg-target")
    assert sorted(maps) == [region.id]  # not the private one, not plain memory, not an unknown id
    mapped = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 16)).from_address(maps[region.id].base))
    assert (mapped == 3).all()
    shared[:10] = 9  # one memory: a write on one side shows on the other
    assert (mapped[:10] == 9).all()
    with pytest.raises(kvx.AccessError, match="refused"):  # a token is good once
        segments.fetch(name, token, [region.id], "seg-target")
    segments.close_all(maps)


def test_shared_memory_is_plain_host_memory_when_attach_works(make_worker, make_agent):
    worker = make_worker(shared=True)
    agent = make_agent()
    pool = kvx.alloc_shared(1 << 20)
    region = agent.register(pool)
    assert region.segment_fd >= 0
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm" and "cross-memory attach" in peer.backend_reason
    assert "shared segments" not in peer.backend_reason
    peer.read(region.descs(0, 1 << 20), peer.regions[0].descs(0, 1 << 20)).wait(10)
    assert np.array_equal(pool, worker.expected(0, 1 << 20))


def _ask_with_unknown_token(name):
    """An honest-looking request (with a token the target never issued): the
    server answers it with a refusal; how long that took."""
    import struct

    from kvx.backends.shm import segments

    start = time.monotonic()
    other = segments._connect(name, "seg-target", start + 30)
    try:
        other.sendall(segments.KIND_SEGMENTS + b"y" * segments.TOKEN_BYTES + struct.pack("<I", 0))
        assert other.recv(4) == struct.pack("<I", 1)  # refused: an unknown token, but answered
    finally:
        other.close()
    return time.monotonic() - start


def test_a_slow_segment_client_cannot_hold_the_server(make_agent):
    """The attack: a local process trickles a request into the segment socket,
    one byte at a time, to keep everyone else waiting. Clients are served side
    by side: the honest one is answered while the slow one still trickles."""
    import socket

    from kvx.backends.shm import segments

    target = make_agent("seg-slow")
    target.register(kvx.alloc_shared(1 << 16))
    name = target._backends["shm"]._segment_server.name
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect("\0" + name)
    stop = threading.Event()

    def trickle():  # 30 bytes in 15 s: never the 36 of a request's head
        for _ in range(30):
            if stop.wait(0.5):
                return
            try:
                slow.send(b"x")
            except OSError:
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    time.sleep(1)  # the slow client is in the middle of its request
    try:
        took = _ask_with_unknown_token(name)
    finally:
        stop.set()
        thread.join(5)
        slow.close()
    # One client at a time made the honest one wait out the slow one's deadline.
    assert took < segments._IO_TIMEOUT_S, f"the slow client held the server for {took:.1f}s"


def test_a_flood_of_idle_segment_clients_cannot_lock_peers_out(make_agent):
    """The attack: a local process opens more connections to the segment
    socket than the server serves at once and sends nothing. The oldest go;
    an honest client is answered, and later honest clients too."""
    import socket

    from kvx.backends.shm import segments

    target = make_agent("seg-flood")
    target.register(kvx.alloc_shared(1 << 16))
    name = target._backends["shm"]._segment_server.name
    idle = []
    try:
        for _ in range(3 * segments.MAX_CLIENTS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect("\0" + name)
            idle.append(sock)
        assert _ask_with_unknown_token(name) < segments._IO_TIMEOUT_S
        assert _ask_with_unknown_token(name) < segments._IO_TIMEOUT_S
    finally:
        for sock in idle:
            sock.close()


_FLOODER = """
import socket, sys, time
name, payload, until = sys.argv[1], bytes.fromhex(sys.argv[2]), time.monotonic() + float(sys.argv[3])
held = []
while time.monotonic() < until:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\\0" + name)
        s.send(payload)
    except OSError:
        s.close()
        continue
    held.append(s)
    if len(held) > 500:
        held.pop(0).close()
"""


@pytest.mark.parametrize("payload", [b"", b"S"], ids=["silent", "one-byte"])
def test_a_process_that_keeps_connecting_cannot_crowd_out_peers(make_agent, payload):
    """The attack: one local process connects to the segment socket in a
    loop, saying nothing or one byte, so that every honest request is pushed
    out by newer connections before it is read. Requests that came in are
    served before newcomers are let in, a few at a time: every honest one is
    answered while the flood goes on."""
    from kvx.backends.shm import segments

    target = make_agent("seg-crowd")
    target.register(kvx.alloc_shared(1 << 16))
    name = target.metadata_message().segment_socket
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, name, payload.hex(), "30"])
    try:
        time.sleep(1)  # the flood is on
        for _ in range(10):
            assert _ask_with_unknown_token(name) < segments._IO_TIMEOUT_S
            assert flooder.poll() is None  # still flooding
    finally:
        flooder.kill()
        flooder.wait(10)


_SEGMENT_PEER = """
import ctypes, errno, fcntl, json, mmap, os, socket, struct, sys
import numpy as np
from kvx.backends.shm import segments
name, token, rw, ro = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + name)
sock.sendall(b"S" + token + struct.pack("<I", 2) + np.array([rw, ro], "<u4").tobytes())
data, fds, _, _ = socket.recv_fds(sock, 4 + 2 * 20, 2)
out = {"entries": [list(struct.unpack_from("<IQQ", data, 4 + 20 * i)) for i in range(2)]}
rw_fd, ro_fd = fds

def attempt(fn):
    try:
        fn()
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]

out["ro_map_write"] = attempt(lambda: mmap.mmap(ro_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
out["ro_write"] = attempt(lambda: os.pwrite(ro_fd, b"evil", 0))
reopened = os.open(f"/proc/self/fd/{ro_fd}", os.O_RDWR)  # the known way around a read-only descriptor
out["ro_reopen_map_write"] = attempt(lambda: mmap.mmap(reopened, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
out["ro_reopen_write"] = attempt(lambda: os.pwrite(reopened, b"evil", 0))
out["ro_truncate"] = attempt(lambda: os.ftruncate(reopened, 0))
out["rw_truncate"] = attempt(lambda: os.ftruncate(rw_fd, 0))
out["rw_grow"] = attempt(lambda: os.ftruncate(rw_fd, 1 << 30))
print(json.dumps(out))
"""


def test_segment_descriptors_give_no_more_than_was_registered(make_agent):
    """The attack: a peer that obtained segment descriptors the normal way
    (a token) tries to read beyond its region, write a region registered
    read-only, and truncate a segment, which would kill the target and every
    other peer that mapped it with SIGBUS on their next access."""
    from kvx.backends.shm import segments

    target = make_agent("seg-narrow")
    writable = kvx.alloc_shared(1 << 16)
    writable[:] = 1
    read_only = kvx.alloc_shared(1 << 16)
    read_only[:] = 2
    read_only.flags.writeable = False
    part = kvx.alloc_shared(1 << 16)
    part[:] = 3
    rw = target.register(writable)
    ro = target.register(read_only)
    assert not ro.remote_write
    sliced = target.register(part[: 1 << 12])  # part of a segment: the rest was never registered
    md = target.metadata_message()
    assert [r.shared_segment for r in md.regions] == [True, True, False]
    server = target._backends["shm"]._segment_server
    maps = segments.fetch(md.segment_socket, server.issue("honest"), [rw.id, ro.id, sliced.id], "seg-narrow")
    assert sorted(maps) == [rw.id, ro.id] and maps[rw.id].writable and not maps[ro.id].writable
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _SEGMENT_PEER,
            md.segment_socket,
            server.issue("evil").hex(),
            str(rw.id),
            str(ro.id),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["entries"] == [[segments.OK_READ_WRITE, 0, 1 << 16], [segments.OK_READ_ONLY, 0, 1 << 16]]
    assert out["ro_map_write"] == "EACCES" and out["ro_write"] == "EBADF"
    assert out["ro_reopen_map_write"] == "EPERM" and out["ro_reopen_write"] == "EPERM"
    assert out["ro_truncate"] == "EPERM" and out["rw_truncate"] == "EPERM" and out["rw_grow"] == "EPERM"
    # Nothing changed, and the target and the honest peer's mappings still read fine.
    assert (read_only == 2).all() and (writable == 1).all()
    honest = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 16)).from_address(maps[rw.id].base))
    assert (honest == 1).all()
    segments.close_all(maps)
    # Registered writable again, a segment once handed out read-only stays so: tcp carries its writes.
    target.deregister(ro)
    read_only.flags.writeable = True
    again = target.register(read_only)
    assert again.remote_write
    assert segments.fetch(md.segment_socket, server.issue("honest"), [again.id], "seg-narrow") == {}


def test_an_initiator_maps_only_sealed_segments_as_large_as_named(tmp_path):
    """The attack, the other way round: a hostile target hands out a
    descriptor it can truncate later, or one smaller than it claims; mapping
    either would let it crash the initiator with SIGBUS."""
    from kvx.backends.shm import segments

    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, 1 << 16)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    sealed = kvx.alloc_shared(1 << 16)
    fd, _ = kvx._datapath.shared.find(sealed.ctypes.data, 1 << 16)
    try:
        with pytest.raises(kvx.ProtocolError, match="not sealed against shrinking"):
            segments.check_segment(unsealed, 0, 1 << 16, "hostile")
        with pytest.raises(kvx.ProtocolError, match="names 131072 bytes"):
            segments.check_segment(fd, 0, 1 << 17, "hostile")
        with pytest.raises(kvx.ProtocolError, match="not a sealed segment"):
            segments.check_segment(directory, 0, 1, "hostile")
        segments.check_segment(fd, 0, 1 << 16, "honest")
    finally:
        os.close(unsealed)
        os.close(directory)


def test_a_forged_pid_cannot_make_the_initiator_attach_to_another_process(make_worker, make_agent):
    """The attack: an authenticated peer names another process in its metadata
    (here the initiator's own), with a probe address where that process
    happens to hold the peer's epoch. The old probe passed it, and the peer's
    pin answers would then steer the initiator's copies into that process.
    The kernel says the named process does not hold the connection."""
    worker = make_worker()
    epoch = parse_metadata(worker.metadata).epoch
    decoy = np.array([epoch], dtype="<u8")  # 8 bytes here equal to the peer's epoch

    def forge(md):
        md.pid = os.getpid()
        md.shm_probe_address = decoy.ctypes.data

    forged = _tampered(worker.metadata, forge)
    with pytest.raises(kvx.ConnectError, match="not the peer that answered the handshake"):
        make_agent("forced", backend="shm").add_peer(forged)
    peer = make_agent("auto").add_peer(forged)
    assert peer.backend == "tcp" and "not the peer that answered the handshake" in peer.backend_reason
    pool = np.zeros(1 << 16, np.uint8)
    region = peer.agent.register(pool)
    peer.read(Descs.from_blocks(region, [0], BLOCK), Descs.from_blocks(peer.regions[0], [5], BLOCK)).wait(10)
    assert np.array_equal(pool[:BLOCK], worker.expected(5 * BLOCK, BLOCK))  # from the real peer, over tcp


_VICTIM = """
import sys, numpy as np
decoy = np.array([int(sys.argv[1])], "<u8")  # the peer's epoch, where the forged metadata points
private = np.full(4096, 0x5A, np.uint8)
print(decoy.ctypes.data, private.ctypes.data, flush=True)
sys.stdin.read()
"""


def test_a_peer_cannot_steer_the_initiator_into_a_third_process(make_worker, make_agent):
    """The attack: an authenticated peer names a third process in its metadata,
    one that holds what the old checks looked for (the peer's epoch at the
    probe address; the nonce, which a peer can put there with a WRITE into a
    third agent). An initiator that may attach to that process (root here)
    would then copy into it wherever the peer's pin answers point. The kernel
    says the third process does not hold the connection: no attach, tcp."""
    worker = make_worker()
    epoch = parse_metadata(worker.metadata).epoch
    victim = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, str(epoch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        decoy, private = map(int, victim.stdout.readline().split())

        def forge(md):
            md.pid = victim.pid
            md.shm_probe_address = decoy

        forged = _tampered(worker.metadata, forge)
        assert shm_backend.cma_problem(parse_metadata(forged)) is None  # the permission probe passes
        with pytest.raises(kvx.ConnectError, match=f"belongs to pid {worker.pid}, not {victim.pid}"):
            make_agent("forced", backend="shm").add_peer(forged)
        peer = make_agent("auto").add_peer(forged)
        assert peer.backend == "tcp" and "not the peer that answered the handshake" in peer.backend_reason
        pool = np.full(1 << 16, 0xEE, np.uint8)
        region = peer.agent.register(pool)
        peer.write(region.descs(0, BLOCK), peer.regions[0].descs(3 * BLOCK, BLOCK)).wait(10)
        assert worker.call("peek", 3 * BLOCK, BLOCK) == bytes([0xEE]) * BLOCK  # the real peer, over tcp
        seen = np.zeros(4096, np.uint8)
        _io.vm_readv(
            victim.pid,
            np.array([seen.ctypes.data], np.uint64),
            np.array([4096], np.uint64),
            np.array([private], np.uint64),
            np.array([4096], np.uint64),
        )
        assert (seen == 0x5A).all()  # the third process's memory is untouched
    finally:
        victim.kill()
        victim.wait(10)


def _pidfd_getfd(pid, fd):
    """A copy of process ``pid``'s descriptor ``fd`` in this process (root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        if got < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return got
    finally:
        os.close(pidfd)


@needs_root
def test_holding_a_copy_of_the_connection_does_not_make_a_process_the_peer(
    make_worker, make_agent, monkeypatch
):
    """The attack: a hostile target passes its end of the initiator's
    connection to a third kvx agent (a shared-segment answer carries
    descriptors, and kvx holds them while it reads the rest), names that
    agent's process, probe address and local socket in its metadata, and
    hopes the initiator takes "holds the connection" for "serves it". Here
    the third agent lives in this process, which really holds a copy of the
    target's end while the initiator checks. The third agent says it serves
    no such connection: no attach."""
    from kvx.backends.shm import owner

    worker = make_worker()
    epoch = parse_metadata(worker.metadata).epoch
    decoy = np.array([epoch], dtype="<u8")
    third = make_agent("third")  # an honest agent in the named process
    held = []
    real_far_inode = owner.far_inode

    def hostile_hands_over_its_end(sock, pid):
        inode, _ = real_far_inode(sock, worker.pid)
        for fd in os.listdir(f"/proc/{worker.pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{worker.pid}/fd/{fd}") == f"socket:[{inode}]":
                    held.append(_pidfd_getfd(worker.pid, int(fd)))
        assert f"socket:[{inode}]" in {os.readlink(f"/proc/self/fd/{fd}") for fd in held}
        return real_far_inode(sock, pid)

    monkeypatch.setattr(owner, "far_inode", hostile_hands_over_its_end)

    def forge(md):
        md.pid = os.getpid()
        md.shm_probe_address = decoy.ctypes.data
        md.segment_socket = third.metadata_message().segment_socket

    try:
        peer = make_agent("initiator").add_peer(_tampered(worker.metadata, forge))
        assert peer.backend == "tcp"
        assert "does not serve this connection" in peer.backend_reason
        assert held  # this process did hold the target's end while it was checked
    finally:
        for fd in held:
            os.close(fd)


def test_the_kernel_names_the_far_end_of_a_connection():
    """owner.far_inode: the inode of the socket the other process holds, in
    its network namespace, IPv4 and IPv6; a pid that names no process is said so."""
    import socket

    from kvx.backends.shm import owner

    families = [(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
            families.append((socket.AF_INET6, "::1"))
        except OSError:
            pass
    for family, host in families:
        listener = socket.socket(family)
        listener.bind((host, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
                "print(os.fstat(s.fileno()).st_ino, flush=True); sys.stdin.read()",
                host,
                str(port),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            accepted, _ = listener.accept()
            theirs = int(child.stdout.readline())
            assert owner.far_inode(accepted, child.pid) == (theirs, "")
            assert owner.far_inode(accepted, os.getpid()) == (theirs, "")  # one network namespace
            accepted.close()
        finally:
            child.kill()
            child.wait(10)
            listener.close()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        inode, why = owner.far_inode(client, gone.pid)
        assert inode is None and "no process" in why
    finally:
        client.close()
        server.close()


# Leases: pins that outlive a transfer (SHM_PIN with PIN_KEEP), so that a
# same-host copy needs no round trip. They must hold deregister back exactly
# like a transfer in flight, and go when the peer gives them back or dies.


def _revoked(sock):
    """The next message must be an SHM_REVOKE: the region id it names."""
    _, _, msg_type, request_id, payload_len, aux, data_len = _wire.unpack(_recv(sock, 32))
    assert (msg_type, payload_len, aux, data_len) == (MsgType.SHM_REVOKE, 0, 0, 0)
    return request_id


def _lease(sock, request_id, *regions):
    return _pin(sock, request_id, *regions, aux=_wire.PIN_READ | _wire.PIN_KEEP)


def test_a_lease_holds_deregister_until_the_peer_releases_it(make_worker):
    worker = make_worker()
    rid = worker.call("register", 1 << 16, True)
    other = worker.call("register", 1 << 16, True)
    md = parse_metadata(worker.call("metadata"))
    sock, _ = _session(worker)
    (msg_type, _), body = _lease(sock, 1, rid, other)
    assert msg_type == MsgType.SHM_PIN_OK
    bases = {r.id: r.address for r in md.regions}
    assert np.frombuffer(body, np.uint64).tolist() == [bases[rid], 1 << 16, bases[other], 1 << 16]
    # Leasing again answers the same and takes nothing more.
    (msg_type, _), again = _lease(sock, 2, rid)
    assert msg_type == MsgType.SHM_PIN_OK and np.frombuffer(again, np.uint64).tolist() == [
        bases[rid],
        1 << 16,
    ]
    # A release of a region this connection does not lease changes nothing.
    sock.sendall(_wire.pack(MsgType.SHM_RELEASE, worker.region_id))
    done = threading.Event()
    threading.Thread(target=lambda: (worker.call("deregister", rid), done.set()), daemon=True).start()
    assert _revoked(sock) == rid  # the target asks for it back...
    assert not done.wait(0.5), "deregister went through a held lease"  # ...and waits for it
    sock.sendall(_wire.pack(MsgType.SHM_RELEASE, rid))
    assert done.wait(10)
    # Gone for good: a new lease is refused; the lease on the other region holds on.
    (msg_type, aux), text = _lease(sock, 3, rid)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS) and b"unknown region" in text
    done.clear()
    threading.Thread(target=lambda: (worker.call("deregister", other), done.set()), daemon=True).start()
    assert _revoked(sock) == other
    assert not done.wait(0.3)
    sock.close()  # a connection that ends gives its leases back
    assert done.wait(10)


def test_a_peer_that_holds_a_lease_and_stops_holds_deregister_until_it_dies(make_worker, make_agent):
    agent = make_agent("target")
    pool = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16].copy()
    region = agent.register(pool)
    reader = make_worker("reader")
    reader.call("read_from", agent.metadata(), 0, region.id, 0, BLOCK)
    assert reader.call("peek", 0, BLOCK) == pool[:BLOCK].tobytes()
    reader.freeze()  # between transfers, with its lease
    try:
        with pytest.raises(kvx.RegionBusyError, match="lease"):
            agent.deregister(region, timeout_s=0.5)
    finally:
        reader.thaw()
    started = time.monotonic()
    agent.deregister(region, timeout_s=10)  # answered at once by a live peer
    assert time.monotonic() - started < 5
    # A peer that dies gives its leases back with its connection.
    second = agent.register(pool)
    reader.call("read_from", agent.metadata(), 0, second.id, 0, BLOCK)
    reader.freeze()
    reader.kill()
    agent.deregister(second, timeout_s=10)


def test_reads_racing_a_deregister_get_the_bytes_or_an_error_never_garbage(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent()
    pool = np.zeros(BLOCK, np.uint8)
    local = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm"
    for round_ in range(5):
        rid = worker.call("register", 1 << 16, True)
        worker.call("fill_region", rid, round_ + 1)
        peer = agent.add_peer(worker.call("metadata"))  # the new region
        remote = peer.region(rid).descs(BLOCK, BLOCK)
        peer.read(local.descs(0, BLOCK), remote).wait(10)  # leased from here on
        stop = threading.Event()
        outcomes: list[str] = []

        def hammer(peer=peer, remote=remote, stop=stop, outcomes=outcomes, value=round_ + 1) -> None:
            while not stop.is_set():
                pool[:] = 0
                try:
                    peer.read(local.descs(0, BLOCK), remote).wait(10)
                except kvx.AccessError:
                    outcomes.append("refused")
                    continue
                outcomes.append("ok" if (pool == value).all() else "garbage")

        thread = threading.Thread(target=hammer)
        thread.start()
        time.sleep(0.05)
        worker.call("deregister", rid)
        time.sleep(0.05)
        stop.set()
        thread.join(10)
        assert "garbage" not in outcomes and outcomes[-1] == "refused", outcomes[-5:]
        assert "ok" in outcomes
    # The peer's other leases (its pool) are untouched by the revocations.
    peer.read(local.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK)).wait(10)
    assert pool.tobytes() == worker.expected(0, BLOCK).tobytes()


def test_a_lease_smaller_than_the_published_region_bounds_every_copy(make_worker, make_agent):
    """The ranges a target leased, not the sizes it published, bound what the
    initiator copies: a lease that shrank (or a target that lies in its
    metadata) gets the descriptors past it refused, with no byte moved."""
    worker = make_worker()
    agent = make_agent()
    pool = np.zeros(4 * BLOCK, np.uint8)
    local = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm"
    remote = peer.regions[0]
    peer.read(local.descs(0, BLOCK), remote.descs(0, BLOCK)).wait(10)  # leased from here on
    conn = peer._channel.link.conns[0]
    key = (remote.id, False)
    base, size, *rest = conn.leases[key]
    assert size == remote.size_bytes
    conn.leases[key] = (base, 2 * BLOCK, *rest)
    pool[:] = 0xEE
    blocks = Descs.build(remote.id, [0, 2 * BLOCK, BLOCK], BLOCK)  # the second lies past the lease
    with pytest.raises(kvx.AccessError, match=r"descriptor 1 .*outside the region's 8192 bytes"):
        peer.read(local.descs(0, 3 * BLOCK), blocks).wait(10)
    assert (pool == 0xEE).all(), "a refused transfer moved bytes"
    # A lease whose base would carry the copy past the top of the address space.
    conn.leases[key] = ((1 << 64) - BLOCK, size, *rest)
    with pytest.raises(kvx.AccessError, match="overflows"):
        peer.read(local.descs(0, BLOCK), remote.descs(BLOCK, BLOCK)).wait(10)
    assert (pool == 0xEE).all()
    # The honest lease still copies, and the connection lives on.
    conn.leases[key] = (base, size, *rest)
    peer.read(local.descs(0, BLOCK), remote.descs(BLOCK, BLOCK)).wait(10)
    assert pool[:BLOCK].tobytes() == worker.expected(BLOCK, BLOCK).tobytes()


def _forged(rows):
    out = np.zeros(len(rows), kvx.descs.DESC_DTYPE)
    for i, row in enumerate(rows):
        out[i] = row
    return Descs(out)


def test_forged_local_descriptors_are_refused_on_the_leased_path(make_worker, make_agent):
    """The one-call path (local resolve, lease check and copy in C) refuses
    local ranges outside this agent's regions before any byte moves, and
    names the descriptor, as the full path does; deregister still waits."""
    worker = make_worker()
    agent = make_agent()
    buf = np.full(3 * BLOCK, 0xEE, np.uint8)  # two regions, then memory never registered
    first, second = agent.register(buf[:BLOCK]), agent.register(buf[BLOCK : 2 * BLOCK])
    peer = agent.add_peer(worker.metadata)
    assert peer.backend == "shm"
    remote = peer.regions[0].descs(0, BLOCK)
    peer.read(first.descs(0, BLOCK), remote).wait(10)  # leased from here on
    assert buf[:BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()
    buf[:] = 0xEE
    hostile = {
        "past the end": [(first.id, BLOCK - 8, 16)],
        "into the next region": [(first.id, 8, BLOCK)],
        "overflow": [(second.id, 1, (1 << 64) - 1)],
        "negative offset": [(second.id, (1 << 64) - 8, 8)],
        "unknown region": [(second.id + 1, 0, 16)],
        "second descriptor": [(first.id, 0, 8), (second.id, BLOCK, 8)],
    }
    for why, rows in hostile.items():
        n = sum(length for _, _, length in rows) % (1 << 64)
        remote_rows = [(peer.regions[0].id, 0, min(n, BLOCK))]
        with pytest.raises(kvx.AccessError, match=f"descriptor {len(rows) - 1}") as err:
            peer.read(_forged(rows), _forged(remote_rows)).wait(10)
        assert (buf == 0xEE).all(), f"{why}: a refused read moved bytes ({err.value})"
    # A region deregistered while reads into it run: each gets the bytes or
    # is refused; deregister returns once none can touch it, and none does after.
    stop = threading.Event()
    outcomes: list[str] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                peer.read(second.descs(0, BLOCK), remote).wait(10)
                outcomes.append("ok")
            except kvx.AccessError:
                outcomes.append("refused")

    thread = threading.Thread(target=hammer)
    thread.start()
    time.sleep(0.05)
    agent.deregister(second, timeout_s=10)
    buf[BLOCK : 2 * BLOCK] = 0xEE
    time.sleep(0.05)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert "ok" in outcomes and outcomes[-1] == "refused", outcomes[-5:]
    assert (buf[BLOCK:] == 0xEE).all(), "a read landed in a deregistered region"
    with pytest.raises(kvx.AccessError, match="unknown region"):
        peer.read(second.descs(0, BLOCK), remote).wait(10)
    peer.read(first.descs(0, BLOCK), remote).wait(10)  # the other region still works
    assert buf[:BLOCK].tobytes() == worker.expected(0, BLOCK).tobytes()


def _stop_reading(target: kvx.Agent, sock) -> int:
    """Makes the raw peer ``sock`` one that reads nothing, its stream full: the target's
    end of the connection is written to until the kernel takes no more. Returns how many
    bytes that was (junk the peer reads past when it reads again)."""
    port = sock.getsockname()[1]
    (conn,) = [c for c in target._listener._inbound if c.address.endswith(f":{port}")]
    sent = 0
    with conn.send_lock:  # the serving thread sends nothing meanwhile
        dup = socket.socket(fileno=os.dup(conn.sock.fileno()))
        try:
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent += dup.send(bytes(1 << 16), socket.MSG_DONTWAIT)
        finally:
            dup.close()
    return sent


def test_peers_that_read_nothing_hold_back_no_other_revoke_nor_deregisters_timeout(make_agent):
    """The attack: authenticated peers lease a region, then read nothing, their streams
    full. deregister sent each such peer its SHM_REVOKE in turn from the deregistering
    thread, each send blocking for Timeouts.io_s, before the next peer heard of it or the
    deregistration looked at its own timeout. Each revoke now goes out on a thread of its
    own. A peer that reads nothing keeps its lease (it may still copy, as a stopped peer
    may), and once it reads again its revoke reaches it, whole, though it sends nothing."""
    target = make_agent("target", timeouts=kvx.Timeouts(io_s=1.0))
    region = target.register(np.zeros(1 << 16, np.uint8))
    md = types.SimpleNamespace(metadata=target.metadata())
    peers = []
    for _ in range(5):
        sock, _ = _session(md)
        (msg_type, _), _ = _lease(sock, 1, region.id)
        assert msg_type == MsgType.SHM_PIN_OK
        peers.append(sock)
    *stuck, healthy = peers
    junk = [_stop_reading(target, sock) for sock in stuck]
    outcome: list[object] = []
    started = time.monotonic()
    thread = threading.Thread(
        target=lambda: outcome.append(_outcome(target.deregister, region, timeout_s=0.5))
    )
    thread.start()
    assert _revoked(healthy) == region.id  # at once, whatever the stuck peers do
    healthy.sendall(_wire.pack(MsgType.SHM_RELEASE, region.id))
    thread.join(30)
    # Within its own timeout, not after four sends of io_s each (4 s): the stuck peers'
    # leases hold, for they may still copy.
    assert time.monotonic() - started < 2.5 and isinstance(outcome[0], kvx.RegionBusyError), outcome
    time.sleep(max(0.0, started + 1.5 - time.monotonic()))  # past io_s: every send given up
    got: list[int] = []

    def read_again(sock, junk_bytes: int) -> None:
        _recv(sock, junk_bytes)
        got.append(_revoked(sock))  # whole, after what was written before it, unasked
        sock.sendall(_wire.pack(MsgType.SHM_RELEASE, region.id))

    readers = [threading.Thread(target=read_again, args=pair) for pair in zip(stuck, junk, strict=True)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(15)
    assert got == [region.id] * len(stuck), got
    target.deregister(region, timeout_s=10)  # every lease given back
    for sock in peers:
        sock.close()


def test_a_notice_to_a_peer_that_reads_nothing_does_not_hold_its_sender(make_agent):
    """A backend's one-way notice (RDMA_RESET goes to every peer of a rail that was
    reset, in turn) waited up to Timeouts.io_s for each peer that read nothing; it is
    sent from a thread of its own now, and reaches the peer, whole, once it reads."""
    target = make_agent("target", timeouts=kvx.Timeouts(io_s=2.0))
    target.register(np.zeros(4096, np.uint8))
    sock, _ = _session(types.SimpleNamespace(metadata=target.metadata()))
    junk = _stop_reading(target, sock)
    port = sock.getsockname()[1]
    (conn,) = [c for c in target._listener._inbound if c.address.endswith(f":{port}")]
    notice = _wire.pack(MsgType.SHM_REVOKE, 77)  # any one-way message
    started = time.monotonic()
    conn.send_oneway(notice)
    assert time.monotonic() - started < 1.0  # not io_s
    _recv(sock, junk)
    assert _revoked(sock) == 77
    sock.close()


def _outcome(fn, *args, **kwargs) -> object:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test compares it
        return exc
    return "ok"
