"""End-to-end integrity (``verify=True``): every descriptor's CRC-32C on the
initiator's side is checked against the target's memory before the transfer
is done and before its notification goes; a difference is an IntegrityError
that names the descriptor.

The attack: a hostile network path between two agents flips a byte of the
data. The handshake authenticates the peers, not each byte, so without
``verify`` the flipped byte lands silently; with it the transfer fails.
"""

import select
import socket
import threading

import numpy as np
import pytest

import kvx
from kvx._net import parse_address
from kvx.agent import parse_metadata
from kvx.backends.control import wire as _wire
from kvx.backends.control.wire import MsgType
from tests.integration.test_faults import _expect_error_then_close, _session, _tampered

BLOCK = 4096


@pytest.fixture(params=["tcp", "shm", "shm-segments"], autouse=True)
def backend(request, monkeypatch):
    from tests.conftest import backend_setting

    return backend_setting(request.param, monkeypatch)


def test_verified_reads_and_writes_move_the_right_bytes_and_notify_after(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent(verify=True)
    pool = np.zeros(16 * BLOCK, np.uint8)
    region = agent.register(pool)
    peer = agent.add_peer(worker.metadata)
    ids = np.array([9, 2, 200, 31, 32, 33])
    peer.read(
        kvx.Descs.from_blocks(region, np.arange(6), BLOCK),
        kvx.Descs.from_blocks(peer.regions[0], ids, BLOCK),
        notify=b"read",
    ).wait(10)
    expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)
    assert np.array_equal(pool[: 6 * BLOCK].reshape(-1, BLOCK), expected[ids])
    pool[:] = 0x3C
    peer.write(
        region.descs(0, 3 * BLOCK), peer.regions[0].descs(100 * BLOCK, 3 * BLOCK), notify=b"write"
    ).wait(10)
    assert worker.call("peek", 100 * BLOCK, 3 * BLOCK) == bytes([0x3C]) * 3 * BLOCK
    assert worker.call("notifications", 5.0) == [("initiator", b"read"), ("initiator", b"write")]
    # A transfer may opt out of the agent's setting, and another agent opt in.
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK), verify=False).wait(10)
    plain = make_agent("plain")
    other = plain.add_peer(worker.metadata)
    mine = plain.register(np.zeros(BLOCK, np.uint8))
    other.read(mine.descs(0, BLOCK), other.regions[0].descs(BLOCK, BLOCK), verify=True).wait(10)


def test_a_difference_fails_the_transfer_and_withholds_the_notification(make_worker, make_agent, monkeypatch):
    """Whatever the backend moved, the target compares with its own memory:
    here the initiator's checksum of descriptor 2 is made wrong."""
    from kvx._datapath import checksum

    worker = make_worker()
    agent = make_agent()
    region = agent.register(np.zeros(4 * BLOCK, np.uint8))
    peer = agent.add_peer(worker.metadata)
    real = checksum.segments

    def one_wrong(addrs, lens, seg_lens):
        sums = real(addrs, lens, seg_lens)
        sums[2] ^= 1
        return sums

    monkeypatch.setattr(checksum, "segments", one_wrong)
    transfer = peer.read(
        kvx.Descs.from_blocks(region, np.arange(4), BLOCK),
        kvx.Descs.from_blocks(peer.regions[0], [5, 6, 7, 8], BLOCK),
        notify=b"must-not-arrive",
        verify=True,
    )
    rid = peer.regions[0].id
    with pytest.raises(kvx.IntegrityError, match=rf"descriptor 2 \(region {rid}, offset 28672, 4096 bytes\)"):
        transfer.wait(10)
    assert worker.call("notifications", 0.5) == []
    monkeypatch.setattr(checksum, "segments", real)
    peer.read(region.descs(0, BLOCK), peer.regions[0].descs(0, BLOCK), verify=True).wait(10)  # still usable


class _Flipper:
    """A TCP relay between an initiator and a target that flips one byte of
    the stream in one direction, at a given offset counted from ``arm()``."""

    def __init__(self, target: tuple[str, int], to_initiator: bool, offset: int) -> None:
        self.target = target
        self.to_initiator = to_initiator
        self.offset = offset
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.armed = threading.Event()
        self.counted = 0
        self.flipped = False
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self.threads.append(accept)

    def _accept(self) -> None:
        self.server.settimeout(0.2)
        while not self.stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target, timeout=10)
            pump = threading.Thread(target=self._pump, args=(client, upstream), daemon=True)
            pump.start()
            self.threads.append(pump)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        with client, upstream:
            while not self.stop.is_set():
                ready, _, _ = select.select([client, upstream], [], [], 0.2)
                for sock in ready:
                    data = bytearray(sock.recv(1 << 16))
                    if not data:
                        return
                    toward_initiator = sock is upstream
                    if toward_initiator == self.to_initiator and self.armed.is_set() and not self.flipped:
                        at = self.offset - self.counted
                        if 0 <= at < len(data):
                            data[at] ^= 0x01
                            self.flipped = True
                        self.counted += len(data)
                    (client if toward_initiator else upstream).sendall(data)

    def close(self) -> None:
        self.stop.set()
        self.server.close()
        for thread in self.threads:
            thread.join(5)


