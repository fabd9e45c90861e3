"""One agent of the chaos soak (benchmarks/soak.py starts it inside its own
network namespace; it is not meant to be run by hand).

It registers two regions with remote access and one local scratch region:

- source (read-only to peers): blocks whose bytes derive from
  (agent, region, block, generation), the generation being this agent's
  incarnation, so any reader can verify every byte it got;
- inbox (writable by peers): a slot of blocks per writer; a writer fills its
  slot with blocks derived from (writer, this agent, block, write generation)
  and names them in the notification of its WRITE, and this agent verifies
  what landed when the notification arrives;
- scratch: where READs land and WRITEs come from.

Two threads drive traffic (one READs, one WRITEs) at peers found by name in
the metadata service. The agent speaks JSON lines: events on stdout, commands
("go", "quiesce", "exit") on stdin. Every wait is bounded.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import struct
import sys
import threading
import time
import traceback
import zlib
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvx  # noqa: E402
from kvx.cli import LOG_FORMAT  # noqa: E402

SOURCE, INBOX = 0, 1
MAGIC = b"KVXSOAK1"
# magic, author (who wrote the bytes), holder (whose memory), region, block, generation, crc32 of the payload
HEADER = struct.Struct("<8sIIIIQI")
HEADER_BYTES = 64
START_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1


def block(seed: int, author: int, holder: int, region: int, index: int, generation: int, size: int) -> bytes:
    """The bytes of one block: a header naming it, then a payload derived from the header."""
    payload = np.random.default_rng([seed, author, holder, region, index, generation]).bytes(
        size - HEADER_BYTES
    )
    head = HEADER.pack(MAGIC, author, holder, region, index, generation, zlib.crc32(payload))
    return head.ljust(HEADER_BYTES, b"\0") + payload


def check(
    got: np.ndarray, seed: int, want: tuple[int, int, int, int], generation: int | None
) -> tuple[str, str | None]:
    """(verdict, reason) for the block ``got``, which should be block ``want``
    = (author, holder, region, index) at ``generation`` (any when None).

    Verdicts: "ok"; "corrupt"; for a WRITE's block, "superseded" (the same
    writer's newer generation is there, whole or still landing: its next
    WRITE, posted after this one failed for it, reached the block before
    this check) and "late" (an older generation is there, whole or still
    landing: a WRITE that had failed for the writer landed after this one).
    """
    raw = got.tobytes()
    magic, *named, gen, crc = HEADER.unpack_from(raw)
    if magic != MAGIC:
        return "corrupt", f"no block header (first bytes {raw[:16].hex()})"
    if tuple(named) != want:
        return "corrupt", f"header names block {tuple(named)}, expected {want}"
    intact = zlib.crc32(raw[HEADER_BYTES:]) == crc and raw == block(seed, *want, gen, len(raw))
    state = "whole" if intact else "partly"
    if generation is not None and gen > generation:
        return "superseded", f"generation {gen:#x} ({state}) replaced {generation:#x}"
    if generation is not None and gen < generation:
        return "late", f"generation {gen:#x} ({state}) landed over {generation:#x}"
    if not intact:
        return "corrupt", f"bytes differ from their derivation (generation {gen:#x}, expected {generation})"
    return "ok", None


class Emitter:
    """JSON lines to the soak on stdout, one writer at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"k": kind, **fields}, separators=(",", ":"))
        with self._lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):  # the soak is gone; PDEATHSIG ends us
                pass


