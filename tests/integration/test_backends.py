"""The transport seam: the selector, registration, and what a failed
connect leaves behind."""

from __future__ import annotations

import numpy as np
import pytest

import kvx
import kvx.backends
from kvx.memory import MAX_REGION_ID
from kvx.v1 import agent_pb2
from tests.conftest import kvx_threads, open_fds, wait_until


def _tampered(metadata: bytes, edit) -> bytes:
    md = agent_pb2.AgentMetadata.FromString(metadata)
    edit(md)
    return md.SerializeToString()


def test_auto_never_picks_a_backend_that_is_configured_only(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent("auto-only")
    assert "procmem" in agent._backends  # loaded (tests/conftest.py registers it) ...
    assert agent.add_peer(worker.metadata).backend == "shm"  # ... but not chosen
    forced = make_agent("forced").add_peer(worker.metadata, backend="procmem")
    assert forced.backend == "procmem" and f"/proc/{worker.pid}/mem" in forced.backend_reason


def test_a_forced_backend_that_cannot_reach_says_why(make_worker, make_agent):
    worker = make_worker(backend="tcp")  # serves no pins
    with pytest.raises(kvx.ConnectError, match="backend=procmem was configured.*serves no pins"):
        make_agent().add_peer(worker.metadata, backend="procmem")


def test_a_backend_registered_after_the_agent_started_is_refused_clearly(make_worker, make_agent):
    worker = make_worker()
    agent = make_agent("early")
    kvx.backends.register("procmem_late", "tests.backends.procmem:ProcMemBackend")
    try:
        with pytest.raises(kvx.ConfigError, match="registered after this agent started"):
            agent.add_peer(worker.metadata, backend="procmem_late")
        late = make_agent("late").add_peer(worker.metadata, backend="procmem_late")
        assert late.backend == "procmem"  # the class's name
    finally:
        kvx.backends._REGISTRY.pop("procmem_late")


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_peer_refused_after_the_handshake_leaves_no_connection(make_worker, make_agent, backend):
    """Metadata the handshake accepts but the peer table refuses (a region id
    out of range): add_peer fails, and the dialled connections are closed."""
    worker = make_worker()
    agent = make_agent("careful", backend=backend)
    agent.register(np.zeros(4096, np.uint8))
    agent.add_peer(worker.metadata).close()  # warm up: lazily created threads and fds
    wait_until(lambda: not [t for t in kvx_threads() if t.startswith("kvx-read-")])
    fds, threads = open_fds(), kvx_threads()
    bad = _tampered(
        worker.metadata, lambda md: md.regions.add(id=MAX_REGION_ID, size_bytes=4096, remote_read=True)
    )
    with pytest.raises(kvx.ProtocolError, match="region id"):
        agent.add_peer(bad)
    assert agent.peers == []
    assert wait_until(lambda: open_fds() <= fds and kvx_threads() == threads), (
        open_fds(),
        fds,
        kvx_threads(),
    )
