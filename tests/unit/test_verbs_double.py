"""kvx._verbs (csrc/kvx_verbs.c) against the libibverbs double (tests/rdma_double).

The real provider code runs unchanged; only libibverbs is swapped (KVX_IBVERBS_LIB's
twin, ``_verbs.load(path)``). The double moves bytes with memcpy between QPs of this
process and checks what a NIC would (keys, bounds, access) and what only a double can
(state transitions and masks, send queue depth, selective signalling). What it cannot
show, everything on hardware, is in tests/rdma/.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest

from tests import rdma_double
from tests.conftest import native_pass_only

pytestmark = native_pass_only

PIECE = 32 * 1024
COUNT = 1000
READ, WRITE = 0, 1
RTR_MASK = (1 << 0) | (1 << 7) | (1 << 8) | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15)
# IBV_QP_STATE|AV|PATH_MTU|DEST_QPN|RQ_PSN|MAX_DEST_RD_ATOMIC|MIN_RNR_TIMER


@pytest.fixture(scope="module")
def loaded():
    try:
        verbs, lib, _ = rdma_double.load()  # one build per process, shared with test_rdma_verbs.py
    except rdma_double.Unavailable as why:
        pytest.skip(str(why))
    yield verbs, lib
    lib.fake_set_dead(0, 0)


@pytest.fixture
def double(loaded, monkeypatch):
    rdma_double.use_double(monkeypatch, rdma_double.built_path())
    return loaded


def violations(lib) -> str:
    buf = ctypes.create_string_buffer(16384)
    lib.fake_violations(buf, len(buf))
    return buf.value.decode()


def stats(lib) -> dict[str, int]:
    out = (ctypes.c_ulonglong * 8)()
    lib.fake_stats(out)
    names = ("posts", "wrs", "signalled", "max_chain", "max_sge", "max_sq", "created", "destroyed")
    return dict(zip(names, out, strict=True))


def connect(a, b) -> tuple[int, int]:
    half_a, info_a = a.prepare()
    half_b, info_b = b.prepare()
    peer_b = b.complete(half_b, info_a)
    peer_a = a.complete(half_a, info_b)
    return peer_a, peer_b


def u64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.uint64)


class Pair:
    """Two endpoints, one connection, a registered source and target on each."""

    def __init__(self, verbs, size: int, remote_read=True, remote_write=True) -> None:
        self.a, self.b = verbs.Endpoint(), verbs.Endpoint()
        self.peer, self.back = connect(self.a, self.b)
        self.local = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
        self.remote = np.zeros(size, dtype=np.uint8)
        self.mr_local = self.a.register(self.local.ctypes.data, size, remote_read=False, remote_write=False)
        self.mr_remote = self.b.register(
            self.remote.ctypes.data, size, remote_read=remote_read, remote_write=remote_write
        )

    def post(self, op, local_offsets, remote_offsets, length, key=None, timeout_ms=30_000):
        n = len(remote_offsets)
        self.a.post(
            op,
            self.peer,
            u64([self.local.ctypes.data + o for o in local_offsets]),
            u64([length] * len(local_offsets)),
            u64([self.remote.ctypes.data + o for o in remote_offsets]),
            u64([length * len(local_offsets) // n] * n),
            u64([self.mr_remote.key if key is None else key] * n),
            timeout_ms,
        )

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_1000_pieces_of_32k_write_then_read_byte_exact(double):
    verbs, lib = double
    violations(lib)
    stats(lib)  # reads and clears: the double is shared by every test in the process
    pair = Pair(verbs, COUNT * PIECE)
    try:
        order = np.random.default_rng(7).permutation(COUNT)  # remote pieces scattered
        pair.post(WRITE, [i * PIECE for i in range(COUNT)], [int(o) * PIECE for o in order], PIECE)
        for i, o in enumerate(order[:50]):
            assert bytes(pair.remote[o * PIECE : (o + 1) * PIECE]) == bytes(
                pair.local[i * PIECE : (i + 1) * PIECE]
            )
        written = pair.local.copy()
        pair.local[:] = 0
        pair.post(READ, [i * PIECE for i in range(COUNT)], [int(o) * PIECE for o in order], PIECE)
        assert np.array_equal(pair.local, written)
        s = stats(lib)
        assert s["wrs"] == 2 * COUNT
        # Selective signalling: one signalled WR per chain, chains of up to 32.
        assert s["signalled"] == s["posts"] < s["wrs"] // 8
        assert s["max_sq"] <= 256
        assert violations(lib) == ""
    finally:
        pair.close()


def test_pieces_split_at_max_msg_and_gathered_up_to_max_sge(double):
    verbs, lib = double
    lib.fake_config(64, 4, 128, 8192)  # small queues: the windows must hold
    try:
        pair = Pair(verbs, 64 * PIECE)
    finally:
        lib.fake_config(256, 4, 512, 1 << 30)
    try:
        assert pair.a.max_msg == 8192 and pair.a.max_sge == 4 and pair.a.max_outstanding == 64
        stats(lib)
        # 1 KiB local pieces gathered into 32 KiB remote pieces.
        pair.post(WRITE, [i * 1024 for i in range(64 * 32)], [i * PIECE for i in range(64)], 1024)
        assert np.array_equal(pair.local, pair.remote)
        s = stats(lib)
        assert s["max_sge"] == 4  # 4 KiB per WR: max_sge bounds it before max_msg does
        assert s["wrs"] == 64 * PIECE // 4096
        assert s["max_sq"] <= 64
        assert violations(lib) == ""
    finally:
        pair.close()


def test_qp_state_machine_and_attributes(double):
    verbs, lib = double
    pair = Pair(verbs, PIECE)
    try:
        _, qpn, _ = pair.a.peer_state(pair.peer)
        info = ctypes.create_string_buffer(256)
        assert lib.fake_qp_info(qpn, info, 256) == 0
        fields = dict(kv.split("=") for kv in info.value.decode().split())
        assert fields["log"] == "RESET>INIT>RTR>RTS"
        assert fields["rd_atomic"] == fields["dest_rd_atomic"] == "16"  # the device's max_qp_rd_atom
        assert fields["global"] == "1" and fields["mtu"] == "3"  # RoCE: GRH; MTU 1024
        assert int(fields["access"]) & 0b110 == 0b110  # REMOTE_WRITE | REMOTE_READ
        assert violations(lib) == ""
    finally:
        pair.close()
    # The double's checker refuses what a NIC refuses: wrong order, a mask bit short or extra.
    check = lib.fake_check_transition
    assert check(1, 2, RTR_MASK) is None
    assert check(0, 2, RTR_MASK) == b"transition not allowed"
    assert check(1, 2, RTR_MASK & ~(1 << 15)) == b"a required attribute mask bit is missing"
    assert check(1, 2, RTR_MASK | (1 << 9)) == b"an attribute mask bit not allowed in this transition"


@pytest.mark.parametrize(
    "case",
    ["bad rkey", "out of bounds", "read-only region written", "deregistered region"],
)
def test_remote_access_refused_with_status_named(double, case):
    verbs, lib = double
    pair = Pair(verbs, 4 * PIECE, remote_write=case != "read-only region written")
    try:
        key, remote = None, [0]
        if case == "bad rkey":
            key = pair.mr_remote.key ^ 0x40
        elif case == "out of bounds":
            remote = [3 * PIECE + 1]
        elif case == "deregistered region":
            pair.mr_remote.close()
        with pytest.raises(verbs.Error) as raised:
            pair.post(WRITE, [0], remote, PIECE, key=key)
        status, text, peer = raised.value.args
        assert status == "remote access error" and peer == pair.peer and str(peer) in text
        assert not pair.remote.any()
        if case == "read-only region written":  # READ is still allowed there, after reconnecting
            pair.a.disconnect(pair.peer)
            pair.b.disconnect(pair.back)
            pair.peer, pair.back = connect(pair.a, pair.b)
            pair.post(READ, [0], [0], PIECE)
            assert not pair.local[:PIECE].any()
        assert violations(lib) == ""
    finally:
        pair.close()


def test_error_completion_breaks_the_qp_and_reconnect_recreates_it(double):
    verbs, lib = double
    pair = Pair(verbs, 4 * PIECE)
    try:
        _, old_qpn, _ = pair.a.peer_state(pair.peer)
        with pytest.raises(verbs.Error):
            pair.post(WRITE, [0], [0], PIECE, key=pair.mr_remote.key + 1)
        state, qpn, why = pair.a.peer_state(pair.peer)
        assert state == "broken" and qpn == -1 and "remote access error" in why
        with pytest.raises(verbs.Error) as raised:  # the next use says to reconnect
            pair.post(WRITE, [0], [0], PIECE)
        assert raised.value.args[0] == "QP_BROKEN" and "reconnect" in raised.value.args[1]
        pair.a.disconnect(pair.peer)
        pair.b.disconnect(pair.back)
        pair.peer, pair.back = connect(pair.a, pair.b)
        _, new_qpn, _ = pair.a.peer_state(pair.peer)
        assert new_qpn not in (-1, old_qpn)
        pair.post(WRITE, [0, PIECE], [0, PIECE], PIECE)
        assert np.array_equal(pair.remote[: 2 * PIECE], pair.local[: 2 * PIECE])
        assert violations(lib) == ""
    finally:
        pair.close()


def test_dead_peer_fails_with_retry_exceeded_within_the_timeout(double):
    verbs, lib = double
    pair = Pair(verbs, 4 * PIECE)
    try:
        lib.fake_set_dead(-1, 100)
        start = time.monotonic()
        with pytest.raises(verbs.Error) as raised:
            pair.post(READ, [0], [0], PIECE, timeout_ms=20_000)
        assert raised.value.args[0] == "transport retry counter exceeded"
        assert time.monotonic() - start < 15
        # Completions later than the deadline: TimeoutError, the QP destroyed at once.
        pair.a.disconnect(pair.peer)
        pair.b.disconnect(pair.back)
        pair.peer, pair.back = connect(pair.a, pair.b)
        lib.fake_set_dead(-1, 600_000)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pair.post(READ, [0], [0], PIECE, timeout_ms=300)
        assert time.monotonic() - start < 15
        assert pair.a.peer_state(pair.peer)[:2] == ("broken", -1)
        assert violations(lib) == ""
    finally:
        lib.fake_set_dead(0, 0)
        pair.close()


def test_malformed_connection_info_refused(double):
    verbs, lib = double
    a, b = verbs.Endpoint(), verbs.Endpoint()
    try:
        half_a, info_a = a.prepare()
        half_b, info_b = b.prepare()
        assert len(info_a) == 32 and info_a[0] == 1
        bad = [
            info_a[:31],
            info_a + b"\0",
            b"\x02" + info_a[1:],  # version
            info_a[:1] + b"\x80" + info_a[2:],  # unknown flag
            info_a[:2] + b"\x09" + info_a[3:],  # MTU
            info_a[:11] + b"\x01" + info_a[12:],  # QPN beyond 24 bits
            b"",
        ]
        for info in bad:
            with pytest.raises(ValueError):
                b.complete(half_b, info)
        with pytest.raises(verbs.Error):
            b.complete(half_b + 1, info_a)  # not a half-open connection
        b.complete(half_b, info_a)  # still completes with good info
        a.complete(half_a, info_b)
        assert violations(lib) == ""
    finally:
        a.close()
        b.close()


def test_several_posting_threads_share_one_endpoint(double):
    verbs, lib = double
    pair = Pair(verbs, 8 * 100 * PIECE)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            base = t * 100 * PIECE
            offsets = [base + i * PIECE for i in range(100)]
            for _ in range(3):
                pair.post(WRITE, offsets, offsets[::-1], PIECE)
        except BaseException as error:  # noqa: BLE001 - reported by the assert below
            errors.append(error)

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        for t in range(8):
            for i in range(100):
                src = (t * 100 + i) * PIECE
                dst = (t * 100 + 99 - i) * PIECE
                assert bytes(pair.remote[dst : dst + PIECE]) == bytes(pair.local[src : src + PIECE])
        assert violations(lib) == ""
    finally:
        pair.close()


def test_local_memory_must_be_registered(double):
    verbs, _ = double
    pair = Pair(verbs, PIECE)
    stray = np.zeros(PIECE, dtype=np.uint8)
    try:
        with pytest.raises(ValueError, match="register it"):
            pair.a.post(
                WRITE,
                pair.peer,
                u64([stray.ctypes.data]),
                u64([PIECE]),
                u64([pair.remote.ctypes.data]),
                u64([PIECE]),
                u64([pair.mr_remote.key]),
                1000,
            )
        with pytest.raises(ValueError, match="same number of bytes"):
            pair.a.post(
                WRITE, pair.peer, u64([pair.local.ctypes.data]), u64([PIECE]),
                u64([pair.remote.ctypes.data]), u64([PIECE - 1]), u64([pair.mr_remote.key]), 1000,
            )  # fmt: skip
    finally:
        pair.close()


def test_gpu_memory_through_dmabuf_then_peer_memory(double):
    verbs, lib = double
    ep = verbs.Endpoint()
    buf = np.zeros(PIECE, dtype=np.uint8)  # host memory stands in for a GPU allocation
    try:
        mr = ep.register(buf.ctypes.data, PIECE, remote_read=True, remote_write=True, device=0)
        assert mr.how == "dma-buf"
        lib.fake_cuda_fail(1)
        mr2 = ep.register(buf.ctypes.data, PIECE, remote_read=True, remote_write=False, device=0)
        assert mr2.how.startswith("peer-memory (dma-buf unavailable: cuMemGetHandleForAddressRange")
        assert mr.key != mr2.key
        mr.close()
        mr2.close()
    finally:
        lib.fake_cuda_fail(0)
        ep.close()


def test_the_wrapper_raises_kvx_errors(double):
    from kvx import errors
    from kvx.backends.rdma import verbs as wrapper

    verbs, lib = double
    assert wrapper.available() is None  # the double has one device
    a, b = wrapper.Endpoint(), wrapper.Endpoint()
    try:
        half_a, info_a = a.prepare()
        half_b, info_b = b.prepare()
        with pytest.raises(wrapper.PeerInfoError):
            b.complete(half_b, info_a[:-1])
        peer = a.complete(half_a, info_b)
        b.complete(half_b, info_a)
        buf = np.zeros(PIECE, dtype=np.uint8)
        mr = b.register(buf.ctypes.data, PIECE, remote_read=True, remote_write=True)
        local = a.register(buf.ctypes.data, PIECE, remote_read=False, remote_write=False)
        with pytest.raises(wrapper.VerbsError) as raised:
            a.post(WRITE, peer, [buf.ctypes.data], [PIECE], [buf.ctypes.data], [PIECE], [mr.key ^ 1], 5000)
        assert isinstance(raised.value, errors.TransferError) and raised.value.status == "remote access error"
        assert a.peer_state(peer)[0] == "broken"
        local.close()
        mr.close()
    finally:
        a.close()
        b.close()
    assert violations(lib) == ""
