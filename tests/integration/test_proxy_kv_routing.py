"""KV-aware routing in ``kvx proxy``: vLLM's KV cache events over real ZMQ sockets.

A PUB socket in the test process publishes batches in vLLM's wire format
(``[topic, seq, msgpack KVEventBatch]``); the proxy's subscriber reads them
into its prefix index, and the proxy routes prefill by it. Rogue publishers
send garbage, wrong types, oversized and overlong messages: each is dropped
and counted, and the subscriber goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import itertools
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

import kvx.proxy._zmtp
from kvx.errors import ConfigError
from kvx.proxy import ProxyConfig, build_app
from kvx.proxy._instances import Instance
from kvx.proxy._kv_events import MAX_EVENTS_PER_BATCH, KvEventSubscriber, PrefixIndex
from kvx.proxy._kv_routing import MAX_METRICS_BYTES, KvRouting, kv_usage
from kvx.proxy._metrics import ProxyMetrics
from tests.conftest import native_pass_only, wait_until
from tests.integration.test_proxy import Served

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

pytestmark = [pytest.mark.timeout(90), native_pass_only]

BLOCK = 4
WAIT_S = 15.0
# A KVEventBatch as vLLM 0.32's own encoder writes it (msgspec.msgpack.encode of
# vllm.distributed.kv_events.KVEventBatch): BlockStored [11, 32-byte hash] with tokens
# 1..4 in blocks of 2; BlockStored [12] (parent 11, tokens 5, 6, group_idx 0);
# BlockRemoved [the 32-byte hash]; AllBlocksCleared.
VLLM_0_32_BATCH = bytes.fromhex(
    "93cb3ff80000000000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b"
    "c4200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f626c"
    "6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964"
    "c0a66d656469756da3475055a96c6f72615f6e616d65c089a474797065ab426c6f636b53746f726564ac626c"
    "6f636b5f686173686573910cb1706172656e745f626c6f636b5f686173680ba9746f6b656e5f696473920506"
    "aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a9"
    "67726f75705f6964780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c4"
    "200101010101010101010101010101010101010101010101010101010101010101a66d656469756da3475055"
    "81a474797065b0416c6c426c6f636b73436c656172656400"
)


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int = BLOCK, **extra: Any) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[Any]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def chain(tokens: list[int], first_hash: int, parent: Any = None) -> dict:
    """BlockStored for ``tokens`` (whole blocks), hashed first_hash, first_hash + 1, ..."""
    n = len(tokens) // BLOCK
    return stored(list(range(first_hash, first_hash + n)), parent, tokens[: n * BLOCK])


class Publisher:
    """A ZMQ PUB socket on loopback speaking vLLM's KV event protocol (or not)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = itertools.count()

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def send_payload(self, payload: bytes) -> int:
        seq = next(self.seq)
        self.send_frames([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def publish(self, *events: dict) -> int:
        return self.send_payload(msgspec.msgpack.encode([time.time(), list(events), 0]))

    def sync(self, subscriber: KvEventSubscriber) -> None:
        """Until the subscriber gets messages: PUB drops what it sends before SUB has joined."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.publish()
            if wait_until(lambda: subscriber.last_seq is not None, 0.2):
                return
        raise AssertionError(f"no KV events reached the subscriber of {self.endpoint}")

    def applied(self, subscriber: KvEventSubscriber, seq: int) -> bool:
        return wait_until(lambda: subscriber.last_seq is not None and subscriber.last_seq >= seq, WAIT_S)

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


@pytest.fixture
def publisher():
    pub = Publisher()
    yield pub
    pub.close()


@pytest.fixture
def subscribe():
    """subscribe(endpoint, **kw) -> a running KvEventSubscriber with outcomes counted in .outcomes."""
    running: list[KvEventSubscriber] = []

    def make(
        endpoint: str,
        max_blocks: int = 1000,
        max_message_bytes: int = 1 << 20,
        replay_endpoint: str | None = None,
    ) -> KvEventSubscriber:
        outcomes: dict[str, int] = {}

        def count(outcome: str) -> None:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        sub = KvEventSubscriber(
            "http://p",
            endpoint,
            PrefixIndex(max_blocks),
            max_message_bytes,
            count,
            replay_endpoint=replay_endpoint,
        )
        sub.outcomes = outcomes  # type: ignore[attr-defined]
        sub.start()
        running.append(sub)
        return sub

    yield make
    for sub in running:
        sub.stop()
        assert not sub._thread.is_alive()


# -- the index ----------------------------------------------------------------


def test_the_index_matches_whole_blocks_of_the_prefix_by_content():
    index = PrefixIndex(100)
    tokens = list(range(100, 120))  # 5 blocks
    index.store(None, [1, 2, 3], _keys(tokens[:12]), BLOCK)
    assert index.match(tokens) == 12
    assert index.match(tokens[:11]) == 8  # a partial block does not count
    assert index.match([0, *tokens]) == 0  # same tokens, other offset: no prefix
    assert index.match(tokens[:4] + [9, 9, 9, 9] + tokens[8:]) == 4
    index.store(3, [4], _keys(tokens[12:16]), BLOCK)  # the chain goes on
    assert index.match(tokens) == 16
    index.remove([2])  # a hole: the rest is no prefix any more
    assert index.match(tokens) == 4
    index.clear()
    assert index.match(tokens) == 0 and len(index) == 0


def test_the_index_keeps_at_most_max_blocks_oldest_out():
    index = PrefixIndex(3)
    tokens = list(range(40))
    index.store(None, list(range(10)), _keys(tokens), BLOCK)
    assert len(index) == 3 and index.evicted == 7
    assert index.match(tokens) == 0  # the first blocks went first
    assert index.match(list(range(8))) == 0


def _keys(tokens: list[int]) -> list[bytes]:
    from kvx.proxy._kv_events import tokens_key

    return [tokens_key(tokens[i : i + BLOCK]) for i in range(0, len(tokens), BLOCK)]


def test_the_choice_weighs_the_cached_prefix_against_queued_tokens():
    metrics = ProxyMetrics()
    routing = KvRouting(
        {"http://a": "tcp://127.0.0.1:1", "http://b": "tcp://127.0.0.1:2"}, metrics, 1.0, 100, 1024
    )
    a, b = Instance("http://a", "static"), Instance("http://b", "static")
    prompt = list(range(40))
    routing.indexes["http://b"].store(None, list(range(8)), _keys(prompt[:32]), BLOCK)
    choice = routing.choose([a, b], prompt)
    assert (choice.instance, choice.reason, choice.cached_tokens, choice.queued_tokens) == (
        b,
        "prefix",
        32,
        8,
    )
    b.queued_tokens = 33  # b must compute 33 more first: a, with nothing cached, is sooner
    choice = routing.choose([a, b], prompt)
    assert (choice.instance, choice.reason, choice.best_cached_tokens) == (a, "load_over_prefix", 32)
    b.queued_tokens = 31
    assert routing.choose([a, b], prompt).instance is b
    assert routing.choose([a, b], list(range(500, 540))).reason == "load"
    assert routing.choose([a, b], None).reason == "load"


# -- the subscriber over real ZMQ -----------------------------------------------


def test_vllm_0_32_batches_are_read_as_vllm_writes_them(publisher, subscribe):
    sub = subscribe(publisher.endpoint)
    publisher.sync(sub)
    # The golden batch stores, removes, then clears: all of it is applied.
    sub.index.store(None, [99], _keys([7, 7, 7, 7]), BLOCK)
    seq = publisher.send_payload(VLLM_0_32_BATCH)
    assert publisher.applied(sub, seq)
    assert len(sub.index) == 0 and sub.index.block_size == 2 and sub.dropped == 0
    # Its first two events alone: blocks 11 and the 32-byte hash, then 12 under 11.
    batch = msgspec.msgpack.decode(VLLM_0_32_BATCH)
    seq = publisher.send_payload(msgspec.msgpack.encode([batch[0], batch[1][:2], 0]))
    assert publisher.applied(sub, seq)
    assert sub.index.match([1, 2, 3, 4, 9]) == 4 and sub.index.match([1, 2, 5, 6]) == 4
    assert len(sub.index) == 3


def test_stored_and_removed_chains_follow_the_events(publisher, subscribe):
    sub = subscribe(publisher.endpoint)
    publisher.sync(sub)
    prompt = list(range(1000, 1032))
    seq = publisher.publish(chain(prompt[:16], 1), chain(prompt[16:], 5, parent=4))
    assert publisher.applied(sub, seq) and sub.index.match(prompt) == 32
    seq = publisher.publish(removed([6]))
    assert publisher.applied(sub, seq) and sub.index.match(prompt) == 20
    # Blocks a plain prompt cannot hit are not indexed: LoRA, extra keys, another group or medium.
    other = list(range(2000, 2008))
    seq = publisher.publish(
        stored([50, 51], None, other, lora_name="adapter"),
        stored([52, 53], None, other, extra_keys=[["salt"], None]),
        stored([54, 55], None, other, group_idx=1),
        stored([56, 57], None, other, medium="CPU"),
    )
    assert publisher.applied(sub, seq) and sub.index.match(other) == 0
    seq = publisher.publish({"type": "AllBlocksCleared"})
    assert publisher.applied(sub, seq) and sub.index.match(prompt) == 0


def test_a_sequence_that_restarts_clears_the_index(publisher, subscribe):
    sub = subscribe(publisher.endpoint)
    publisher.sync(sub)
    prompt = list(range(8))
    seq = publisher.publish(chain(prompt, 1))
    assert publisher.applied(sub, seq) and sub.index.match(prompt) == 8
    publisher.seq = itertools.count()  # a new engine on the same endpoint
    publisher.publish()
    assert wait_until(lambda: sub.outcomes.get("restart") == 1, WAIT_S)
    assert sub.index.match(prompt) == 0


class Replayer:
    """vLLM's replay endpoint: a ROUTER that answers [b"", start seq] with each buffered
    batch from start on, then the end marker, each as [b"", topic, seq, payload] (vLLM
    0.32), or without the topic; or, with ``garbage``, with that instead."""

    def __init__(
        self, publisher: Publisher, garbage: list[list[bytes]] | None = None, with_topic: bool = True
    ) -> None:
        self.buffer: list[tuple[int, bytes]] = []
        self.garbage = garbage
        self.topic = [b""] if with_topic else []
        self.sock = publisher.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            client, _, start = self.sock.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for frames in self.garbage or []:
                self.sock.send_multipart([client, *frames])
            for seq, payload in self.buffer if self.garbage is None else []:
                if seq >= int.from_bytes(start, "big"):
                    self.sock.send_multipart([client, b"", *self.topic, seq.to_bytes(8, "big"), payload])
            self.sock.send_multipart([client, b"", *self.topic, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.sock.close(0)


@pytest.mark.parametrize("with_topic", [True, False], ids=["topic-seq-payload", "seq-payload"])
def test_missed_batches_are_replayed_from_the_replay_endpoint(publisher, subscribe, with_topic):
    replayer = Replayer(publisher, with_topic=with_topic)
    try:
        sub = subscribe(publisher.endpoint, replay_endpoint=replayer.endpoint)
        publisher.sync(sub)
        prompt = list(range(700, 712))
        # Batches the subscriber never gets on PUB (as when ZMQ's queue overflowed):
        # only the replay buffer has them.
        for i in range(3):
            seq = next(publisher.seq)
            payload = msgspec.msgpack.encode(
                [0.0, [chain(prompt[i * 4 : i * 4 + 4], 10 + i, None if i == 0 else 9 + i)], 0]
            )
            replayer.buffer.append((seq, payload))
        seq = publisher.publish()
        assert publisher.applied(sub, seq)
        assert replayer.requests == [seq - 3]
        assert sub.outcomes.get("replayed") == 3 and sub.index.match(prompt) == 12
    finally:
        replayer.close()


def test_a_rogue_replay_endpoint_is_bounded(publisher, subscribe):
    """Garbage, wrong frame counts and endless old batches from the replay socket: the
    replay is given up within its time limit, and live batches go on."""
    old = msgspec.msgpack.encode([0.0, [], 0])
    garbage = [[b"only two"], [b"", b"", b"12345678", b"\xc1"]] + [
        [b"", b"", (0).to_bytes(8, "big"), old]
    ] * 2000
    replayer = Replayer(publisher, garbage=garbage)
    try:
        sub = subscribe(publisher.endpoint, replay_endpoint=replayer.endpoint)
        publisher.sync(sub)
        next(publisher.seq)  # one missed
        good = list(range(800, 804))
        seq = publisher.publish(chain(good, 1))
        assert publisher.applied(sub, seq) and sub.index.match(good) == 4
        assert sub.outcomes.get("replay_failed") == 1 and not sub.outcomes.get("replayed")
        assert sub._thread.is_alive()
    finally:
        replayer.close()


def test_a_rogue_publisher_is_dropped_and_counted_never_fatal(publisher, subscribe):
    """Garbage, wrong types, a batch over the limit, a frame over max_message_bytes,
    too many frames: each is dropped; the subscriber keeps reading good batches."""
    sub = subscribe(publisher.endpoint, max_message_bytes=256 * 1024)
    publisher.sync(sub)
    good = list(range(300, 308))
    attacks: list[bytes] = [
        b"\xc1\xff garbage",  # not msgpack
        msgspec.msgpack.encode({"not": "a batch"}),
        msgspec.msgpack.encode([0.0, "events", 0]),
        msgspec.msgpack.encode([0.0, [stored([1, 2], None, ["a", "b", "c", "d", 1, 2, 3, 4])], 0]),
        msgspec.msgpack.encode([0.0, [stored([1], None, [1, 2, 3, 4, 5])], 0]),  # tokens != blocks
        msgspec.msgpack.encode([0.0, [stored([1], None, [-1, 2, 3, 4])], 0]),
        msgspec.msgpack.encode([0.0, [stored([1], None, [1, 2, 3, 4], block_size=0)], 0]),
        msgspec.msgpack.encode([0.0, [stored([1.5], None, [1, 2, 3, 4])], 0]),
        msgspec.msgpack.encode([0.0, [stored([b"x" * 65], None, [1, 2, 3, 4])], 0]),
        msgspec.msgpack.encode([0.0, [stored({"a": 1}, None, [1, 2, 3, 4])], 0]),
        msgspec.msgpack.encode([0.0, [removed("nope")], 0]),
        msgspec.msgpack.encode([0.0, [42], 0]),
        # A batch over the event limit, of 3-byte events (of a type unknown here, so each
        # alone would be skipped, not refused): within the frame limit.
        msgspec.msgpack.encode([0.0, [["X"]] * (MAX_EVENTS_PER_BATCH + 1), 0]),
    ]
    for payload in attacks:
        publisher.send_payload(payload)
    # A good store inside the same garbage batch is not applied: the batch goes whole.
    publisher.publish(chain(good, 90), {"type": "BlockStored", "block_hashes": "x"})
    publisher.send_frames([b"", (0).to_bytes(4, "big"), b"\x90"])  # a 4-byte sequence number
    publisher.send_frames([b"", b"1" * 8, b"\x90", b"extra", b"more"])  # 5 frames
    assert wait_until(lambda: sub.outcomes.get("malformed", 0) == len(attacks) + 2, WAIT_S), sub.outcomes
    assert wait_until(lambda: sub.outcomes.get("frames", 0) == 1, WAIT_S), sub.outcomes
    assert sub.index.match(good) == 0
    # A frame over max_message_bytes: the publisher is cut off; it reconnects, and good
    # batches flow again (a huge token list is refused before it is decoded).
    huge = chain(list(range(200_000)), 1000)  # about 1 MiB
    assert len(msgspec.msgpack.encode([0.0, [huge], 0])) > 256 * 1024
    publisher.publish(huge)
    deadline = time.monotonic() + WAIT_S
    while sub.index.match(good) != 8 and time.monotonic() < deadline:
        publisher.publish(chain(good, 90))
        time.sleep(0.1)
    assert sub.index.match(good) == 8, sub.outcomes
    assert sub._thread.is_alive() and sub.index.match(list(range(8))) == 0


def test_a_publisher_that_never_answers_or_dies_leaves_routing_by_load(subscribe):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    sub = subscribe(endpoint)  # nobody listens there
    time.sleep(0.5)
    assert sub._thread.is_alive() and sub.last_seq is None and len(sub.index) == 0
    started = time.monotonic()
    sub.stop()
    assert time.monotonic() - started < 5.0 and not sub._thread.is_alive()


# -- the ZMQ connection, attacked -------------------------------------------------
#
# A rogue publisher written byte by byte (ZMTP 3.0): libzmq would queue an endless
# message's frames without bound, and wait forever on a silent or trickling peer.


def zmtp_frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(body) > 255:
        return bytes((flags | 0x02,)) + len(body).to_bytes(8, "big") + body
    return bytes((flags, len(body))) + body


def zmtp_hello(mechanism: bytes = b"NULL", socket_type: bytes = b"PUB") -> bytes:
    greeting = (
        b"\xff"
        + (1).to_bytes(8, "big")
        + b"\x7f"
        + b"\x03\x00"
        + mechanism.ljust(20, b"\0")
        + b"\0"
        + bytes(31)
    )
    ready = b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return greeting + zmtp_frame(ready, command=True)


def good_message(seq: int, *events: dict) -> bytes:
    payload = msgspec.msgpack.encode([time.time(), list(events), 0])
    return zmtp_frame(b"", more=True) + zmtp_frame(seq.to_bytes(8, "big"), more=True) + zmtp_frame(payload)


class RawPublisher:
    """A TCP listener on loopback: the first connection runs ``attack(conn)``, every later
    one says hello and sends a good batch, so the test sees the subscriber recover."""

    def __init__(self, attack: Any, good: list[int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.attack, self.good = attack, good
        self.accepted = 0
        self.attack_ended: BaseException | str | None = None  # how the attack's connection ended
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            threading.Thread(target=self._run, args=(conn, self.accepted), daemon=True).start()

    def _run(self, conn: socket.socket, n: int) -> None:
        with conn:
            try:
                if n == 1:
                    self.attack(conn, self._stop)
                    self.attack_ended = "the attack ran out"
                else:
                    conn.sendall(zmtp_hello() + good_message(7, chain(self.good, 500)))
                    self._stop.wait(WAIT_S)
            except OSError as exc:
                if n == 1:
                    self.attack_ended = exc

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.listener.close()


def endless_frames(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello())
    frame = zmtp_frame(b"x" * 200, more=True)
    for _ in range(2_000_000):  # 400 MB, more than any kernel buffer holds
        if stop.is_set():
            return
        conn.sendall(frame * 100)


def a_huge_length(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello() + b"\x02" + (1 << 62).to_bytes(8, "big") + b"x" * 1000)
    stop.wait(WAIT_S)


def a_trickled_message(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello() + zmtp_frame(b"", more=True) + b"\x01\x08")
    while not stop.wait(0.1):
        conn.sendall(b"\x00")  # one byte of the sequence number at a time, forever


def a_command_inside_a_message(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello() + zmtp_frame(b"", more=True) + zmtp_frame(b"\x04PING\x00\x01", command=True))
    stop.wait(WAIT_S)


@pytest.mark.parametrize(
    "attack", [endless_frames, a_huge_length, a_trickled_message, a_command_inside_a_message]
)
def test_a_publisher_breaking_a_bound_is_cut_off_and_the_next_connection_works(
    attack, subscribe, monkeypatch
):
    monkeypatch.setattr(kvx.proxy._zmtp, "MESSAGE_TIMEOUT_S", 1.0)
    good = list(range(900, 908))
    publisher = RawPublisher(attack, good)
    try:
        sub = subscribe(publisher.endpoint, max_message_bytes=64 * 1024)
        # The subscriber closes the connection (the attacker's send fails, or its wait ends
        # on a closed socket), counts it, and reads the good batch of the next connection.
        assert wait_until(lambda: sub.index.match(good) == 8, WAIT_S), (sub.outcomes, publisher.attack_ended)
        assert sub.outcomes.get("disconnected") == 1 and publisher.accepted == 2, sub.outcomes
        if attack is endless_frames:
            assert isinstance(publisher.attack_ended, OSError), publisher.attack_ended
        assert sub._thread.is_alive()
    finally:
        publisher.close()


def silent(conn: socket.socket, stop: threading.Event) -> None:
    stop.wait(WAIT_S)


def curve(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello(mechanism=b"CURVE"))
    stop.wait(WAIT_S)


def a_router(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello(socket_type=b"ROUTER"))
    stop.wait(WAIT_S)


def not_zmq(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 64)
    stop.wait(WAIT_S)


@pytest.mark.parametrize("attack", [silent, curve, a_router, not_zmq])
def test_a_handshake_that_fails_or_never_ends_is_given_up(attack, subscribe, monkeypatch):
    monkeypatch.setattr(kvx.proxy._zmtp, "HANDSHAKE_TIMEOUT_S", 1.0)
    good = list(range(910, 918))
    publisher = RawPublisher(attack, good)
    try:
        sub = subscribe(publisher.endpoint)
        assert wait_until(lambda: sub.index.match(good) == 8, WAIT_S), sub.outcomes
        # Never connected: nothing to count as lost.
        assert not sub.outcomes.get("disconnected") and publisher.accepted == 2
    finally:
        publisher.close()


def test_stop_is_prompt_while_a_message_trickles_in(subscribe):
    publisher = RawPublisher(a_trickled_message, [])
    try:
        sub = subscribe(publisher.endpoint)
        assert wait_until(lambda: publisher.accepted == 1, WAIT_S)
        time.sleep(0.5)  # inside the trickled message now
        started = time.monotonic()
        sub.stop()
        assert not sub._thread.is_alive() and time.monotonic() - started < 2.0
    finally:
        publisher.close()


def replay_silent(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello(socket_type=b"ROUTER"))
    stop.wait(WAIT_S)


def replay_endless(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(zmtp_hello(socket_type=b"ROUTER"))
    frame = zmtp_frame(b"x" * 200, more=True)
    while not stop.is_set():
        conn.sendall(frame * 100)


@pytest.mark.parametrize("attack", [replay_silent, replay_endless, silent])
def test_a_rogue_replay_peer_is_given_up_within_the_replay_timeout(publisher, subscribe, attack):
    replayer = RawPublisher(attack, [])
    try:
        sub = subscribe(publisher.endpoint, replay_endpoint=replayer.endpoint)
        publisher.sync(sub)
        next(publisher.seq)  # one missed: the replay peer is asked for it
        good = list(range(930, 934))
        seq = publisher.publish(chain(good, 1))
        assert publisher.applied(sub, seq) and sub.index.match(good) == 4
        assert sub.outcomes.get("replay_failed") == 1 and replayer.accepted == 1, sub.outcomes
        # The replay took at most REPLAY_TIMEOUT_S: live batches flow again at once.
        later = list(range(940, 944))
        seq = publisher.publish(chain(later, 2))
        assert publisher.applied(sub, seq) and sub.index.match(later) == 4
    finally:
        replayer.close()


class ScriptedPeer:
    """One connection on loopback, served by ``script(conn)`` on a thread: for tests of a
    ZmtpConnection on its own."""

    def __init__(self, script: Any) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.result: Any = None
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script: Any) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            self.result = script(conn)

    def close(self) -> None:
        self.thread.join(WAIT_S)
        self.listener.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "closed"
        data += chunk
    return data


def test_a_message_of_64_frames_is_read_and_one_of_65_cuts_the_peer_off():
    def script(conn: socket.socket) -> None:
        conn.sendall(zmtp_hello())
        conn.sendall(zmtp_frame(b"a", more=True) * 63 + zmtp_frame(b"z"))
        conn.sendall(zmtp_frame(b"", more=True) * 2 + zmtp_frame(b"last"))
        conn.sendall(zmtp_frame(b"a", more=True) * 65 + zmtp_frame(b"z"))
        conn.recv(1 << 16)  # until the subscriber closes

    peer = ScriptedPeer(script)
    try:
        with kvx.proxy._zmtp.ZmtpConnection(peer.endpoint, "SUB", 1024) as conn:
            assert conn.receive(3) is None  # 64 frames: read, dropped (more than 3)
            assert conn.receive(3) == [b"", b"", b"last"]  # the stream is still in step
            with pytest.raises(kvx.proxy._zmtp.ZmtpError, match="more than 64 frames"):
                conn.receive(3)
    finally:
        peer.close()


def test_a_ping_between_messages_is_answered_and_an_error_ends_the_connection():
    def script(conn: socket.socket) -> bytes:
        conn.sendall(zmtp_hello())
        _read_exactly(conn, 64)  # the subscriber's greeting
        flags, size = _read_exactly(conn, 2)
        _read_exactly(conn, size)  # its READY
        conn.sendall(zmtp_frame(b"\x04PING\x00\x0acontext-16bytes!", command=True) + zmtp_frame(b"after"))
        pong = _read_exactly(conn, 2 + len(b"\x04PONGcontext-16bytes!"))
        conn.sendall(zmtp_frame(b"\x05ERROR\x0bgo away now", command=True))
        return pong

    peer = ScriptedPeer(script)
    try:
        with kvx.proxy._zmtp.ZmtpConnection(peer.endpoint, "SUB", 1024) as conn:
            assert conn.receive(3) == [b"after"]
            with pytest.raises(kvx.proxy._zmtp.ZmtpError, match="sent ERROR: 'go away now'"):
                conn.receive(3)
    finally:
        peer.close()
    assert peer.result == zmtp_frame(b"\x04PONGcontext-16bytes!", command=True)


def test_zmq_endpoints_are_checked_before_anything_connects():
    parse = kvx.proxy._zmtp.parse_endpoint
    for bad in (
        "tcp://a:\u00b2",
        "tcp://a:\u0665\u0665",
        "tcp://" + "x" * 70 + ".example:1",
        "ipc://@",
        "ipc://",
        "tcp://a:65536",
    ):
        with pytest.raises(ConfigError, match="ZMQ endpoint"):
            parse(bad)
    assert parse("tcp://[::1]:5") == ("tcp", ("::1", 5))
    assert parse("ipc://@name") == ("ipc", "\0name") and parse("ipc:///run/x") == ("ipc", "/run/x")
    with pytest.raises(ConfigError, match="ZMQ endpoint"):
        KvEventSubscriber("http://p", "tcp://*:5557", PrefixIndex(10), 1024)


def test_stop_is_prompt_while_a_connect_waits(subscribe):
    """A publisher host that drops SYNs (here: a listener whose accept queue is full)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    fillers = []
    try:
        for _ in range(2):  # the queue's one place, and one more to be sure
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        time.sleep(0.2)
        sub = subscribe(endpoint)
        time.sleep(0.5)  # inside its connect now
        started = time.monotonic()
        sub.stop()
        assert not sub._thread.is_alive() and time.monotonic() - started < 2.0
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_events_over_ipc_from_a_real_zmq_publisher(subscribe, tmp_path):
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/events"
    sock.bind(endpoint)
    try:
        sub = subscribe(endpoint)
        good = list(range(920, 928))
        deadline = time.monotonic() + WAIT_S
        while sub.index.match(good) != 8 and time.monotonic() < deadline:
            sock.send_multipart(
                [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [chain(good, 1)], 0])]
            )
            time.sleep(0.1)
        assert sub.index.match(good) == 8, sub.outcomes
    finally:
        sock.close(0)
        context.term()


