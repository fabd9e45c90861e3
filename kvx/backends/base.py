"""The transport interface.

A backend listens for peers and opens channels to them; a channel posts the
parts of transfers. Validation of local memory, splitting and notifications
are the agent's business; a backend only moves bytes it was handed, and serves
its peers' requests against the agent's region table.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from kvx.transfer import Op, Transfer


class Channel(abc.ABC):
    """Connections to one peer over one backend."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the channel failed or was closed; posting then fails."""

    @abc.abstractmethod
    def post(self, transfer: Transfer, op: Op, local_addrs: Any, local_lens: Any, total: int,
             remote: np.ndarray, notify: bytes | None, local_device: int = -1, remote_device: int = -1,
             remote_ipc: bool = False) -> None:
        """Start moving ``total`` bytes between local (address, length) pairs
        (uint64 buffers) and ``remote`` descriptors; completion and errors
        arrive through ``transfer``. ``local_device`` and ``remote_device``
        are the CUDA devices of either side's memory, -1 for host memory;
        ``remote_ipc``: the remote CUDA regions can be opened through CUDA IPC."""

    @abc.abstractmethod
    def notify(self, transfer: Transfer, data: bytes) -> None:
        """Deliver a notification with no data."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close; transfers still in flight fail with ClosedError."""


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def endpoint(self) -> str:
        """The address peers reach this backend at."""

    @abc.abstractmethod
    def connect(self, target_name: str, target_epoch: int, address: str, streams: int) -> Channel:
        """Open a channel to a peer (handshake included); raises ConnectError."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving peers and close every channel."""