@pytest.mark.parametrize("backend", ["tcp"], indirect=True)  # the one whose bytes cross a network
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_byte_flipped_on_the_network_is_caught(make_worker, make_agent, op):
    worker = make_worker()
    endpoint = parse_address(parse_metadata(worker.metadata).endpoints[0].address)
    # READ: the response is a 32-byte header, then the data; WRITE: a header,
    # the descriptors (24 bytes each), then the data. Flip a byte of block 3.
    descs = 8
    offset = 32 + 3 * BLOCK + 7 if op == "read" else 32 + 24 * descs + 3 * BLOCK + 7
    results = {}
    for verify in (False, True):
        flipper = _Flipper(endpoint, to_initiator=op == "read", offset=offset)
        try:
            relayed = _tampered(
                worker.metadata, lambda md, relay=flipper.address: setattr(md.endpoints[0], "address", relay)
            )
            agent = make_agent(f"through-{verify}")
            pool = np.full(descs * BLOCK, 0x77, np.uint8)
            region = agent.register(pool)
            peer = agent.add_peer(relayed)
            flipper.armed.set()
            local = kvx.Descs.from_blocks(region, np.arange(descs), BLOCK)
            remote = kvx.Descs.from_blocks(peer.regions[0], np.arange(10, 10 + 2 * descs, 2), BLOCK)
            transfer = (peer.read if op == "read" else peer.write)(local, remote, verify=verify)
            try:
                transfer.wait(10)
                results[verify] = None
            except kvx.IntegrityError as exc:
                results[verify] = str(exc)
            assert flipper.flipped
            if op == "read":
                landed = pool.reshape(descs, BLOCK)
                expected = worker.expected(0, 1 << 20).reshape(-1, BLOCK)[10 : 10 + 2 * descs : 2]
            else:
                landed = np.frombuffer(
                    b"".join(worker.call("peek", b * BLOCK, BLOCK) for b in range(10, 10 + 2 * descs, 2)),
                    np.uint8,
                ).reshape(descs, BLOCK)
                expected = np.full((descs, BLOCK), 0x77, np.uint8)
            assert np.flatnonzero((landed != expected).any(axis=1)).tolist() == [3]  # the flipped block
            worker.call("fill", 0) if op == "write" else None
        finally:
            flipper.close()
    assert results[False] is None  # without verify the flipped byte lands silently
    assert results[True] is not None and "descriptor 3 (region " in results[True]


def test_malformed_verify_messages_close_the_connection(make_worker):
    worker = make_worker()
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.VERIFY, 1, payload_len=27))  # not descriptors with checksums
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.VERIFY, 1, payload_len=28, data_len=5))  # data with it
    _expect_error_then_close(sock, _wire.ErrorCode.PROTOCOL)
    sock, _ = _session(worker)
    sock.sendall(_wire.pack(MsgType.VERIFY, 1, payload_len=28 * 70000))  # over the descriptor limit
    _expect_error_then_close(sock, _wire.ErrorCode.LIMIT)


def test_a_verify_of_more_bytes_than_a_transfer_may_move_is_refused(make_worker):
    """Descriptors may repeat: one VERIFY naming the same region many times
    would have the target checksum far more bytes than any transfer moves,
    its serving thread busy and its table pinned meanwhile. The total is
    bounded by Limits.max_transfer_bytes, as a transfer's is."""
    from tests.integration.test_faults import _read_message

    worker = make_worker(limits={"max_transfer_bytes": 1 << 20})
    sock, md = _session(worker)
    whole = (worker.region_id, 0, 1 << 20)  # the whole 1 MiB pool: once is a transfer's worth
    for copies, expected in ((1, _wire.ErrorCode.INTEGRITY), (2, _wire.ErrorCode.LIMIT)):
        payload = np.array([whole] * copies, dtype=kvx.descs.DESC_DTYPE).tobytes() + b"\0" * 4 * copies
        sock.sendall(_wire.pack(MsgType.VERIFY, copies, payload_len=len(payload)) + payload)
        (msg_type, aux), text = _read_message(sock)
        assert (msg_type, aux) == (MsgType.ERROR, expected), text  # zero checksums: they differ
    assert b"VERIFY of 2097152 bytes; at most 1048576" in text
    sock.close()


def test_verify_outside_registered_memory_is_refused(make_worker):
    """VERIFY reads the target's memory: it is checked like a READ, so the
    checksums cannot be used to probe memory a peer may not read."""
    from tests.integration.test_faults import _read_message

    worker = make_worker()
    sock, _ = _session(worker)
    outside = np.array([(0, (1 << 20) - 8, 64)], dtype=kvx.descs.DESC_DTYPE).tobytes() + b"\0" * 4
    sock.sendall(_wire.pack(MsgType.VERIFY, 1, payload_len=len(outside)) + outside)
    (msg_type, aux), text = _read_message(sock)
    assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.ACCESS), text
    sock.close()


def test_bad_verify_settings_are_refused(make_agent):
    with pytest.raises(kvx.ConfigError, match="verify is True or False"):
        make_agent(verify="yes")
