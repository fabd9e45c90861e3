"""``kvx demo``: a metadata service, a prefill and a decode agent (two processes), one real transfer."""

from __future__ import annotations

import os
import secrets
import sys
import time

import numpy as np

from kvx._datapath import io as _io
from kvx._worker import Worker, WorkerConfig, pattern
from kvx.agent import Agent
from kvx.config import MiB
from kvx.layout import KVLayout
from kvx.metadata.service import MetadataServer, ThreadedServer
from kvx.v1.metadata_pb2 import Role


def _fmt_bytes(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def run(layers: int, num_blocks: int, block_size: int, request_blocks: int, out=sys.stdout) -> int:
    secret = secrets.token_bytes(32)
    layout_kwargs = dict(num_layers=layers, num_blocks=num_blocks, block_size_bytes=block_size)
    pool_bytes = layers * 2 * num_blocks * block_size
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    say(
        f"kvx demo: KV pool of {layers} layers x K/V x {num_blocks} blocks x {_fmt_bytes(block_size)} "
        f"= {_fmt_bytes(pool_bytes)} on each side"
    )
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0")) as service,
        Worker(
            WorkerConfig(
                "prefill-0", pool_bytes, seed=42, auth_secret=secret, metadata=service.address, role="prefill"
            )
        ) as prefill,
        Agent("decode-0", auth_secret=secret, metadata=service.address, role="decode") as decode,
    ):
        pool = np.empty(pool_bytes, np.uint8)
        # Touch every page now, as an engine's KV cache is; np.zeros would fault them in mid-transfer.
        pool.fill(0)
        region = decode.register(pool)
        agents = service.call(service.server.store.list())
        say(
            f"  metadata service on {service.address} (in-process, memory store): "
            f"{', '.join(f'{a.name} ({Role.Name(a.role)[5:].lower()})' for a in agents)} registered"
        )
        peer = decode.connect("prefill-0")
        say(
            f"  prefill agent pid {prefill.pid}, decode agent pid {os.getpid()}: decode found prefill-0 "
            f"by name, connected over {peer.backend} ({_io.IMPL} data path), HMAC-authenticated"
        )

        rng = np.random.default_rng(7)
        src_blocks = np.sort(rng.choice(num_blocks, request_blocks, replace=False))
        dst_blocks = np.sort(rng.choice(num_blocks, request_blocks, replace=False))
        remote_layout = KVLayout(regions=(peer.regions[0].id,), **layout_kwargs)
        local_layout = KVLayout(regions=(region.id,), **layout_kwargs)
        local, remote = local_layout.descs(dst_blocks), remote_layout.descs(src_blocks)
        say(
            f"  pull: decode READs {request_blocks} blocks = {len(remote)} descriptors "
            f"({len(remote.coalesce())} after coalescing), {_fmt_bytes(remote.total_bytes)}"
        )

        transfer = peer.read(local, remote, notify=b"request demo-1: KV received")
        transfer.wait(30)
        duration_s = transfer.duration_s
        assert duration_s is not None  # wait() returned, so it is done
        say(
            f"  moved {_fmt_bytes(transfer.bytes)} in {duration_s * 1e3:.1f} ms = "
            f"{transfer.throughput_gbps:.2f} GB/s"
        )
        notes = prefill.call("notifications", 10.0)
        say(
            f"  prefill got notification {notes[0][1]!r} from {notes[0][0]!r}"
            if notes
            else "  prefill got NO notification"
        )

        expected = pattern(42, pool_bytes)
        ok = bool(notes)
        for lo, ro in zip(local.offset.tolist(), remote.offset.tolist(), strict=True):
            if not np.array_equal(pool[lo : lo + block_size], expected[ro : ro + block_size]):
                say(f"  MISMATCH at local offset {lo}")
                ok = False
                break
        untouched = np.ones(pool_bytes, bool)
        for lo in local.offset.tolist():
            untouched[lo : lo + block_size] = False
        if pool[untouched].any():
            say("  bytes outside the requested blocks changed")
            ok = False

        # Push: decode WRITEs a few blocks back and prefill's memory changes.
        pool[:] = 0xAB
        push = remote_layout.descs(src_blocks[:4], layers=[0])
        start = time.perf_counter()
        peer.write(local_layout.descs(dst_blocks[:4], layers=[0]), push).wait(30)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        first = push.offset.tolist()[0]
        pushed_ok = prefill.call("peek", first, block_size) == b"\xab" * block_size
        say(
            f"  push: decode WRITEs {len(push)} blocks into prefill in {elapsed_ms:.1f} ms: "
            f"{'landed' if pushed_ok else 'MISSING'}"
        )
        ok = ok and pushed_ok
        if ok:
            say(f"verified: all {transfer.bytes} bytes match prefill's blocks, nothing else changed")
            return 0
        say("FAILED: see above")
        return 1
