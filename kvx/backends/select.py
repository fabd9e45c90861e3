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
from kvx.errors import ConfigError, ConnectError
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
    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = backends
        self._auto = sorted((b for b in backends.values() if b.auto), key=lambda b: -b.priority)

    def candidates(self, md: agent_pb2.AgentMetadata, setting: str) -> list[Backend]:
        if setting != "auto":
            if setting not in self.backends:
                raise ConfigError(
                    f"backend {setting!r} was registered after this agent started; "
                    "register backends before creating agents"
                )
            return [self.backends[setting]]
        return [b for b in self._auto if b.applies(md)]

    def streams(self, md: agent_pb2.AgentMetadata, setting: str, streams: int) -> int:
        """Connections to open to the peer: the most any candidate may want."""
        return max(b.streams(md, streams) for b in self.candidates(md, setting))

    def choose(self, md: agent_pb2.AgentMetadata, setting: str, link: Link, uses_gpu: bool) -> Choice:
        """A channel over ``link`` (authenticated, readers not started) from
        the first candidate that reaches the peer."""
        refused: list[tuple[str, str]] = []
        for backend in self.candidates(md, setting):
            why_not, reason = backend.reach(md)
            if why_not is None:
                try:
                    channel, more = backend.connect(md, link)
                except Unreachable as exc:
                    why_not = str(exc)
                else:
                    if not reason and setting != "auto":
                        reason = f"backend={setting} was configured"
                    choice = Choice(
                        backend.name, self._reason(backend, reason + more, refused, uses_gpu), channel
                    )
                    if refused and not reason and same_host(md):
                        logger.warning(
                            "peer %s is on this host, but %s cannot serve it; using %s: %s",
                            md.name,
                            refused[-1][0],
                            backend.name,
                            choice.reason,
                        )
                    return choice
            refused.append((backend.name, why_not))
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
