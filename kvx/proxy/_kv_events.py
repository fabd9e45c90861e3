"""What each prefill instance caches, learned from vLLM's KV cache events.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT"}'`` publishes on a ZMQ PUB
socket, per scheduler step, a multipart message ``[topic, seq, payload]``:
``seq`` an 8-byte big-endian counter from 0, ``payload`` a msgpack
``KVEventBatch`` ``[ts, events, data_parallel_rank]`` whose events are maps
tagged by ``"type"`` (vLLM 0.32; earlier releases sent tagged arrays, read
here too):

- ``BlockStored``: ``block_hashes`` (a chain of full blocks), their
  ``parent_block_hash`` (None for a chain that starts the prompt),
  ``token_ids`` (``block_size`` of them per block), ``block_size``;
- ``BlockRemoved``: ``block_hashes`` evicted;
- ``AllBlocksCleared``.

The index keys each block by its content, (parent's hash, its tokens), so a
prompt's cached prefix is found by walking its full blocks from the start,
without vLLM's hash function. Blocks with a LoRA adapter, extra keys
(multimodal inputs, cache salt), another KV-cache group than the first or
another medium than the GPU are left out: a plain prompt cannot hit them.

Everything that arrives is untrusted. The ZMQ connections are read by
``kvx.proxy._zmtp``, which reads nothing ahead of this module: a frame is
bounded by ``max_message_bytes`` and a message by ``MESSAGE_TIMEOUT_S`` and 64
frames (beyond either, the publisher is cut off and reconnected after
``RECONNECT_S``); a message of other than three frames is dropped; a batch
is bounded by ``MAX_EVENTS_PER_BATCH``, an event by ``MAX_BLOCKS_PER_EVENT`` and
``MAX_BLOCK_SIZE``, and the index by ``max_blocks`` (the oldest go first). A
batch that breaks the format is dropped whole, logged and counted. A
publisher that stalls or dies only leaves the index as it was, and routing
falls back to load: nothing waits on it. A sequence number that goes back
means the engine restarted with an empty cache: the index is cleared.
"""

from __future__ import annotations

import array
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvx.errors import ConfigError, ProtocolError
from kvx.proxy._zmtp import Stopped, ZmtpConnection, ZmtpTimeout, parse_endpoint

logger = logging.getLogger(__name__)

BlockHash = int | bytes
MAX_EVENTS_PER_BATCH = 65536  # a scheduler step stores or frees at most a few per request
MAX_BLOCKS_PER_EVENT = 65536  # 1M tokens at block size 16
MAX_BLOCK_SIZE = 4096  # tokens per block; vLLM's are 16 to a few hundred
MAX_HASH_BYTES = 64  # vLLM's hashes are 8-byte ints or 32-byte digests
MAX_FRAMES = 3  # topic, seq, payload
REPLAY_TIMEOUT_S = 2.0  # a replay not complete by then is given up: the gap stays
MAX_REPLAY_BATCHES = 10_000  # vLLM's buffer_steps default; a longer gap is not replayed
END_SEQ = -1  # vLLM's end-of-replay marker
RECONNECT_S = 1.0  # pause before a new connection to a publisher that was lost
LOG_EVERY_S = 10.0  # drops are logged at most this often per instance (all are counted)
STOP_TIMEOUT_S = 5.0
_TOKEN_TYPECODE = "I"  # token ids as 32-bit unsigned: a compact, exact key of a block's tokens
# Field order of the array-encoded events of earlier vLLM releases (after the tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


def require_msgspec() -> Any:
    try:
        import msgspec
    except ImportError as exc:
        raise ConfigError(
            "KV-aware routing (--prefill-kv-events) needs msgspec: pip install kvx[proxy]"
        ) from exc
    return msgspec


def tokens_key(token_ids: Sequence[int]) -> bytes:
    """The bytes that stand for a block's tokens; OverflowError or TypeError for non-token values."""
    return array.array(_TOKEN_TYPECODE, token_ids).tobytes()


