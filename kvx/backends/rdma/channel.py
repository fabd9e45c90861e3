"""The rdma backend's channel: a connected peer over one or more rail pairs.

Large transfers are cut into slices, one per rail that is up (each at least
``rails.SLICE_MIN_BYTES``), posted on the rails at once; small ones go on one
rail, taken in turn. A rail whose post fails (an error completion, a lost
connection on that rail, a broken QP) is marked down with the reason, and
its slices move to the rails still up. A down rail is connected again (a new
RDMA_CONNECT for that pair over the same control link) on the next transfer
once RAIL_RETRY_S passed, or at once when no rail is up. Only when that
fails for every rail, or FAILURES_BEFORE_FALLBACK transfers in a row failed,
do the peer's transfers go over tcp. A transfer's failure counts toward that
only when it took a rail down: the transfers that were on a queue pair when
it broke fail with it, but they are one failure, which the reconnect on next
use may heal (a transfer that succeeds sets the count back to zero).

An endpoint reset (software providers: ``RdmaBackend.reset_rail``, after a
deregister or a timed-out post, on either side) is no failure: the pair is
marked stale (this agent's endpoint changed generation, or the peer sent
RDMA_RESET) and connected again before its next post; a post that the reset
failed in flight (status RESET, or a peer number it made unknown) is
retried once after connecting again. None of it counts toward the fallback.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvx.backends.base import Channel
from kvx.backends.control import wire as _wire
from kvx.backends.rdma import rails
from kvx.backends.rdma.copy import RdmaCopy, post_error
from kvx.backends.tcp import TcpChannel
from kvx.errors import (
    ClosedError,
    ConfigError,
    KvxError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
    TransferError,
)
from kvx.transfer import Op, Transfer

if TYPE_CHECKING:
    from kvx.backends.control.link import Link
    from kvx.backends.rdma import RdmaBackend

logger = logging.getLogger(__name__)

VERBS = "verbs"  # the provider name of kvx._verbs (ibverbs, RC QPs)
# Transfers up to this size go through the regions' leases on the posting
# thread (no pin round trip); larger ones in parts on the connections' threads.
INLINE_COPY_BYTES = 4 << 20
# Failed transfers in a row after which a peer's transfers go over tcp instead.
FAILURES_BEFORE_FALLBACK = 3
# A rail that failed while others are up is tried again after this long.
RAIL_RETRY_S = 10.0


@dataclasses.dataclass
class RailPair:
    """Local rail ``rail`` and the peer's rail ``rail mod n``."""

    rail: int
    fabric_peer: int
    down: str | None = None  # why it is down; None: up
    since: float = 0.0
    reviving: bool = False
    generation: int = 0  # of this agent's endpoint on the rail when the pair was connected
    stale: bool = False  # the peer reset its endpoint (RDMA_RESET): connect again before posting


