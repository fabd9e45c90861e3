"""The selector: which backend serves a peer, chosen in one place, with the reason.

Under ``backend="auto"`` the candidates are every registered backend that
takes part in automatic choice and applies to the peer, highest priority
first (cuda_ipc, shm, tcp); the first that can reach the peer and connect
wins. A backend named in the setting is the only candidate: if it cannot
reach the peer, connecting fails with a ConnectError that says why.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from kvx.backends.base import Backend, Channel, Unreachable, same_host
from kvx.errors import ConfigError, ConnectError, KvxError
from kvx.v1 import agent_pb2

if TYPE_CHECKING:
    from kvx.backends.control.link import Link

logger = logging.getLogger(__name__)

_STAGED = "; CUDA memory is staged through pinned host buffers"


@dataclasses.dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    channel: Channel


class Selector:
    """Picks among the backends an agent loaded, keyed by their registered names."""

    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = backends
        self._auto = sorted(((n, b) for n, b in backends.items() if b.auto), key=lambda nb: -nb[1].priority)

    def candidates(self, md: agent_pb2.AgentMetadata, setting: str) -> list[tuple[str, Backend]]:
        if setting != "auto":
            if setting not in self.backends:
                raise ConfigError(
                    f"backend {setting!r} is not loaded in this agent: it was registered after the agent "
                    "started, or failed to load (see the log)"
                )
            return [(setting, self.backends[setting])]
        return [(n, b) for n, b in self._auto if b.applies(md)]

    def streams(self, md: agent_pb2.AgentMetadata, setting: str, streams: int) -> int:
        """Connections to open to the peer: the most any candidate may want."""
        return max(b.streams(md, streams) for _, b in self.candidates(md, setting))

    def choose(self, md: agent_pb2.AgentMetadata, setting: str, link: Link, uses_gpu: bool) -> Choice:
        """A channel over ``link`` (authenticated, readers not started) from
        the first candidate that reaches the peer."""
        refused: list[tuple[str, str]] = []
        for name, backend in self.candidates(md, setting):
            try:
                why_not, reason = backend.reach(md)
                if why_not is None:
                    channel, more = backend.connect(md, link)
            except Unreachable as exc:
                why_not = str(exc)
            except KvxError:
                raise
            except Exception as exc:  # a backend's bug or an OS error: a clear error, not a traceback
                raise ConnectError(f"backend {name} failed to connect to peer {md.name!r}: {exc!r}") from exc
            if why_not is None:
                if not reason and setting != "auto":
                    reason = f"backend={setting} was configured"
                choice = Choice(name, self._reason(backend, reason + more, refused, uses_gpu), channel)
                if refused and not reason and same_host(md):
                    logger.warning(
                        "peer %s is on this host, but %s cannot serve it; using %s: %s",
                        md.name,
                        refused[-1][0],
                        name,
                        choice.reason,
                    )
                return choice
            refused.append((name, why_not))
        if setting != "auto":
            raise ConnectError(
                f"backend={setting} was configured, but it cannot reach peer {md.name!r}: {refused[-1][1]}"
            )
        raise ConnectError(
            f"no backend can reach peer {md.name!r}: " + "; ".join(f"{name}: {why}" for name, why in refused)
        )

    @staticmethod
    def _reason(backend: Backend, reason: str, refused: list[tuple[str, str]], uses_gpu: bool) -> str:
        if not reason and refused:
            # The fallback: why the one before it could not serve says it best.
            reason, refused = refused[-1][1], refused[:-1]
        reason += "".join(f"; not {name}: {why}" for name, why in refused)
        return reason + (_STAGED if backend.stages_gpu and uses_gpu else "")