class SoakAgent:
    def __init__(self, cfg: dict, emit: Emitter) -> None:
        self.cfg = cfg
        self.emit = emit
        self.index: int = cfg["index"]
        self.seed: int = cfg["seed"]
        self.size: int = cfg["block_bytes"]
        self.slot_blocks: int = cfg["slot_blocks"]
        self.max_blocks: int = cfg["max_blocks"]
        self.peers = [f"soak-a{i}" for i in range(cfg["agents"]) if i != self.index]
        self.stopping = threading.Event()
        self.go = threading.Event()
        self.op_ids = iter(range(1, 1 << 62))
        self.ids_lock = threading.Lock()
        size, n = self.size, cfg["source_blocks"]
        source = np.empty(n * size, np.uint8)
        for b in range(n):
            source[b * size : (b + 1) * size] = np.frombuffer(
                block(self.seed, self.index, self.index, SOURCE, b, cfg["incarnation"], size), np.uint8
            )
        source.flags.writeable = False  # peers may READ it, never WRITE it
        self.inbox = np.zeros(cfg["agents"] * self.slot_blocks * size, np.uint8)
        self.scratch = np.zeros(2 * self.max_blocks * size, np.uint8)  # READ area, then WRITE area
        self.agent = self._start_agent()
        self.agent.register(source)
        self.agent.register(self.inbox)
        self.scratch_region = self.agent.register(self.scratch, remote_access=False)

    def _start_agent(self) -> kvx.Agent:
        """The agent, registered with the metadata service; retried while the
        service (or its etcd) is down, as the soak may have restarted it."""
        t = self.cfg["timeouts"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return kvx.Agent(
                    f"soak-a{self.index}",
                    listen=f"{self.cfg['ip']}:0",
                    auth_secret=bytes.fromhex(self.cfg["secret"]),
                    timeouts=kvx.Timeouts(**t),
                    metadata=self.cfg["metadata"],
                    metadata_options=kvx.MetadataOptions(
                        lease_ttl_s=self.cfg["lease_ttl_s"], timeout_s=self.cfg["metadata_timeout_s"]
                    ),
                    backend="tcp",
                    on_notify=self._landed,
                )
            except kvx.ConnectError as exc:
                if time.monotonic() > deadline:
                    raise
                self.emit("start_retry", cls=type(exc).__name__, msg=str(exc)[:200])
                time.sleep(0.5)

    # Traffic.

    def run_traffic(self, op: str) -> None:
        rng = random.Random(f"{self.seed}/{self.index}/{self.cfg['incarnation']}/{op}")
        generation = self.cfg["incarnation"] << 32
        while not self.stopping.is_set():
            peer = rng.choice(self.peers)
            count = rng.randint(1, self.max_blocks)
            with self.ids_lock:
                op_id = next(self.op_ids)
            t_begin = time.monotonic()
            self.emit("b", i=op_id, t=t_begin)
            fields: dict[str, Any] = {"i": op_id, "op": op, "peer": peer, "tb": t_begin, "tp": None}
            try:
                if op == "read":
                    nbytes = self._read(peer, rng, count, fields)
                else:
                    generation += 1
                    fields["g"] = generation
                    nbytes = self._write(peer, rng, count, generation, fields)
            except kvx.KvxError as exc:
                self._end(fields, ok=False, cls=type(exc).__name__, msg=str(exc)[:300], kvx_error=True)
            except Exception as exc:  # the soak's verdict: anything but a kvx error is a finding
                self._end(
                    fields,
                    ok=False,
                    cls=type(exc).__name__,
                    msg=str(exc)[:300],
                    kvx_error=False,
                    trace=traceback.format_exc()[-2000:],
                )
            else:
                if nbytes is not None:
                    self._end(fields, ok=True, bytes=nbytes)
            if fields.get("hung"):
                return  # its scratch area may still be written: this thread stops here
            # After an error, a longer pause: a peer that is down must not turn the loop into a spin.
            pause_s = rng.uniform(0.0, self.cfg["pause_s"])
            self.stopping.wait(pause_s if fields.get("ok") is True else pause_s + 0.1)

    def _end(self, fields: dict, **more: Any) -> None:
        fields.update(more)
        self.emit("e", te=time.monotonic(), **fields)

    def _wait(self, transfer: kvx.Transfer, fields: dict) -> None:
        """transfer.wait within its timeout; a transfer still running past it
        gets the margin, and past that it is a hang."""
        try:
            transfer.wait(self.cfg["timeouts"]["transfer_s"])
        except kvx.TimeoutError:
            if transfer.done():
                raise
            fields["pending_after_wait"] = True
            try:
                transfer.wait(self.cfg["margin_s"])
            except kvx.TimeoutError:
                if not transfer.done():
                    fields["hung"] = True
                    self.emit("hang", i=fields["i"], op=fields["op"], peer=fields["peer"], t=time.monotonic())
                raise
            raise  # it finished within the margin; its error is the wait's timeout

    def _remote_region(self, peer: kvx.Peer, writable: bool) -> kvx.RemoteRegion | None:
        for region in peer.regions:
            if region.remote_read and region.remote_write == writable:
                return region
        return None

    def _read(self, name: str, rng: random.Random, count: int, fields: dict) -> int | None:
        peer = self.agent.connect(name)
        source = self._remote_region(peer, writable=False)
        if source is None:  # registered, regions not yet published: not an error of anyone
            self._end(fields, ok=None, skipped="peer has no source region yet")
            return None
        size = self.size
        blocks = rng.sample(range(source.size_bytes // size), count)
        area = self.scratch[: count * size]
        area.fill(0)  # a READ that moved nothing must not pass on the bytes of the previous one
        fields["tp"] = time.monotonic()
        transfer = peer.read(
            self.scratch_region.descs(np.arange(count) * size, size),
            source.descs(np.array(blocks) * size, size),
        )
        self._wait(transfer, fields)
        holder = int(name.rsplit("a", 1)[1])
        for slot, b in enumerate(blocks):
            verdict, reason = check(
                area[slot * size : (slot + 1) * size], self.seed, (holder, holder, SOURCE, b), None
            )
            if verdict != "ok":
                self.emit("corrupt", side="reader", peer=name, block=b, reason=reason, t=time.monotonic())
        return count * size

    def _write(self, name: str, rng: random.Random, count: int, generation: int, fields: dict) -> int | None:
        peer = self.agent.connect(name)
        inbox = self._remote_region(peer, writable=True)
        if inbox is None:
            self._end(fields, ok=None, skipped="peer has no inbox yet")
            return None
        size, base = self.size, self.index * self.slot_blocks
        holder = int(name.rsplit("a", 1)[1])
        blocks = [base + b for b in rng.sample(range(self.slot_blocks), count)]
        area = self.scratch[self.max_blocks * size : (self.max_blocks + count) * size]
        for slot, b in enumerate(blocks):
            area[slot * size : (slot + 1) * size] = np.frombuffer(
                block(self.seed, self.index, holder, INBOX, b, generation, size), np.uint8
            )
        note = json.dumps({"w": self.index, "g": generation, "b": blocks}).encode()
        fields["tp"] = time.monotonic()
        transfer = peer.write(
            self.scratch_region.descs(self.max_blocks * size + np.arange(count) * size, size),
            inbox.descs(np.array(blocks) * size, size),
            notify=note,
        )
        self._wait(transfer, fields)
        return count * size

    def _landed(self, note: kvx.Notification) -> None:
        """A WRITE's notification: its bytes have landed in the inbox; check each block."""
        try:
            info = json.loads(note.data)
            writer, generation, blocks = int(info["w"]), int(info["g"]), [int(b) for b in info["b"]]
            counts = {"ok": 0, "superseded": 0, "late": 0, "corrupt": 0}
            size = self.size
            for b in blocks:
                got = self.inbox[b * size : (b + 1) * size]
                verdict, reason = check(got, self.seed, (writer, self.index, INBOX, b), generation)
                counts[verdict] += 1
                if verdict in ("corrupt", "late"):
                    self.emit(
                        verdict, side="target", peer=note.peer, block=b, reason=reason, t=time.monotonic()
                    )
            self.emit("landed", peer=note.peer, **counts)
        except Exception as exc:
            self.emit(
                "crash",
                where="notification",
                msg=f"{type(exc).__name__}: {exc}",
                trace=traceback.format_exc(),
            )

    def quiesce(self, threads: list[threading.Thread]) -> None:
        self.stopping.set()
        deadline = time.monotonic() + self.cfg["quiesce_s"]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.emit("bye", stuck=[t.name for t in threads if t.is_alive()], t=time.monotonic())


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the soak died before the line above
        os._exit(1)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    _die_with_parent(cfg["parent"])
    # The level in each record: the soak counts the ERROR records of this log (soak.scan_log).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT)
    emit = Emitter()
    try:
        soak = SoakAgent(cfg, emit)
    except Exception as exc:
        emit("crash", where="start", msg=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        return 1
    from kvx._datapath import io as _io

    emit("ready", endpoint=soak.agent.endpoint, epoch=soak.agent.epoch, pid=os.getpid(), data_path=_io.IMPL)
    threads = [
        threading.Thread(target=_guard, args=(soak, op), name=f"soak-{op}", daemon=True)
        for op in ("read", "write")
    ]
    for line in sys.stdin:
        command = line.strip()
        if command == "go" and not soak.go.is_set():
            soak.go.set()
            for thread in threads:
                thread.start()
        elif command == "quiesce":
            soak.quiesce([t for t in threads if t.ident is not None])
        elif command == "exit":
            break
    soak.stopping.set()
    soak.agent.close()
    return 0


def _guard(soak: SoakAgent, op: str) -> None:
    try:
        soak.run_traffic(op)
    except Exception as exc:
        soak.emit("crash", where=op, msg=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main())
