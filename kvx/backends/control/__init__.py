"""The control connection every backend builds on.

One authenticated TCP connection (or several: streams) per peer pair, with
a small versioned binary wire format (``wire``). On it: the handshake (names,
epochs, HMAC challenge with the cluster secret, the target's limits),
notifications, pins (the target checks and pins regions for backends whose
initiator moves the bytes itself), the set-up requests a backend makes
before a link starts (``Link.request``: shm gets its single-use segment
tokens that way; a backend's own types are ``wire.BACKEND_TYPES``), and, for the tcp
backend, the bytes themselves.

- ``link``: the initiator's side (``Links`` per agent, a ``Link`` per peer).
- ``serve``: the target's side (``Listener``, ``InboundConnection``, and
  the ``Handler`` type backends use to serve their own message types).
"""

from kvx.backends.control.link import Link, Links, Part
from kvx.backends.control.serve import Fatal, Handler, InboundConnection, Listener

__all__ = ["Fatal", "Handler", "InboundConnection", "Link", "Links", "Listener", "Part"]