# -- the proxy ------------------------------------------------------------------


class FakeEngine:
    """A vLLM OpenAI server in miniature: /tokenize (a prompt of numbers is those token
    ids), and completions answered as a prefill or a decode instance."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.completions: list[dict] = []
        self.tokenized = 0
        self.metrics_text = ""
        self.metrics_gzip = False
        self.kv_params: dict = {"remote_engine_id": name}  # a prefill answer's kv_transfer_params
        self.gate: threading.Event | None = None  # set: a decode answers only once it is set
        app = FastAPI()
        app.post("/tokenize")(self.tokenize)
        app.get("/metrics")(self.metrics)
        app.post("/v1/completions")(self.complete)
        self.served = Served(app)
        self.url = self.served.url

    async def tokenize(self, request: Request) -> dict:
        body = await request.json()
        self.tokenized += 1
        tokens = [int(word) for word in body["prompt"].split()]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    async def metrics(self) -> Response:
        if self.metrics_gzip:  # the text, compressed: refused, not decoded
            return Response(gzip.compress(self.metrics_text.encode()), headers={"content-encoding": "gzip"})
        return Response(self.metrics_text, media_type="text/plain")

    async def complete(self, request: Request) -> dict:
        body = await request.json()
        self.completions.append(body)
        if self.role == "prefill":
            return {"choices": [{"text": "!"}], "kv_transfer_params": self.kv_params}
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, WAIT_S)
        return {"choices": [{"text": "ok"}], "served_by": self.name, "kv": body["kv_transfer_params"]}


@pytest.fixture
def engines():
    made = {
        "p0": FakeEngine("p0", "prefill"),
        "p1": FakeEngine("p1", "prefill"),
        "d0": FakeEngine("d0", "decode"),
        "d1": FakeEngine("d1", "decode"),
    }
    yield made
    for engine in made.values():
        engine.served.stop()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return 0.0


def test_prefill_goes_where_the_prefix_is_cached(engines):
    p0, p1, d0 = engines["p0"], engines["p1"], engines["d0"]
    pub0, pub1 = Publisher(), Publisher()
    config = ProxyConfig(
        prefill_urls=(p0.url, p1.url),
        decode_urls=(d0.url,),
        prefill_kv_events=((p0.url, pub0.endpoint), (p1.url, pub1.endpoint)),
    )
    app = build_app(config)
    served = Served(app, config)
    try:
        kv = app.state.router.kv
        pub0.sync(kv.subscribers[p0.url])
        pub1.sync(kv.subscribers[p1.url])
        shared = list(range(500, 564))  # 16 blocks
        seq = pub1.publish(chain(shared, 1))
        assert pub1.applied(kv.subscribers[p1.url], seq)
        client = httpx.Client(base_url=served.url, timeout=10)
        prompt = " ".join(map(str, [*shared, 7, 8, 9]))
        for _ in range(3):  # not by load: the idle instance p0 never gets it
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert answer.status_code == 200 and answer.json()["served_by"] == "d0"
        assert len(p1.completions) == 3 and not p0.completions
        metrics = client.get("/metrics").text
        assert _metric(metrics, 'kvx_proxy_route_total{leg="prefill",reason="prefix"}') == 3
        assert _metric(metrics, "kvx_proxy_prefill_cached_tokens_sum") == 3 * 64
        assert _metric(metrics, 'kvx_proxy_route_total{leg="decode",reason="load"}') == 3
        # A prompt cached nowhere goes by load, both instances in turn.
        other = " ".join(map(str, range(9000, 9040)))
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": other}).status_code == 200
        assert len(p0.completions) == 1 and len(p1.completions) == 4
        metrics = client.get("/metrics").text
        assert _metric(metrics, 'kvx_proxy_route_total{leg="prefill",reason="load"}') == 2
        health = client.get("/healthz").json()
        assert health["kv_events"][p1.url]["blocks"] == 16
        client.close()
    finally:
        served.stop()
        pub0.close()
        pub1.close()


def test_push_mode_picks_prefill_by_cached_prefix_too(engines):
    # --mode push sends both legs at once; its prefill leg must go where pull's would.
    p0, p1, d0 = engines["p0"], engines["p1"], engines["d0"]
    for i, p in enumerate((p0, p1)):
        p.kv_params = {
            "remote_engine_id": p.name,
            "remote_host": "127.0.0.1",
            "remote_port": 5600 + i,
            "tp_size": 1,
            "pp_size": 1,
            "kvx": {"agents": [f"{p.name}-tp0"], "epochs": ["0x1"], "digest": "d", "lease_s": 60},
        }
    pub0, pub1 = Publisher(), Publisher()
    config = ProxyConfig(
        mode="push",
        prefill_urls=(p0.url, p1.url),
        decode_urls=(d0.url,),
        prefill_kv_events=((p0.url, pub0.endpoint), (p1.url, pub1.endpoint)),
    )
    app = build_app(config)
    served = Served(app, config)
    try:
        kv = app.state.router.kv
        pub0.sync(kv.subscribers[p0.url])
        pub1.sync(kv.subscribers[p1.url])
        client = httpx.Client(base_url=served.url, timeout=10)
        # Nothing cached yet: by load, round robin, in pull mode (the proxy learns each instance).
        other = " ".join(map(str, range(9000, 9040)))
        for _ in range(6):
            if p0.completions and p1.completions:
                break
            assert client.post("/v1/completions", json={"prompt": other}).status_code == 200
        assert p0.completions and p1.completions
        learned0, learned1 = len(p0.completions), len(p1.completions)
        shared = list(range(500, 564))  # 16 blocks, cached on p1 only
        seq = pub1.publish(chain(shared, 1))
        assert pub1.applied(kv.subscribers[p1.url], seq)
        prompt = " ".join(map(str, [*shared, 7, 8, 9]))
        for _ in range(3):
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert answer.status_code == 200 and answer.json()["served_by"] == "d0"
            assert answer.json()["kv"]["remote_engine_id"] == "p1" and "push" in answer.json()["kv"]["kvx"]
        assert len(p0.completions) == learned0 and len(p1.completions) == learned1 + 3
        assert all("kvx_push" in c["kv_transfer_params"] for c in p1.completions[learned1:])
        metrics = client.get("/metrics").text
        assert _metric(metrics, 'kvx_proxy_route_total{leg="prefill",reason="prefix"}') == 3
        # Every prefill leg released what it queued there.
        health = client.get("/healthz").json()
        assert all(i["in_flight"] == 0 for i in health["prefill"]), health["prefill"]
        client.close()
    finally:
        served.stop()
        pub0.close()
        pub1.close()


def test_a_dead_publisher_or_tokenizer_routes_by_load_without_waiting(engines):
    p0, d0 = engines["p0"], engines["d0"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead, dead_url = f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}"  # nothing listens there
    pub = Publisher()
    config = ProxyConfig(
        prefill_urls=(dead_url, p0.url),
        decode_urls=(d0.url,),
        prefill_kv_events=((dead_url, pub.endpoint), (p0.url, dead)),
        kv_tokenize_timeout_s=2.0,
        cooldown_s=60.0,
    )
    app = build_app(config)
    served = Served(app, config)
    try:
        kv = app.state.router.kv
        pub.sync(kv.subscribers[dead_url])
        seq = pub.publish(chain(list(range(16)), 1))  # "cached" on the instance that is down
        assert pub.applied(kv.subscribers[dead_url], seq)
        client = httpx.Client(base_url=served.url, timeout=10)
        prompt = " ".join(map(str, range(20)))
        started = time.monotonic()
        answer = client.post("/v1/completions", json={"prompt": prompt})
        assert answer.status_code == 200 and len(p0.completions) == 1
        assert time.monotonic() - started < 8.0
        assert _metric(client.get("/metrics").text, "kvx_proxy_tokenize_failures_total") == 1
        client.close()
    finally:
        served.stop()
        pub.close()


def test_kv_events_config_is_checked():
    with pytest.raises(ConfigError, match="not a prefill instance"):
        ProxyConfig(prefill_urls=("http://a:1",), prefill_kv_events=(("http://b:1", "tcp://b:2"),))
    for endpoint in ("http://a:2", "tcp://*:5557", "tcp://a", "tcp://a:0", "tcp://a:2,tcp://a:3,tcp://a:4"):
        with pytest.raises(ConfigError, match="expected tcp://host:port"):
            ProxyConfig(prefill_urls=("http://a:1",), prefill_kv_events=(("http://a:1", endpoint),))
    for endpoint in ("tcp://a:2,tcp://a:3", "tcp://[::1]:2", "ipc:///run/vllm-events", "ipc://@events"):
        ProxyConfig(prefill_urls=("http://a:1",), prefill_kv_events=(("http://a:1", endpoint),))
    with pytest.raises(ConfigError, match="kv_alpha"):
        ProxyConfig(kv_alpha=-1.0)


def test_kv_usage_is_read_from_vllm_metrics():
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
        "vllm:kv_cache_usage_perc_other 0.9\n"
        'vllm:kv_cache_usage_perc{engine="2"} 7\n'  # out of range: ignored
        'vllm:kv_cache_usage_perc{engine="3"} nan-ish\n'
    )
    assert kv_usage(text) == 0.5
    assert kv_usage("vllm:num_requests_running 3\n") is None


def test_equally_loaded_decode_goes_to_the_most_free_kv_cache(engines):
    p0, d0, d1 = engines["p0"], engines["d0"], engines["d1"]
    d0.metrics_text = 'vllm:kv_cache_usage_perc{engine="0"} 0.9\n'
    d1.metrics_text = 'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
    config = ProxyConfig(
        prefill_urls=(p0.url,), decode_urls=(d0.url, d1.url), decode_kv_usage=True, refresh_s=0.2
    )
    served = Served(build_app(config), config)
    try:
        client = httpx.Client(base_url=served.url, timeout=10)

        def usage() -> dict[str, Any]:
            return {i["url"]: i["kv_usage"] for i in client.get("/healthz").json()["decode"]}

        assert wait_until(lambda: usage() == {d0.url: 0.9, d1.url: 0.1}, WAIT_S)
        for _ in range(3):  # by load alone they would alternate
            assert client.post("/v1/completions", json={"prompt": "1 2 3"}).json()["served_by"] == "d1"
        # Counted by what decided it: the KV cache in use, not the load.
        metrics = client.get("/metrics").text
        assert _metric(metrics, 'kvx_proxy_route_total{leg="decode",reason="kv_usage"}') == 3
        assert _metric(metrics, 'kvx_proxy_route_total{leg="decode",reason="load"}') == 0
        # A choice is counted by its own reason, though others are made while it is sent:
        # the first request waits in d1 (chosen by KV usage) while the second goes to d0 by load.
        d1.gate = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                httpx.post, f"{served.url}/v1/completions", json={"prompt": "1 2 3"}, timeout=10
            )
            assert wait_until(lambda: len(d1.completions) == 4, WAIT_S)
            assert client.post("/v1/completions", json={"prompt": "1 2 3"}).json()["served_by"] == "d0"
            d1.gate.set()
            assert first.result(WAIT_S).json()["served_by"] == "d1"
        metrics = client.get("/metrics").text
        assert _metric(metrics, 'kvx_proxy_route_total{leg="decode",reason="kv_usage"}') == 4
        assert _metric(metrics, 'kvx_proxy_route_total{leg="decode",reason="load"}') == 1
        # An engine whose /metrics is over the limit, or says nothing usable, counts as unknown.
        d1.metrics_text = "x" * (MAX_METRICS_BYTES + 1)
        d0.metrics_text = "garbage {{{ \n"
        assert wait_until(lambda: usage() == {d0.url: None, d1.url: None}, WAIT_S)
        # A compressed answer (4 MiB of it could decode to gigabytes) is not decoded.
        d0.metrics_text = 'vllm:kv_cache_usage_perc{engine="0"} 0.3\n'
        assert wait_until(lambda: usage()[d0.url] == 0.3, WAIT_S)
        d0.metrics_gzip = True
        assert wait_until(lambda: usage()[d0.url] is None, WAIT_S)
        client.close()
    finally:
        served.stop()
