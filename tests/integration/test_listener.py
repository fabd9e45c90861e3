"""The listener against strangers and restarts: what a connection that never
authenticates costs the agent, in connection slots and in log lines, and what
becomes of a restarted peer's old connections. The backend does not matter
here (tcp throughout): these are the listener's own."""

import contextlib
import logging
import os
import socket

import kvx
from kvx import Descs
from kvx._net import parse_address
from kvx.agent import parse_metadata
from kvx.backends.control import wire as _wire
from kvx.backends.control.wire import MsgType
from kvx.v1 import handshake_pb2
from tests.integration.test_faults import _read_message


def test_a_connection_whose_thread_cannot_start_gives_its_slot_back(make_agent, monkeypatch):
    """Near a thread or pids limit, the thread that would serve a new
    connection may not start. Its place among the connections must go with
    it: before, it stayed counted, and once dropped from the handshakes it
    counted as an authenticated peer for good, so enough such failures
    refused every peer (Limits.max_connections)."""
    from kvx.backends.control import serve

    target = make_agent("target", backend="tcp", limits=kvx.Limits(max_connections=1))
    listener = target._listener
    start = serve.InboundConnection.start
    failed = []

    def fail_once(conn):
        if not failed:
            failed.append(conn)
            raise RuntimeError("can't start new thread")
        start(conn)

    monkeypatch.setattr(serve.InboundConnection, "start", fail_once)
    sock = socket.create_connection(parse_address(target.endpoint), timeout=10)
    assert sock.recv(1) == b""  # closed at once
    sock.close()
    assert failed and not listener._inbound and not listener._handshakes
    peer = make_agent("initiator", backend="tcp").add_peer(target.metadata())  # the one slot is free
    assert peer.regions == []


def test_a_flood_of_bad_handshakes_does_not_flood_the_log(make_agent, caplog):
    """Anyone can connect: each refused handshake used to log a warning of
    its own, with up to 4 KB of the stranger's HELLO in it."""
    target = make_agent("target", backend="tcp")
    md = parse_metadata(target.metadata())
    address = parse_address(target.endpoint)
    with caplog.at_level(logging.WARNING, logger="kvx.backends.control.serve"):
        for _ in range(20):
            sock = socket.create_connection(address, timeout=10)
            hello = handshake_pb2.Hello(
                name="stranger", epoch=1, target_name="x" * 4000, target_epoch=md.epoch, nonce=os.urandom(32)
            ).SerializeToString()
            sock.sendall(_wire.pack(MsgType.HELLO, payload_len=len(hello)) + hello)
            (msg_type, aux), text = _read_message(sock)
            assert (msg_type, aux) == (MsgType.ERROR, _wire.ErrorCode.EPOCH), text
            sock.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith("refused 1 connection(s) in their handshake") and len(warned[0]) < 700


def _session_as(worker, name: str, epoch: int) -> socket.socket:
    """An authenticated raw connection to ``worker`` (no secret) as peer ``name`` at ``epoch``."""
    md = parse_metadata(worker.metadata)
    sock = socket.create_connection(parse_address(md.endpoints[0].address), timeout=10)
    hello = handshake_pb2.Hello(
        name=name, epoch=epoch, target_name=md.name, target_epoch=md.epoch, nonce=os.urandom(32)
    ).SerializeToString()
    sock.sendall(_wire.pack(MsgType.HELLO, payload_len=len(hello)) + hello)
    assert _read_message(sock)[0][0] == MsgType.HELLO_REPLY
    auth = handshake_pb2.Auth().SerializeToString()
    sock.sendall(_wire.pack(MsgType.AUTH, payload_len=len(auth)) + auth)
    assert _read_message(sock)[0][0] == MsgType.AUTH_OK
    return sock


def test_a_restarted_peer_ends_its_previous_instances_connections(make_worker):
    """Found by the chaos soak: a WRITE from a process killed while its
    packets were lost reached the target seconds later, after the restarted
    process had written newer data there, and landed over it (the kernel
    sends what a killed process left in its socket, then a plain FIN). Now a
    peer's new instance (its name, another epoch) ends the connections of the
    previous one as it authenticates: what they still bring is dropped."""
    worker = make_worker()
    old = _session_as(worker, "restarting", 1)
    other_stream = _session_as(worker, "restarting", 1)  # the same instance's second connection
    bystander = _session_as(worker, "someone-else", 7)
    descs = Descs.build(worker.region_id, 0, 4096).array.tobytes()
    # The old instance's WRITE: its header came, its data is still on the way.
    old.sendall(_wire.pack(MsgType.WRITE_REQ, 1, payload_len=len(descs), data_len=4096) + descs)
    new = _session_as(worker, "restarting", 2)
    for sock in (old, other_stream):  # ended by the target: EOF or a reset
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(65536) == b""
    with contextlib.suppress(OSError):
        old.sendall(b"\xee" * 4096)  # the late data: nobody reads it
    new.sendall(
        _wire.pack(MsgType.WRITE_REQ, 2, payload_len=len(descs), data_len=4096) + descs + b"\xab" * 4096
    )
    assert _read_message(new)[0][0] == MsgType.WRITE_RESP
    assert worker.call("peek", 0, 4096) == b"\xab" * 4096
    # Another peer, and another connection of the new instance, are left alone.
    again = _session_as(worker, "restarting", 2)
    bystander.sendall(
        _wire.pack(MsgType.WRITE_REQ, 3, payload_len=len(descs), data_len=4096) + descs + b"\xcd" * 4096
    )
    assert _read_message(bystander)[0][0] == MsgType.WRITE_RESP
    new.sendall(
        _wire.pack(MsgType.WRITE_REQ, 4, payload_len=len(descs), data_len=4096) + descs + b"\xab" * 4096
    )
    assert _read_message(new)[0][0] == MsgType.WRITE_RESP
    for sock in (old, other_stream, bystander, new, again):
        sock.close()