class PrefixIndex:
    """The full blocks one instance holds, by content; thread-safe.

    ``_blocks`` maps a block's hash to its content key, oldest first (for
    eviction); ``_by_content`` maps (parent hash, tokens) back to the hash.
    """

    def __init__(self, max_blocks: int) -> None:
        assert max_blocks > 0
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self.evicted = 0  # blocks dropped to stay within max_blocks
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[BlockHash, tuple[BlockHash | None, bytes]] = (
            collections.OrderedDict()
        )
        self._by_content: dict[tuple[BlockHash | None, bytes], BlockHash] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def store(
        self, parent: BlockHash | None, hashes: Sequence[BlockHash], blocks: Sequence[bytes], size: int
    ) -> None:
        with self._lock:
            if self.block_size != size:
                # A new block size (an engine restarted with another one): the old keys cannot match.
                self._clear()
                self.block_size = size
            for block_hash, content in zip(hashes, blocks, strict=True):
                self._drop(block_hash)
                self._blocks[block_hash] = (parent, content)
                self._by_content[(parent, content)] = block_hash
                parent = block_hash
            while len(self._blocks) > self.max_blocks:
                oldest = next(iter(self._blocks))
                self._drop(oldest)
                self.evicted += 1

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                self._drop(block_hash)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def match(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are cached here, in whole blocks."""
        with self._lock:
            size = self.block_size
            if size is None or not self._blocks:
                return 0
            parent: BlockHash | None = None
            matched = 0
            for start in range(0, len(token_ids) - size + 1, size):
                try:
                    key = tokens_key(token_ids[start : start + size])
                except (OverflowError, TypeError):
                    break
                found = self._by_content.get((parent, key))
                if found is None:
                    break
                parent = found
                matched += size
            return matched

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._blocks.pop(block_hash, None)
        if entry is not None and self._by_content.get(entry) == block_hash:
            del self._by_content[entry]

    def _clear(self) -> None:
        self._blocks.clear()
        self._by_content.clear()


# -- decoding a batch ------------------------------------------------------


def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"KV event batch: {what}; is the endpoint a vLLM --kv-events-config publisher?")


def _hash(value: Any, what: str) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise _fail(f"{what} is a {type(value).__name__}, not an int or bytes")
    if isinstance(value, bytes) and len(value) > MAX_HASH_BYTES:
        raise _fail(f"{what} is {len(value)} bytes, over {MAX_HASH_BYTES}")
    return value


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list):
        raise _fail("block_hashes is not a list")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise _fail(f"{len(value)} block hashes in one event, over {MAX_BLOCKS_PER_EVENT}")
    return [_hash(v, "a block hash") for v in value]


def _fields(event: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """(type, fields) of a map-encoded event, or of an array-encoded one of earlier vLLM releases."""
    if isinstance(event, dict):
        kind = event.get("type")
        fields = event
    elif isinstance(event, list) and event:
        kind = event[0]
        fields = dict(zip(names, event[1:], strict=False))
    else:
        raise _fail(f"an event is a {type(event).__name__}, not a map")
    if not isinstance(kind, str):
        raise _fail("an event has no type")
    return kind, fields


def _indexed(fields: dict[str, Any]) -> bool:
    """Whether a plain prompt can hit these blocks (see the module's docstring)."""
    extra = fields.get("extra_keys")
    return (
        fields.get("medium") in (None, "GPU")
        and fields.get("group_idx") in (None, 0)
        and fields.get("lora_id") is None
        and fields.get("lora_name") is None
        and (extra is None or (isinstance(extra, list) and all(e is None for e in extra)))
    )


Op = tuple[str, Any]


def _stored(fields: dict[str, Any]) -> Op | None:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    parent = None if parent is None else _hash(parent, "parent_block_hash")
    size = fields.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        raise _fail(f"block_size {size!r} is not an int from 1 to {MAX_BLOCK_SIZE}")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        raise _fail(f"token_ids is not a list of {len(hashes)} blocks of {size} tokens")
    try:
        blocks = [tokens_key(tokens[i * size : (i + 1) * size]) for i in range(len(hashes))]
    except (OverflowError, TypeError):
        raise _fail("token_ids holds something other than token ids (ints from 0 to 2**32-1)") from None
    if not _indexed(fields):
        return None
    return ("stored", (parent, hashes, blocks, size))


def parse_batch(payload: bytes, decode: Callable[[bytes], Any]) -> list[Op]:
    """The index operations of one payload; ProtocolError if any of it breaks the format."""
    try:
        batch = decode(payload)
    except Exception as exc:  # noqa: BLE001 - msgspec's DecodeError and its relatives
        raise _fail(f"not msgpack ({type(exc).__name__}: {exc})") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise _fail(f"the batch is a {type(batch).__name__}, not [ts, events, data_parallel_rank]")
    if not isinstance(events, list):
        raise _fail("events is not a list")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise _fail(f"{len(events)} events in one batch, over {MAX_EVENTS_PER_BATCH}")
    ops: list[Op] = []
    for event in events:
        kind, fields = _fields(event, _STORED_FIELDS)
        if kind == "BlockStored":
            op = _stored(fields)
        elif kind == "BlockRemoved":
            _, fields = _fields(event, _REMOVED_FIELDS)
            hashes = _hashes(fields.get("block_hashes"))
            op = ("removed", hashes) if _indexed(fields) else None
        elif kind == "AllBlocksCleared":
            op = ("cleared", None)
        else:
            op = None  # an event type of a later vLLM: nothing here depends on it
        if op is not None:
            ops.append(op)
    return ops


def apply(index: PrefixIndex, ops: list[Op]) -> None:
    for kind, arg in ops:
        if kind == "stored":
            parent, hashes, blocks, size = arg
            index.store(parent, hashes, blocks, size)
        elif kind == "removed":
            index.remove(arg)
        else:
            index.clear()


# -- the subscriber ----------------------------------------------------------


class KvEventSubscriber:
    """One thread that reads one instance's KV events into its ``PrefixIndex``.

    ``on_batch(outcome)`` is called from that thread for every message:
    ``"applied"``, or why it was dropped (``"malformed"``, ``"frames"``);
    besides, ``"gap"`` before a batch applied after missed sequence numbers,
    ``"restart"`` when the index was cleared, ``"disconnected"`` when the
    connection was lost or cut off for breaking a bound (a new one follows after
    ``RECONNECT_S``),
    ``"replayed"`` for each missed batch recovered from ``replay_endpoint``
    (vLLM's ``replay_endpoint``, a ROUTER socket), ``"replay_failed"`` when a
    replay was given up. The replay blocks this thread for at most
    ``REPLAY_TIMEOUT_S``; live messages meanwhile wait in the publisher's queue
    and the socket's buffers (a publisher drops what its queue cannot hold: a
    gap).
    """

    def __init__(
        self,
        url: str,
        endpoint: str,
        index: PrefixIndex,
        max_message_bytes: int,
        on_batch: Callable[[str], None] = lambda outcome: None,
        topic: str = "",
        replay_endpoint: str | None = None,
    ) -> None:
        msgspec = require_msgspec()
        for each in (endpoint, replay_endpoint):
            if each is not None:
                parse_endpoint(each)  # ConfigError now, not a failure a second from now on
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.max_message_bytes = max_message_bytes
        self.on_batch = on_batch
        self.topic = topic.encode()
        self.last_seq: int | None = None
        self.last_event_unix_s: float | None = None
        self.dropped = 0
        self._decode = msgspec.msgpack.Decoder().decode
        self._stop = threading.Event()
        self._last_log_s = 0.0
        self._last_disconnect_log_s = -LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name=f"kvx-kv-events-{url}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join: bool = True) -> None:
        """Ends the subscription; with ``join``, waits up to STOP_TIMEOUT_S for its thread
        (it looks at the stop flag at least every ``_zmtp.STOP_POLL_S``)."""
        self._stop.set()
        if join:
            self._thread.join(STOP_TIMEOUT_S)

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "blocks": len(self.index),
            "block_size": self.index.block_size,
            "last_seq": self.last_seq,
            "last_event_unix_s": self.last_event_unix_s,
            "dropped": self.dropped,
        }

    def _run(self) -> None:
        failures = 0  # connections in a row that failed before a message: logged once
        while not self._stop.is_set():
            connected = False
            try:
                with ZmtpConnection(self.endpoint, "SUB", self.max_message_bytes, self._stop.is_set) as conn:
                    connected = True
                    failures = 0
                    conn.subscribe(self.topic)
                    self._read(conn)
            except Stopped:
                return
            except (OSError, ProtocolError) as exc:
                # Lost, refused, or cut off for breaking a bound: a new connection follows,
                # after a pause that keeps a rogue publisher from spinning this thread.
                if connected:
                    self.on_batch("disconnected")
                    now_s = time.monotonic()  # a publisher cut off every second: a line per LOG_EVERY_S
                    if now_s - self._last_disconnect_log_s >= LOG_EVERY_S:
                        self._last_disconnect_log_s = now_s
                        logger.warning(
                            "KV events from %s: %s; reconnecting in %s s (each loss is counted in "
                            'kvx_proxy_kv_event_batches_total{outcome="disconnected"})',
                            self.endpoint,
                            exc,
                            RECONNECT_S,
                        )
                else:
                    failures += 1
                    if failures == 1:
                        logger.warning(
                            "KV events from %s: cannot connect (%s); %s is routed by load until it "
                            "can; retrying every %s s",
                            self.endpoint,
                            exc,
                            self.url,
                            RECONNECT_S,
                        )
            except Exception:  # noqa: BLE001 - a bug here must not end the subscription
                logger.exception("KV events from %s failed; %s is routed by load", self.endpoint, self.url)
            self._stop.wait(RECONNECT_S)

    def _read(self, conn: ZmtpConnection) -> None:
        """Handle messages until the connection fails or the stop flag is set."""
        while True:
            frames = conn.receive(MAX_FRAMES)
            try:
                self._handle(frames)
            except Stopped:
                raise
            except Exception:  # noqa: BLE001 - a bug here must not end the subscription
                logger.exception("KV events from %s: handling a message failed", self.endpoint)

    def _handle(self, frames: list[bytes] | None) -> None:
        if frames is None or len(frames) != MAX_FRAMES:
            self._drop("frames", "a message without exactly 3 frames [topic, seq, payload]")
            return
        _, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            self._drop("malformed", f"a sequence number of {len(seq_bytes)} bytes, not 8")
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            ops = parse_batch(payload, self._decode)
        except ProtocolError as exc:
            self._drop("malformed", str(exc))
            return
        if self.last_seq is not None and seq <= self.last_seq:
            # vLLM counts from 0 again: a new engine, whose cache starts empty.
            logger.info("KV events from %s: sequence restarted at %d; clearing the index", self.endpoint, seq)
            self.index.clear()
            self.on_batch("restart")
        elif self.last_seq is not None and seq > self.last_seq + 1:
            # Missed batches: a missed store only costs a hit; a missed removal routes to a miss.
            self.on_batch("gap")
            if self.replay_endpoint is not None and seq - self.last_seq - 1 <= MAX_REPLAY_BATCHES:
                self._replay(self.last_seq + 1, seq)
        self.last_seq = seq
        self.last_event_unix_s = time.time()
        apply(self.index, ops)
        self.on_batch("applied")

    def _replay(self, start: int, end: int) -> None:
        """Apply batches ``start`` to ``end - 1`` from the replay socket, in order; stop at
        the first one missing, malformed or late (what was applied stays applied)."""
        assert self.replay_endpoint is not None
        expected = start
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        try:
            with ZmtpConnection(
                self.replay_endpoint, "DEALER", self.max_message_bytes, self._stop.is_set, REPLAY_TIMEOUT_S
            ) as conn:
                conn.send([b"", start.to_bytes(8, "big")], timeout_s=max(0.0, deadline - time.monotonic()))
                while expected < end:
                    # [b"", topic, seq, payload] (vLLM 0.32's replay), or [b"", seq, payload]
                    frames = conn.receive(4, deadline)
                    if frames is None or len(frames) < 3 or len(frames[-2]) != 8:
                        break
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if seq == END_SEQ or seq > expected:
                        break  # the publisher's buffer no longer holds it
                    if seq < expected:
                        continue
                    apply(self.index, parse_batch(frames[-1], self._decode))
                    self.on_batch("replayed")
                    expected += 1
        except ZmtpTimeout:
            pass  # counted below
        except (ProtocolError, OSError) as exc:
            logger.warning(
                "KV events from %s: replay from %s failed: %s", self.endpoint, self.replay_endpoint, exc
            )
        if expected < end:
            self.on_batch("replay_failed")

    def _drop(self, outcome: str, why: str) -> None:
        self.dropped += 1
        self.on_batch(outcome)
        now_s = time.monotonic()
        if now_s - self._last_log_s >= LOG_EVERY_S:
            self._last_log_s = now_s
            logger.warning(
                "KV events from %s (%s): dropped %s (%d dropped so far)",
                self.endpoint,
                self.url,
                why,
                self.dropped,
            )
