"""``Refused``: a request the metadata service turns down, with the gRPC status
that says why. The gRPC API aborts the call with it; the admin REST API maps
the status to an HTTP one. It lives below both, so that the admin API never
imports the service module (the service starts the admin API, not the other way)."""

from __future__ import annotations

import grpc


class Refused(Exception):
    def __init__(
        self, code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.trailing_metadata = trailing_metadata
