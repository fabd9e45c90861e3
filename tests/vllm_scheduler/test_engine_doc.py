"""How decode's worker learns prefill's ranks from the metadata service
(``KvxWorker._engine_doc``): one GetAgents call for every rank, the service
asked again only for ranks a read replica shows at another epoch, and the
agent list of a request (it comes from the network) checked before any
lookup. Real metadata services on loopback; the worker's lookup half alone."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip(
    "vllm",
    reason="KvxWorker imports vLLM: run in the vLLM 0.33 environment (.venv-vllm-next, built by scripts/test.sh)",
)

from kvx.connectors.vllm import worker as worker_mod  # noqa: E402
from kvx.connectors.vllm.config import KvxConnectorConfig  # noqa: E402
from kvx.errors import PeerLostError, ProtocolError  # noqa: E402
from kvx.metadata.client import MAX_LOOKUPS_PER_CALL, MetadataClient  # noqa: E402
from kvx.metadata.service import MetadataServer, ThreadedServer  # noqa: E402
from kvx.v1 import metadata_pb2, metadata_pb2_grpc  # noqa: E402

TP = 4


def _register(address: str, epochs: dict[str, int]) -> None:
    import grpc

    channel = grpc.insecure_channel(address)
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)
    for rank, (name, epoch) in enumerate(epochs.items()):
        record = metadata_pb2.AgentRecord(
            name=name, epoch=epoch, role=metadata_pb2.ROLE_PREFILL, started_unix_ms=1000
        )
        record.metadata.name, record.metadata.epoch = name, epoch
        record.engine_info.update(
            engine_id="engine-p", tp_rank=str(rank), tp_size=str(TP), kvx_cache=json.dumps({"rank": rank})
        )
        stub.RegisterAgent(metadata_pb2.RegisterAgentRequest(record=record, ttl_s=30))
    channel.close()


def _worker(service: str, replica: str | None) -> worker_mod.KvxWorker:
    w = worker_mod.KvxWorker.__new__(worker_mod.KvxWorker)
    w.cfg = KvxConnectorConfig(metadata=service, metadata_read=replica)
    w._metadata_client = MetadataClient(service)
    w._metadata_reader = MetadataClient(replica, reader=True) if replica else w._metadata_client
    w._engines, w._engine_locks, w._engine_locks_lock = {}, {}, threading.Lock()
    w.agent = object()  # not reached: every connect here fails at its lookup
    return w


def _lookups(srv: ThreadedServer, method: str) -> float:
    registry = srv.server.metrics.registry
    return registry.get_sample_value("kvx_metadata_request_seconds_count", {"method": method}) or 0


def _params(names, epochs=None):
    return {"kvx": {"agents": names, "epochs": epochs or []}}


def test_prefill_ranks_come_in_one_lookup_and_a_stale_replica_is_overruled():
    names = [f"vllm-p-tp{r}" for r in range(TP)]
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0")) as primary,
        ThreadedServer(MetadataServer("127.0.0.1:0")) as replica,
    ):
        _register(primary.address, {name: 2 for name in names})
        # The replica has not copied rank 1's restart, nor rank 3 at all.
        _register(replica.address, {names[0]: 2, names[1]: 1, names[2]: 2})
        w = _worker(primary.address, replica.address)
        doc = w._engine_doc(_params(names, ["0x2"] * TP))
        assert doc["engine_id"] == "engine-p" and doc["tp_size"] == TP
        assert [(r["tp_rank"], r["agent_epoch"], r["cache"]) for r in doc["ranks"]] == [
            (rank, 2, {"rank": rank}) for rank in range(TP)
        ]
        # One call to the replica; the service asked for rank 3 (missing there), then
        # for rank 1 (another epoch there): no lookup one name at a time.
        assert (_lookups(replica, "GetAgents"), _lookups(primary, "GetAgents")) == (1, 2)
        assert _lookups(replica, "GetAgent") == _lookups(primary, "GetAgent") == 0

        with pytest.raises(PeerLostError, match="vllm-p-tp9"):
            w._engine_doc(_params([*names, "vllm-p-tp9"]))


@pytest.mark.parametrize(
    "agents",
    [
        [f"vllm-p-tp{r}" for r in range(MAX_LOOKUPS_PER_CALL + 1)],
        [],
        "vllm-p-tp0",
        ["vllm-p-tp0", {"name": "vllm-p-tp1"}],
        ["vllm-p-tp0", "../etc"],
        None,
    ],
)
def test_a_request_naming_too_many_agents_or_no_list_is_refused_before_any_lookup(agents):
    """kv_transfer_params come from decode's API callers: a list of thousands of names
    must not become thousands of lookups."""
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as primary:
        w = _worker(primary.address, None)
        with pytest.raises(ProtocolError, match="kvx.agents must list"):
            w._engine_doc(_params(agents))
        assert _lookups(primary, "GetAgents") == _lookups(primary, "GetAgent") == 0


def test_connects_to_made_up_engines_leave_nothing_behind():
    """remote_engine_id comes from decode's API callers: a connect's lock lives only while
    connects to that engine are under way, so made-up engine ids, each failing its lookup,
    grow nothing; connects to one engine at once still take turns."""
    with ThreadedServer(MetadataServer("127.0.0.1:0")) as primary:
        w = _worker(primary.address, None)
        for i in range(200):
            params = dict(_params([f"ghost-{i}-tp0"], ["0x1"]), remote_engine_id=f"ghost-{i}")
            with pytest.raises(PeerLostError):
                w._remote_engine(params)
        assert w._engine_locks == {} and w._engines == {}

        inside, most = 0, 0
        lookup = w._engine_doc

        def counted(params):
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            try:
                time.sleep(0.05)  # long enough for the others to arrive
                return lookup(params)
            finally:
                inside -= 1

        w._engine_doc = counted  # type: ignore[method-assign]
        params = dict(_params(["ghost-tp0"], ["0x1"]), remote_engine_id="ghost")
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(w._remote_engine, params) for _ in range(8)]
            for f in futures:
                with pytest.raises(PeerLostError):
                    f.result(30)
        assert most == 1 and w._engine_locks == {}