class RdmaChannel(Channel):
    """Host memory (and GPU memory both NICs registered) through the NICs;
    anything else over tcp on the same link, and everything once every rail
    has failed for this peer."""

    def __init__(
        self,
        link: Link,
        backend: RdmaBackend,
        fabric_peers: list[int],
        *,
        remote_rails: int,
        remote_gpu: bool,
    ) -> None:
        super().__init__(link)
        self.tcp = TcpChannel(link)
        self.backend = backend
        self.pairs = [
            RailPair(rail, peer, generation=backend.generations[rail])
            for rail, peer in enumerate(fabric_peers)
        ]
        self.remote_rails = remote_rails
        self.remote_gpu = remote_gpu
        assert backend.eps
        self.virt_addr = bool(backend.eps[0].virt_addr)
        self.timeout_ms = backend.ctx.io_ms
        self._lock = threading.Lock()
        self._failures = 0
        self._down = 0  # rail pairs down (read without the lock as a hint)
        self._turn = 0
        self.fallback: str | None = None  # why this peer's transfers go over tcp now

    @property
    def fabric_peer(self) -> int:
        return self.pairs[0].fabric_peer

    def disconnect(self) -> None:
        """The link closed: forget the peer on every rail."""
        for pair in self.pairs:
            self.backend._disconnect(pair.rail, self._live_peer(pair))

    def _live_peer(self, pair: RailPair) -> int:
        """The pair's fabric peer, or -1 when a reset of this agent's endpoint ended it."""
        return pair.fabric_peer if pair.generation == self.backend.generations[pair.rail] else -1

    def peer_reset(self, index: int) -> None:
        """RDMA_RESET from the peer (on a reader thread): its endpoint on pair
        ``index`` has a new address; connect the pair again before its next post."""
        if not 0 <= index < len(self.pairs):
            raise ProtocolError(
                f"peer {self.link.peer!r} sent RDMA_RESET for rail pair {index}; it has {len(self.pairs)}"
            )
        with self._lock:
            self.pairs[index].stale = True

    def _refresh(self) -> None:
        """Connect again the pairs an endpoint reset (here or at the peer) ended."""
        generations = self.backend.generations
        with self._lock:
            due = [
                p
                for p in self.pairs
                if (p.stale or p.generation != generations[p.rail]) and p.down is None and not p.reviving
            ]
            for p in due:
                p.reviving = True
        for pair in due:
            try:
                self._reconnect(pair)
            except KvxError as exc:
                self._rail_down(pair, exc)

    def _reconnect(self, pair: RailPair) -> None:
        """One pair's connect exchange again (its ``reviving`` set by the caller)."""
        generation = self.backend.generations[pair.rail]
        try:
            fabric_peer = self.backend.reconnect(self._link, pair.rail, self._live_peer(pair))
        except KvxError:
            with self._lock:
                pair.reviving = False
            raise
        except Exception as exc:
            with self._lock:
                pair.reviving = False
            raise TransferError(f"connecting rdma rail {pair.rail} again failed: {exc}") from exc
        with self._lock:
            pair.fabric_peer, pair.generation, pair.stale, pair.reviving = (
                fabric_peer,
                generation,
                False,
                False,
            )

    def post(
        self,
        transfer: Transfer,
        op: Op,
        local_addrs: Any,
        local_lens: Any,
        total: int,
        remote: np.ndarray,
        notify: bytes | None,
        local_device: int = -1,
        remote_device: int = -1,
        remote_ipc: bool = False,
    ) -> None:
        if self._down and self.fallback is None:
            self._revive()
        if self.fallback is None:
            self._refresh()
        if (
            self.fallback is not None
            or (local_device >= 0 and not self.backend.registers_gpu)
            or (remote_device >= 0 and not self.remote_gpu)
        ):
            self.tcp.post(
                transfer, op, local_addrs, local_lens, total, remote, notify, local_device, remote_device
            )
            return
        link, peer = self._link, self._link.peer
        make_copy: Any = lambda *part: RdmaCopy(self, op, peer, *part)  # noqa: E731
        if total > INLINE_COPY_BYTES:  # posted in parts on the connections' threads
            link.post_pinned(
                transfer, op, local_addrs, local_lens, total, remote, notify, _wire.PIN_RDMA, make_copy
            )
        elif not link.copy_leased(transfer, op, local_addrs, local_lens, remote, notify, make_copy):
            # The first transfer on these regions: the target leases them (and their keys) to us.
            link.post_pinned(
                transfer,
                op,
                local_addrs,
                local_lens,
                total,
                remote,
                notify,
                _wire.PIN_RDMA,
                make_copy,
                keep=True,
                rails=self.remote_rails,
            )

    # Rails.

    def _up(self) -> list[RailPair]:
        with self._lock:
            return [p for p in self.pairs if p.down is None]

    def _revive(self) -> None:
        """Connect the down rails that are due again (all of them when none is up)."""
        now = time.monotonic()
        with self._lock:
            none_up = all(p.down is not None for p in self.pairs)
            due = [
                p
                for p in self.pairs
                if p.down is not None and not p.reviving and (none_up or now - p.since >= RAIL_RETRY_S)
            ]
            for p in due:
                p.reviving = True
        for pair in due:
            logger.info(
                "peer %s: connecting rdma rail %d again (it went down: %s)",
                self.link.peer,
                pair.rail,
                pair.down,
            )
            try:
                generation = self.backend.generations[pair.rail]
                fabric_peer = self.backend.reconnect(self._link, pair.rail, self._live_peer(pair))
            except Exception as exc:
                with self._lock:
                    pair.reviving, pair.since = False, time.monotonic()
                    pair.down = f"{pair.down}; connecting it again failed: {exc}"
                logger.warning("peer %s: rdma rail %d stays down: %s", self.link.peer, pair.rail, exc)
                continue
            with self._lock:
                pair.fabric_peer, pair.down, pair.reviving = fabric_peer, None, False
                pair.generation, pair.stale = generation, False
                self._down -= 1
        with self._lock:
            if not all(p.down is not None for p in self.pairs) or self.fallback is not None or not due:
                return
            reasons = "; ".join(f"rail {p.rail}: {p.down}" for p in self.pairs)
            self.fallback = f"every rdma rail failed ({reasons})"
        logger.warning("peer %s: %s; its transfers go over tcp from now on", self.link.peer, self.fallback)

    def _rail_down(self, pair: RailPair, error: KvxError) -> bool:
        """Mark the rail down; False where another transfer's failure already did."""
        with self._lock:
            if pair.down is not None:
                return False
            pair.down, pair.since = str(error), time.monotonic()
            self._down += 1
            left = [p.rail for p in self.pairs if p.down is None]
        ep = self.backend.eps[pair.rail]
        broke = " (its queue pair broke; it is connected again on next use)" if ep.provider == VERBS else ""
        logger.warning(
            "peer %s: rdma rail %d (%s on %s) is down%s: %s; %s",
            self.link.peer,
            pair.rail,
            ep.provider,
            ep.domain,
            broke,
            error,
            f"its slices move to rail(s) {', '.join(map(str, left))}" if left else "no rail is left up",
        )
        return True

    def _next(self, up: list[RailPair]) -> RailPair:
        self._turn += 1
        return up[self._turn % len(up)]

    def run(self, op: int, *arrays: np.ndarray) -> None:
        """Post one part's work requests on the rails and wait for them
        (RdmaCopy.move). ``arrays``: local addresses and lengths, remote
        addresses and lengths, and per remote piece its key on each of the
        peer's rails (shape: pieces × remote rails)."""
        try:
            self._run(op, *arrays)
        except KvxError as error:
            if isinstance(error, TimeoutError):
                # The peer hangs, and the bytes of a READ that timed out may still land: the
                # link ends (as a stalled tcp connection does) and the fabric peers are forgotten.
                self.link.fail(error)
            raise
        if self._failures:
            with self._lock:
                self._failures = 0

    def _run(
        self, op: int, la: np.ndarray, ll: np.ndarray, ra: np.ndarray, rl: np.ndarray, keys: Any
    ) -> None:
        up = self._up()
        if not up:
            raise TransferError(
                f"every rdma rail to peer {self.link.peer!r} is down: "
                + "; ".join(f"rail {p.rail}: {p.down}" for p in self.pairs)
            )
        total = int(np.sum(ll))
        jobs: list[tuple[np.ndarray, ...]]
        if len(up) > 1 and total >= 2 * rails.SLICE_MIN_BYTES:
            bounds = rails.slice_bounds(total, len(up))
            local = rails.cut(la, ll, bounds)
            remote = rails.cut(ra, rl, bounds, keys)
            jobs = [(*lo, *re) for lo, re in zip(local, remote, strict=True)]
            assign = up[: len(jobs)]
        else:
            jobs, assign = [(la, ll, ra, rl, keys)], [self._next(up)]
        last: KvxError | None = None
        broke = False  # whether this transfer took a rail down (not only met one going down)
        gave_up = threading.Event()  # set once the caller is to hear of a timeout: no retry after it
        for _ in range(len(self.pairs)):
            failed = []
            results, pending = self._run_all(op, jobs, assign, gave_up)
            timed_out = next((e for _, _, e in results if isinstance(e, TimeoutError)), None)
            if timed_out is not None:
                # Bytes of a post given up on may still land: stop them on every rail this round
                # used before the caller hears of it (and may reuse the memory), and wait for the
                # slices still posting, which the reset ends, so none outlives the error. The
                # peers connected to those endpoints are told to connect again.
                gave_up.set()
                for rail in sorted({pair.rail for pair in assign}):
                    self.backend.reset_rail(rail, f"an rdma post to peer {self.link.peer!r} timed out")
                concurrent.futures.wait(pending, timeout=self.timeout_ms / 1000)
                raise timed_out
            for job, pair, error in results:
                if error is None:
                    continue
                if isinstance(error, (ClosedError, ConfigError)):
                    raise error
                broke = self._rail_down(pair, error) or broke
                failed.append(job)
                last = error
            if not failed:
                return
            up = self._up()
            if not up:
                break
            jobs, assign = failed, [up[i % len(up)] for i in range(len(failed))]
        assert last is not None
        if broke and not isinstance(last, PeerLostError):
            self._failed(last)
        raise last

    def _run_all(
        self, op: int, jobs: list[tuple[np.ndarray, ...]], assign: list[RailPair], gave_up: threading.Event
    ) -> tuple[list[tuple[tuple[np.ndarray, ...], RailPair, KvxError | None]], list[Any]]:
        """Each job's result, and the futures of slices still posting (past the wait)."""
        pool = self.backend.pool
        futures = []
        if pool is not None and len(jobs) > 1:
            futures = [
                pool.submit(self._post, op, job, pair, gave_up)
                for job, pair in zip(jobs[1:], assign[1:], strict=True)
            ]
        results = [(jobs[0], assign[0], self._post(op, jobs[0], assign[0], gave_up))]
        wait_s = self.timeout_ms / 1000 + self.backend.ctx.timeouts.close_s
        pending = []
        for job, pair, future in zip(jobs[1:], assign[1:], futures, strict=True):
            try:
                results.append((job, pair, future.result(timeout=wait_s)))
            except concurrent.futures.TimeoutError:
                pending.append(future)
                results.append((job, pair, TimeoutError(f"an rdma post on rail {pair.rail} did not return")))
        if pool is None or len(jobs) == 1:
            results += [
                (job, pair, self._post(op, job, pair, gave_up))
                for job, pair in zip(jobs[1:], assign[1:], strict=True)
            ]
        return results, pending

    def _post(
        self, op: int, job: tuple[np.ndarray, ...], pair: RailPair, gave_up: threading.Event
    ) -> KvxError | None:
        la, ll, ra, rl, keys = job
        column = np.ascontiguousarray(keys[:, pair.rail % self.remote_rails], np.uint64)
        arrays = [np.ascontiguousarray(a, np.uint64) for a in (la, ll, ra, rl)]
        for attempt in range(2):
            try:
                self.backend.run_post(
                    pair.rail, pair.fabric_peer, op, *arrays, column, timeout_ms=self.timeout_ms
                )
            except Exception as exc:
                if attempt == 0 and _ended_by_reset(exc) and not gave_up.is_set():
                    # A reset of this endpoint (another thread's deregister or timeout) ended it:
                    # the pinned ranges are still held, READ and WRITE are idempotent; again once.
                    again = self._after_reset(pair)
                    if again is None:
                        continue
                    again.__cause__ = exc
                    return again
                error = post_error(exc, op, self.link.peer, self.timeout_ms)
                error.__cause__ = exc
                return error
            return None
        raise AssertionError("unreachable")

    def _after_reset(self, pair: RailPair) -> KvxError | None:
        """Connect ``pair`` again after a reset ended its post: None to retry, else why not."""
        with self._lock:
            if pair.reviving:
                busy = True
            else:
                busy, pair.reviving = False, True
        if busy or self.link.asking_would_block():
            # Another thread connects it, or this is the reader that would take the answer:
            # the next transfer's post connects it first.
            with self._lock:
                pair.stale = True
            return TransferError(
                f"rdma rail {pair.rail} to peer {self.link.peer!r} was reset during the post; "
                "it is connected again on next use"
            )
        try:
            self._reconnect(pair)
        except KvxError as exc:
            return exc
        return None

    def _failed(self, error: KvxError) -> None:
        with self._lock:
            self._failures += 1
            if self._failures < FAILURES_BEFORE_FALLBACK or self.fallback is not None or not self.alive:
                return
            self.fallback = f"{self._failures} rdma posts in a row failed, the last with: {error}"
        logger.warning("peer %s: %s; its transfers go over tcp from now on", self.link.peer, self.fallback)


def _ended_by_reset(exc: BaseException) -> bool:
    """A post failed because this agent's endpoint was reset under it (status
    RESET), or named a fabric peer that a reset ended."""
    return getattr(exc, "status", None) == "RESET" or (
        isinstance(exc, ConfigError) and "not connected" in str(exc)
    )
