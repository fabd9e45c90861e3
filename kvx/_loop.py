"""The event loop a kvx service runs on: asyncio's own, or uvloop's.

The metadata service spends most of its CPU in grpc.aio's per-call work on
its one event loop; uvloop's loop (on libuv, in C) does the loop's share of
that work for less (docs/metadata.md, "The event loop"). It is optional: the
service runs on asyncio's loop unless asked (``--event-loop uvloop``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvx.errors import KvxError

LOOPS = ("asyncio", "uvloop")

T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes a new event loop of kind ``name`` (None: asyncio's default, as
    ``asyncio.run`` makes it); a clear error when that kind is unknown or not
    installed."""
    if name == "asyncio":
        return None
    if name == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            raise KvxError("--event-loop uvloop needs the uvloop package: pip install 'kvx[uvloop]'") from exc
        return uvloop.new_event_loop
    raise KvxError(f"--event-loop must be one of {', '.join(LOOPS)}, not {name!r}")


def run(factory: Callable[[], asyncio.AbstractEventLoop] | None, main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop that ``factory`` makes (None: asyncio's)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
