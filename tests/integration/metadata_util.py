"""Records and stubs shared by the metadata service's integration tests."""

from __future__ import annotations

import grpc

from kvx.v1 import metadata_pb2, metadata_pb2_grpc


def agent_record(
    name: str,
    epoch: int = 7,
    *region_ids: int,
    role: int = metadata_pb2.ROLE_PREFILL,
    started: int = 1000,
    **labels: str,
) -> metadata_pb2.AgentRecord:
    """A valid AgentRecord for ``name``: its metadata names the same agent and
    epoch, with a 4 KiB region for each of ``region_ids``."""
    rec = metadata_pb2.AgentRecord(name=name, epoch=epoch, role=role, labels=labels, started_unix_ms=started)
    rec.metadata.name, rec.metadata.epoch = name, epoch
    for region_id in region_ids:
        rec.metadata.regions.add(id=region_id, size_bytes=4096)
    return rec


def stub(address: str) -> metadata_pb2_grpc.MetadataServiceStub:
    return metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(address))
