"""`kvx metadata` killed with SIGKILL and started again on the same port."""

import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import kvx
from kvx.metadata.client import MetadataClient
from tests.conftest import native_pass_only, wait_until

pytestmark = [pytest.mark.slow, native_pass_only]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(address, store, event_loop, log):
    with log.open("w") as err:  # the child writes it; this copy closes
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvx.cli",
                "metadata",
                "--listen",
                address,
                "--admin-listen",
                "off",
                "--store",
                store,
                "--event-loop",
                event_loop,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        assert wait_until(
            lambda: (
                proc.poll() is not None
                or MetadataClient(address, kvx.MetadataOptions(timeout_s=1)).list() is not None
            ),
            30,
            (kvx.ConnectError,),
        ), "kvx metadata did not start"
        assert proc.poll() is None, f"kvx metadata exited with {proc.returncode}"
        # It says which loop runs it, and uvloop's extension is loaded only when asked for.
        assert wait_until(lambda: f"event loop: {event_loop})" in log.read_text(), 10), log.read_text()
        with open(f"/proc/{proc.pid}/maps") as f:
            assert ("/uvloop/loop." in f.read()) == (event_loop == "uvloop")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc


# uvloop: the same service on uvloop's event loop (`--event-loop uvloop`): its registrations,
# renewals, lookups and watches, and etcd's client, run there too.
@pytest.mark.parametrize(
    ("store", "event_loop"),
    [("memory", "asyncio"), ("etcd", "asyncio"), ("memory", "uvloop"), ("etcd", "uvloop")],
)
def test_killed_service_comes_back_with_every_agent(store, event_loop, request, tmp_path):
    url = "memory"
    if store == "etcd":
        url = request.getfixturevalue("etcd_server").url
    address = f"127.0.0.1:{_free_port()}"
    proc = _start(address, url, event_loop, tmp_path / "metadata.log")
    opts = kvx.MetadataOptions(lease_ttl_s=3)
    agents = []
    try:
        for i in range(4):
            agents.append(
                kvx.Agent(
                    f"agent-{i}",
                    metadata=address,
                    role="prefill" if i % 2 else "decode",
                    metadata_options=opts,
                )
            )
        for agent in agents:
            agent.register(np.zeros(4096, np.uint8))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = _start(address, url, event_loop, tmp_path / "metadata.log")
        client = MetadataClient(address)
        if store == "etcd":  # nothing was lost: served at once from etcd
            assert sorted(r.name for r in client.list()) == [f"agent-{i}" for i in range(4)]
        start = time.monotonic()
        assert wait_until(lambda: len(client.list()) == 4, 10, (kvx.ConnectError,))
        assert time.monotonic() - start < 6
        assert all(len(r.metadata.regions) == 1 for r in client.list())
        time.sleep(4)  # past the TTL: the leases are being renewed on the new process
        assert len(client.list()) == 4
        peer = agents[0].connect("agent-1")
        assert peer.epoch == agents[1].epoch
    finally:
        for agent in agents:
            agent.close()
        proc.kill()
        proc.wait(10)
