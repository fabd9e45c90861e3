"""A kvx agent behind the transfer-engine interface SGLang's disaggregation uses.

SGLang's transfer backends move bytes through a small engine interface:
register memory by address, name this process by a ``host:port`` session id,
and synchronously write batches of (local address, peer address, length)
to a peer session. ``KvxTransferEngine`` gives that interface kvx's data
plane: one agent per process, addresses translated to (region, offset)
descriptors on both sides and checked against registered memory, one
one-sided WRITE per batch, clear errors in place of hangs.

The session id is ``host:port`` of a small side channel that serves the
agent's metadata (no secret in it; writes still need the cluster secret).

SGLang calls the engine from its transfer threads: first contact with a
session happens once (the others wait for it), and nothing raises out of a
transfer or a probe. A failure returns -1, which SGLang turns into a failed
transfer; its reason is logged and kept per session (``failure``) until a
transfer to that session succeeds, so the manager can report it to SGLang.
"""

from __future__ import annotations

import base64
import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvx._net import parse_address
from kvx.agent import Agent, Peer, parse_metadata
from kvx.config import Timeouts
from kvx.connectors import side_channel
from kvx.descs import DESC_DTYPE, Descs
from kvx.errors import AccessError, KvxError, ProtocolError

logger = logging.getLogger(__name__)

# Failure reasons kept at most, one per session: a prefill serves a few decode
# ranks at a time, but sees a new session each time one restarts.
MAX_FAILURES = 256


class _Contact:
    """First contact with one session: its lock, and how many callers wait on it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class _AddressMap:
    """Sorted (start, end, region id) ranges: absolute address -> (region, offset)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.ids: list[int] = []

    def add(self, start: int, size: int, region_id: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, start + size)
        self.ids.insert(i, region_id)

    def remove(self, start: int) -> int | None:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start:
            self.ends.pop(i)
            self.starts.pop(i)
            return self.ids.pop(i)
        return None

    def descs(self, addrs: Sequence[int], lengths: np.ndarray, whose: str) -> Descs:
        a = np.asarray(addrs, dtype=np.uint64)
        starts = np.asarray(self.starts, dtype=np.uint64)
        idx = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
        ends = np.asarray(self.ends, dtype=np.uint64)
        bad = idx < 0
        safe = np.where(bad, 0, idx)
        if len(starts):
            bad |= a + lengths > ends[safe]
        else:
            bad[:] = True
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise AccessError(
                f"{whose} range {int(a[k]):#x}+{int(lengths[k])} is not inside registered memory"
            )
        out = np.zeros(len(a), dtype=DESC_DTYPE)
        out["region"] = np.asarray(self.ids, dtype=np.uint64)[safe]
        out["offset"] = a - starts[safe]
        out["length"] = lengths
        return Descs(out)


