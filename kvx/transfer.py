"""Transfer handles and notifications."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

from kvx.errors import TimeoutError

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Op(enum.Enum):
    READ = "read"
    WRITE = "write"


# The members as module names, for the paths every transfer takes: on Python
# 3.11, reading a member through its class (``Op.READ``) goes through
# EnumType.__getattr__'s slow attribute lookup, about 90 ns each, and a small
# transfer read half a dozen of them.
PENDING, DONE, FAILED = TransferState.PENDING, TransferState.DONE, TransferState.FAILED
READ, WRITE = Op.READ, Op.WRITE


@dataclasses.dataclass(frozen=True)
class Notification:
    """A message a peer attached to a transfer, delivered after its data landed."""

    peer: str
    data: bytes


class Leader(Protocol):
    """What lets ``Transfer.wait`` read a transfer's answers on its own thread
    (the control connection, ``Connection.lead``): returns once the transfer
    finished, once it cannot go on, or at ``deadline`` (``time.monotonic()``)."""

    def lead(self, transfer: Transfer, deadline: float) -> None: ...


# The locks of every transfer born finished (Transfer.finished): wait() never
# takes them, add_done_callback only for the moment of its check.
_NEVER_HELD = threading.Lock()
_new = object.__new__
_monotonic = time.monotonic


class Transfer:
    """The handle of one READ or WRITE.

    ``wait(timeout_s)`` blocks until the transfer has finished and raises the
    error that failed it; ``await transfer`` does the same in asyncio. A
    transfer is finished only once no byte of it can still move: when one
    part fails, the others are waited for before the error is reported, so
    its local memory is free to reuse as soon as ``wait`` returns or raises.
    """

    __slots__ = (
        "op",
        "peer",
        "bytes",
        "posted_at",
        "completed_at",
        "_state",
        "_error",
        "_parts_left",
        "_lock",
        "_done",
        "_callbacks",
        "_default_timeout_s",
        "_on_parts_done",
        "_verify",
        "_cleanup",
        "_leader",
    )

    def __init__(self, op: Op, peer: str, nbytes: int, parts: int, default_timeout_s: float) -> None:
        self.op = op
        self.peer = peer
        self.bytes = nbytes
        self.posted_at = time.monotonic()
        self.completed_at: float | None = None
        self._state = PENDING
        self._error: BaseException | None = None
        self._parts_left = parts
        self._lock = threading.Lock()
        # Held until the transfer finishes; waiters acquire and release it.
        self._done = threading.Lock()
        self._done.acquire()
        self._callbacks: list[Callable[[Transfer], Any]] | None = None
        self._default_timeout_s = default_timeout_s
        # Posts one trailing part (a notification) once all data parts are done (expect_parts).
        self._on_parts_done: Callable[[Transfer], None] | None = None
        # verify=True: posts the trailing VERIFY part (which carries the
        # notification) once all data parts are done; set by the agent.
        self._verify: Callable[[Transfer], None] | None = None
        # Run when the transfer finishes, before waiters wake (releases pins); set by the agent.
        self._cleanup: Callable[[], None] | None = None
        # The connection whose answers ``wait`` may read on its own thread (offer_lead).
        self._leader: Leader | None = None

    @classmethod
    def finished(
        cls, op: Op, peer: str, nbytes: int, posted_at: float, error: BaseException | None
    ) -> Transfer:
        """A transfer already done (or failed with ``error``) when it is
        returned: the one the caller's thread copied at once. No parts, no
        cleanup; ``wait`` returns (or raises) at once."""
        t = _new(cls)
        t.op = op
        t.peer = peer
        t.bytes = nbytes
        t.posted_at = posted_at
        t.completed_at = _monotonic()
        t._state = DONE if error is None else FAILED
        t._error = error
        t._parts_left = 0
        t._lock = t._done = _NEVER_HELD  # the transfer is not pending: held only for a moment
        t._callbacks = t._on_parts_done = t._verify = t._cleanup = t._leader = None
        t._default_timeout_s = 0.0
        return t

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        return self._error

    def done(self) -> bool:
        return self._state is not PENDING

    @property
    def duration_s(self) -> float | None:
        return None if self.completed_at is None else self.completed_at - self.posted_at

    @property
    def throughput_gbps(self) -> float | None:
        d = self.duration_s
        return None if not d else self.bytes / d / 1e9

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until finished; raise its error. Timing out leaves it running.

        Where the backend allows it, the waiting thread reads the answers
        itself rather than sleeping until a kvx thread hands them over."""
        if self._state is PENDING:
            limit = self._default_timeout_s if timeout_s is None else timeout_s
            left = limit
            leader = self._leader
            if leader is not None:
                deadline = time.monotonic() + limit
                leader.lead(self, deadline)
                left = deadline - time.monotonic()
            if not self._done.acquire(timeout=max(left, 0)):
                raise TimeoutError(
                    f"{self.op.value} of {self.bytes} bytes from {self.peer!r} not finished after {limit}s"
                )
            self._done.release()
        if self._error is not None:
            raise self._error

    def runs_user_work(self) -> bool:
        """Done callbacks, or a verify check, are to run when it finishes."""
        return bool(self._callbacks) or self._verify is not None

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Call ``fn(transfer)`` once finished (at once if it already is), from a kvx
        thread, or from whichever thread found it finished or failed it (a
        posting thread, a thread in ``wait`` when a connection broke). It
        must not block."""
        with self._lock:
            if self._state is PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, None]:
        if self._state is PENDING:
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def settle() -> None:
                if not future.done():
                    future.set_result(None)

            def wake(_: Transfer) -> None:
                loop.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            yield from future.__await__()
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"<Transfer {self.op.value} {self.bytes} bytes peer={self.peer!r} {self._state.value}>"

    # The part interface, for backends: a transfer moves in parts (requests,
    # copies), each finished exactly once; ``expect_parts`` comes first.

    def expect_parts(self, parts: int, then: Callable[[Transfer], None] | None = None) -> None:
        """The transfer finishes after ``parts`` calls of ``part_finished``.
        ``then(transfer)``, when given, runs once they all succeeded and must
        post exactly one more part (the trailing notification)."""
        assert self._state is PENDING and parts > 0
        self._parts_left = parts
        self._on_parts_done = then

    def offer_lead(self, leader: Leader) -> None:
        """``wait`` may let ``leader`` read the answers on the waiting thread
        (the first part's connection, when several offer)."""
        if self._leader is None:
            self._leader = leader

    def fail_unposted(self, error: BaseException) -> bool:
        """Finish with ``error`` a transfer that never got to ``expect_parts``
        (posting it raised first); False when parts are under way, which
        finish it themselves."""
        with self._lock:
            if self._parts_left or self._on_parts_done is not None or self._state is not PENDING:
                return False
            self._error = error
        self._finish()
        return True

    def part_finished(self, error: BaseException | None = None) -> None:
        """One part is done (``error`` when it failed); no byte of it moves any more."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._parts_left -= 1
            if self._parts_left > 0:
                return
            hook, self._on_parts_done = self._on_parts_done or self._verify, None
            self._verify = None
            if hook is not None and self._error is None:
                self._parts_left = 1  # the hook's own part
            else:
                hook = None
        if hook is not None:
            hook(self)  # posts one more part, which calls part_finished once
            return
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._state is not PENDING:
                return
            self.completed_at = time.monotonic()
            self._state = FAILED if self._error is not None else DONE
            callbacks, self._callbacks = self._callbacks or (), None
            cleanup, self._cleanup = self._cleanup, None
            self._leader = None
        try:
            if cleanup is not None:
                cleanup()
        finally:
            self._done.release()  # even when the waiting thread running this is interrupted
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:  # a callback must not break the connection thread
                    logger.exception("transfer done-callback failed")