class KvxTransferEngine:
    """The per-process engine (one agent, one side channel)."""

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        *,
        auth_secret: bytes | None = None,
        allow_insecure: bool = False,
        timeouts: Timeouts | None = None,
        backend: str = "auto",
    ) -> None:
        # Peers' liveness probes arrive as notifications; nothing else does.
        self.agent = Agent(
            name,
            listen=f"{host}:0",
            auth_secret=auth_secret,
            allow_insecure=allow_insecure,
            on_notify=lambda note: None,
            backend=backend,
            timeouts=timeouts or Timeouts(connect_s=10, io_s=10, transfer_s=60),
        )
        self._local = _AddressMap()
        self._lock = threading.Lock()  # the local address map
        self._peers: dict[str, tuple[Peer, _AddressMap]] = {}
        # First contact with a peer happens once: SGLang's transfer threads
        # race for the same session, and two of them must not both connect.
        self._contact_lock = threading.Lock()  # guards _contacts and _failures
        self._contacts: dict[str, _Contact] = {}
        self._failures: OrderedDict[str, str] = OrderedDict()  # session -> why its last transfer failed
        self._server = side_channel.SideChannelServer(host, 0)
        self._publish()
        self.session_id = f"{host}:{self._server.port}"
        logger.info("kvx transfer engine %s: session %s", name, self.session_id)

    def _publish(self) -> None:
        self._server.publish({"agent_metadata": base64.b64encode(self.agent.metadata()).decode()})

    # Registration, by address.

    def register(self, ptr: int, length: int) -> None:
        self.batch_register([ptr], [length])

    def batch_register(self, ptrs: list[int], lengths: list[int]) -> int:
        with self._lock:
            for ptr, length in zip(ptrs, lengths, strict=True):
                if length <= 0:
                    continue
                region = self.agent.register((int(ptr), int(length)))
                self._local.add(int(ptr), int(length), region.id)
            self._publish()
        return 0

    def deregister(self, ptr: int) -> None:
        self.batch_deregister([ptr])

    def batch_deregister(self, ptrs: list[int]) -> int:
        with self._lock:
            for ptr in ptrs:
                region_id = self._local.remove(int(ptr))
                if region_id is not None:
                    self.agent.deregister(region_id)
            self._publish()
        return 0

    # Transfers.

    def get_session_id(self) -> str:
        return self.session_id

    def _peer(self, session_id: str) -> tuple[Peer, _AddressMap]:
        cached = self._peers.get(session_id)
        if cached is not None and cached[0].alive:
            return cached
        with self._contact_lock:
            contact = self._contacts.setdefault(session_id, _Contact())
            contact.users += 1
        try:
            with contact.lock:  # one first contact per session; the others wait for it and reuse it
                return self._contact(session_id)
        finally:
            with self._contact_lock:
                contact.users -= 1
                if not contact.users:  # the last caller: the table stays as small as the work
                    del self._contacts[session_id]

    def _contact(self, session_id: str) -> tuple[Peer, _AddressMap]:
        cached = self._peers.get(session_id)
        if cached is not None and cached[0].alive:
            return cached
        host, port = parse_address(session_id)
        doc = side_channel.fetch(host, port, self.agent.timeouts.connect_s)
        try:
            metadata = base64.b64decode(doc["agent_metadata"], validate=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(
                f"session {session_id}: no agent metadata in its side channel ({exc})"
            ) from None
        md = parse_metadata(metadata)
        remote = _AddressMap()
        for r in md.regions:
            if r.remote_write:
                remote.add(r.address, r.size_bytes, r.id)
        entry = (self.agent.add_peer(metadata), remote)
        self._peers[session_id] = entry
        return entry

    def batch_transfer_sync(
        self, session_id: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int:
        """WRITE each local range to the peer's; 0 on success, -1 on failure (logged)."""
        try:
            if not buffers:
                return 0
            peer, remote = self._peer(session_id)
            lens = np.asarray(lengths, dtype=np.uint64)
            with self._lock:
                local = self._local.descs(buffers, lens, "local")
            peer.write(local, remote.descs(peer_buffer_addresses, lens, f"peer {session_id}")).wait()
        except (KvxError, OSError, ValueError) as exc:
            logger.warning("kvx transfer to %s failed: %s", session_id, exc)
            return self._failed(session_id, str(exc))
        except Exception as exc:  # a bug must fail this transfer, not escape into SGLang's thread
            logger.exception("kvx transfer to %s failed", session_id)
            return self._failed(session_id, f"{type(exc).__name__}: {exc}")
        if self._failures:
            with self._contact_lock:
                self._failures.pop(session_id, None)
        return 0

    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def send_probe(self, peer_session_id: str) -> int:
        """0 when the peer answers a notification, -1 otherwise."""
        try:
            peer, _ = self._peer(peer_session_id)
            peer.notify(b"probe").wait(self.agent.timeouts.connect_s)
            return 0
        except (KvxError, OSError, ValueError) as exc:
            logger.info("kvx probe of %s failed: %s", peer_session_id, exc)
        except Exception:  # as for transfers: a bug must not escape into SGLang's thread
            logger.exception("kvx probe of %s failed", peer_session_id)
        self._peers.pop(peer_session_id, None)
        return -1

    def _failed(self, session_id: str, reason: str) -> int:
        """Forget the peer (the next transfer contacts it again) and keep the reason."""
        self._peers.pop(session_id, None)
        with self._contact_lock:
            self._failures.pop(session_id, None)
            self._failures[session_id] = reason
            if len(self._failures) > MAX_FAILURES:
                self._failures.popitem(last=False)
        return -1

    def failure(self, session_id: str) -> str | None:
        """Why the last transfer to ``session_id`` failed; None once one has succeeded since."""
        with self._contact_lock:
            return self._failures.get(session_id)

    def get_engine(self) -> KvxTransferEngine:
        return self

    def get_ib_device(self) -> None:
        return None

    def close(self) -> None:
        self._server.close()
        self.agent.close()
