"""The ``kvx`` command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from kvx import backends
from kvx._loop import LOOPS
from kvx.config import parse_size
from kvx.errors import ConfigError, KvxError

# Every kvx command's log records (benchmarks/soak.py reads each record's level in it).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except KvxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _seconds_or_zero(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else _seconds(text)


def _add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """``kvx agents``, ``kvx status`` and ``kvx drain`` (kvx/_status.py)."""
    agents = sub.add_parser(
        "agents",
        help="list the agents registered in the metadata service",
        description="A table of the agents registered in the metadata service: name, role, "
        "epoch, endpoints, engine, API URL, whether draining, and how long ago each registered.",
    )
    agents.add_argument("--metadata", required=True, metavar="HOST:PORT", help="the kvx metadata service")
    agents.add_argument(
        "--metadata-token-file", metavar="FILE", help="file holding the bearer token of the metadata service"
    )
    agents.add_argument("--role", choices=["prefill", "decode", "other"], help="only agents of this role")
    agents.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    status = sub.add_parser(
        "status",
        help="the health of every prefill and decode daemon in the cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Finds the daemons (kvx prefill, kvx decode) in the metadata service (records\n"
        "whose engine_info has admin_url) and asks each, all at once, for GET /v1/status and\n"
        "twice for GET /metrics (--interval-s apart, for the transfer rate). A daemon that\n"
        "does not answer by --timeout-s is shown unreachable with the error. Only http://\n"
        "and https:// admin URLs are followed; answers over 4 MiB are cut off.",
        epilog="exit status: 0 when there is at least one daemon and every one is ready, 1 otherwise\n"
        "(a daemon starting, not ready, draining, drained, stopped, unreachable or with a\n"
        "refused URL; no daemon at all; the metadata service unreachable).",
    )
    status.add_argument("--metadata", required=True, metavar="HOST:PORT", help="the kvx metadata service")
    status.add_argument(
        "--metadata-token-file", metavar="FILE", help="file holding the bearer token of the metadata service"
    )
    status.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="file holding a bearer token to send with every GET to the daemons; only when the "
        "daemons require one: it goes to every admin_url found in the metadata service",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    status.add_argument(
        "--timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=5.0,
        help="how long to wait for the daemons' answers, all together (default: 5)",
    )
    status.add_argument(
        "--interval-s",
        type=_seconds_or_zero,
        metavar="SECONDS",
        default=1.0,
        help="time between the two /metrics samples the transfer rate is measured over; 0: "
        "no second sample, the rate is the average since the daemon started (default: 1)",
    )

    drain = sub.add_parser(
        "drain",
        help="drain one daemon (POST /v1/drain), optionally waiting until it is drained",
        description="Asks the daemon at --admin to drain: it stops taking new requests, finishes "
        "those in flight, and withdraws from the cluster. With --wait, polls GET /v1/status until "
        "its state is drained or stopped, or it has exited. The helm chart's preStop hook runs this.",
        epilog="exit status: 0 when the daemon accepted (and with --wait, finished) the drain; 1 when "
        "it refused the token, could not be reached, or was still draining after --timeout-s.",
    )
    drain.add_argument(
        "--admin", required=True, metavar="URL", help="the daemon's admin API, e.g. http://127.0.0.1:9100"
    )
    drain.add_argument(
        "--token-file", required=True, metavar="FILE", help="file holding the daemon's admin token"
    )
    drain.add_argument("--wait", action="store_true", help="wait until the daemon is drained")
    drain.add_argument(
        "--timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=60.0,
        help="longest the whole command takes, waiting included (default: 60)",
    )


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from kvx.daemon.shapes import PRESETS

    demo = sub.add_parser(
        "demo",
        help="run a local cluster, send requests through it and verify every KV block",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Starts a local cluster, each part a child process on free loopback ports: a\n"
        "metadata service, a prefill and a decode daemon (synthetic engine) and kvx proxy,\n"
        "which finds them in the metadata service. Sends --requests completions of varied\n"
        "lengths through the proxy, streamed, and reports the KV bytes decode moved, the\n"
        "transfer rate and TTFT (time to the first streamed token through the proxy). Every\n"
        "answer is compared with the single-engine answer, and decode's count of verified\n"
        "blocks with the blocks it moved. Every child is stopped at the end, on failure\n"
        "and on Ctrl-C.\n\n"
        "--agents runs the agent-level demo instead: a metadata service (in-process), a\n"
        "prefill agent (child process) and a decode agent (this process); decode finds\n"
        "prefill by name, READs a request's blocks with a notification, WRITEs a few back,\n"
        "and verifies every byte.",
        epilog="exit status: 0 when every request was answered right and every block verified;\n"
        "1 on a failure (the message says which process and shows the end of its log);\n"
        "130 on Ctrl-C, 143 on SIGTERM.",
    )
    demo.add_argument("--requests", type=_positive, default=64, help="completions to send (default: 64)")
    demo.add_argument(
        "--concurrency", type=_positive, default=4, help="requests in flight at once, 1..64 (default: 4)"
    )
    demo.add_argument(
        "--model-shape",
        choices=list(PRESETS),
        default="tiny",
        help="the synthetic engine's KV shape (default: tiny)",
    )
    demo.add_argument(
        "--max-tokens", type=_positive, default=16, help="tokens per answer, 1..4096 (default: 16)"
    )
    agents = demo.add_argument_group("with --agents")
    agents.add_argument("--agents", action="store_true", help="the agent-level demo instead of the cluster")
    agents.add_argument("--layers", type=_positive, help="KV layers (default: 8)")
    agents.add_argument("--num-blocks", type=_positive, help="blocks per layer and pool (default: 256)")
    agents.add_argument("--block-size", type=_size, help="bytes per block (default: 16KiB)")
    agents.add_argument("--blocks", type=_positive, help="blocks in the request (default: 100)")


def _run_demo(args: argparse.Namespace) -> int:
    from kvx import _demo

    agent_options = ("layers", "num_blocks", "block_size", "blocks")
    if not args.agents:
        given = [f"--{k.replace('_', '-')}" for k in agent_options if getattr(args, k) is not None]
        if given:
            print(f"kvx demo: {', '.join(given)} go with --agents", file=sys.stderr)
            return 2
        if args.concurrency > _demo.MAX_CONCURRENCY or args.max_tokens > 4096:
            print(
                f"kvx demo: --concurrency is 1..{_demo.MAX_CONCURRENCY}, --max-tokens 1..4096",
                file=sys.stderr,
            )
            return 2
        if args.requests > _demo.MAX_REQUESTS:
            print(f"kvx demo: --requests is 1..{_demo.MAX_REQUESTS}", file=sys.stderr)
            return 2
        return _demo.run(args.requests, args.concurrency, args.model_shape, args.max_tokens)
    layers = args.layers or 8
    num_blocks = args.num_blocks or 256
    block_size = args.block_size or _size("16KiB")
    blocks = args.blocks or 100
    if blocks > num_blocks:
        print("kvx demo: --blocks must not exceed --num-blocks", file=sys.stderr)
        return 2
    return _demo.run_agents(layers, num_blocks, block_size, blocks)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    """``kvx doctor`` (kvx/_doctor.py)."""
    doctor = sub.add_parser(
        "doctor",
        help="check this host for kvx: RDMA NICs, GPU-NIC affinity, GPUDirect, memlock, CUDA, shm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="What to run first when transfers are slow or fail. Checks, each line OK, WARN\n"
        "or FAIL with the fix (docs/doctor.md): RDMA devices and ports (state, link layer,\n"
        "rate, the GID kvx would use), which NIC each GPU would use, how GPU memory would\n"
        "be registered with a NIC (dma-buf or nvidia_peermem), the memlock limit, libfabric,\n"
        "CUDA, shm (ptrace_scope, process_vm_readv) and, with --metadata, the metadata\n"
        "service. Every probe is bounded in time.",
        epilog="environment: KVX_RDMA_DEVICES and KVX_RDMA_GID_INDEX are checked as kvx would use them.\n"
        "exit status: 0 when no line FAILs (WARNs allowed), 1 when one does, 2 on bad arguments.",
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    doctor.add_argument(
        "--metadata", metavar="HOST:PORT", help="also check that this kvx metadata service answers"
    )
    doctor.add_argument(
        "--metadata-token-file", metavar="FILE", help="file holding the bearer token of the metadata service"
    )
    doctor.add_argument(
        "--metadata-admin",
        metavar="URL",
        help="with --metadata: the service's admin API (e.g. http://HOST:8081), to compare its kvx version",
    )
    doctor.add_argument(
        "--timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=5.0,
        help="longest wait for each network probe (default: 5)",
    )
    # Reads sysfs and procfs under this directory instead of / (tests); also KVX_SYSFS_ROOT.
    doctor.add_argument("--sysfs-root", metavar="DIR", help=argparse.SUPPRESS)


def _run_doctor(args: argparse.Namespace) -> int:
    import json
    import os

    from kvx import _doctor

    if args.metadata_admin and not args.metadata:
        print("kvx doctor: --metadata-admin goes with --metadata", file=sys.stderr)
        return 2
    try:
        root = _doctor.sysfs_root(args.sysfs_root, os.environ)
    except ConfigError as exc:
        print(f"kvx doctor: {exc}", file=sys.stderr)
        return 2
    report = _doctor.collect(
        root,
        metadata=args.metadata,
        metadata_token=_read_token(args.metadata_token_file),
        metadata_admin=args.metadata_admin,
        timeout_s=args.timeout_s,
    )
    print(json.dumps(report, indent=2) if args.json else _doctor.render(report))
    return 0 if report["ok"] else 1


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite: {text!r}")
    return value


def _compact_period(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value != 0 and not 1 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or 1..86400: {text!r}")
    return value


def _positive_number(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _sweep_sizes(text: str) -> tuple[int, ...]:
    """--sizes of kvx bench --sweep: at most 64, each 4KiB..1GiB, and a
    whole number of 16 KiB blocks above 16 KiB (the sweep's block size)."""
    sizes = tuple(parse_size(part.strip()) for part in text.split(",") if part.strip())
    if not 1 <= len(sizes) <= 64:
        raise ConfigError(f"--sizes takes 1..64 sizes, not {len(sizes)}")
    for n in sizes:
        if not 4096 <= n <= 1 << 30 or (n > 16384 and n % 16384):
            raise ConfigError(f"--sizes: {n} bytes is not 4KiB..1GiB and a multiple of 16KiB above 16KiB")
    return sizes


def _add_plan(sub: argparse._SubParsersAction) -> None:
    """``kvx plan [model|simulate]`` (kvx/plan/): ``model``, the analytical
    model, is the default; ``simulate`` the discrete-event simulator."""
    top = sub.add_parser(
        "plan",
        help="size a P/D cluster: the model (KV bytes, transfer time, TTFT, NICs needed) or a simulation",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Size a prefill/decode cluster. `kvx plan model` (the default: `kvx plan --model ...`)\n"
        "is the analytical model (docs/plan.md); `kvx plan simulate` the discrete-event\n"
        "simulator (docs/plan-simulate.md). `kvx plan model --help` and\n"
        "`kvx plan simulate --help` list their flags.",
    )
    actions = top.add_subparsers(dest="action", metavar="{model,simulate}")
    actions.required = True
    plan = actions.add_parser(
        "model",
        help="the analytical model (the default)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The analytical model of KV transfer in a prefill/decode cluster (docs/plan.md):\n"
        "KV bytes per request and rank, transfer time p50/p99 with the NICs' queueing at\n"
        "--rate, TTFT p50/p99 (prefill queue + compute + transfer + overhead), the NICs'\n"
        "utilisation, the NICs needed to keep transfer under --target-share of TTFT, and\n"
        "whether layer-by-layer transfer hides behind prefill. Link figures are nominal\n"
        "defaults unless --curve gives a measured one.",
        epilog="examples:\n"
        "  kvx plan --model llama-3.1-70b --prompt-tokens 8192 --rate 4 --prefill-instances 4 \\\n"
        "      --prefill-tp 8 --decode-tp 8 --link 8x400\n"
        "  kvx bench --sweep --json > tcp.json; kvx plan --model config.json --curve tcp.json --link tcp\n"
        "exit status: 0; 2 on bad input (the message says which).",
    )
    from kvx.plan.simulate import add_simulate_parser

    add_simulate_parser(actions)
    plan.add_argument(
        "--model",
        required=True,
        metavar="PRESET|CONFIG.json",
        help="a preset name or a Hugging Face config.json",
    )
    plan.add_argument("--kv-dtype", help="the KV cache's dtype when it differs from the config's (e.g. fp8)")
    plan.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default: 16)")
    for side in ("prefill", "decode"):
        plan.add_argument(
            f"--{side}-tp", type=_positive, default=1, help=f"{side} tensor parallelism (default: 1)"
        )
        plan.add_argument(
            f"--{side}-pp", type=_positive, default=1, help=f"{side} pipeline stages (default: 1)"
        )
    prompt = plan.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-tokens", type=_positive, metavar="N", help="every prompt is N tokens")
    prompt.add_argument(
        "--prompt-hist",
        metavar="FILE",
        help="prompt lengths: JSON [[tokens, weight], ...] or CSV tokens,weight",
    )
    plan.add_argument(
        "--rate", type=_positive_number, default=1.0, help="requests/s, whole cluster (default: 1)"
    )
    plan.add_argument("--prefill-instances", type=_positive, default=1, help="prefill instances (default: 1)")
    plan.add_argument(
        "--prefill-tokens-per-s",
        type=_positive_number,
        default=None,
        metavar="N",
        help="prompt tokens one prefill instance computes per second (default: 20000, a placeholder: "
        "measure yours)",
    )
    plan.add_argument(
        "--overhead-s",
        type=_number,
        default=None,
        metavar="SECONDS",
        help="fixed cost per request (default: 0.002)",
    )
    plan.add_argument(
        "--link",
        default="rdma",
        help="nvlink3|nvlink4|nvlink5|pcie4|pcie5, rdma[:GBITS], tcp[:GBITS] or NxGBITS "
        "(N RDMA NICs; default: rdma, 400 Gb/s)",
    )
    plan.add_argument(
        "--nics",
        type=_positive,
        help="NICs (or GPU links) per prefill instance; default: N of NxGBITS, the prefill ranks for "
        "nvlink and pcie, else 1",
    )
    plan.add_argument(
        "--curve", metavar="SWEEP.json", help="a measured curve: `kvx bench --sweep --json` output"
    )
    plan.add_argument(
        "--target-share",
        type=_number,
        default=0.1,
        help="the transfer's largest share of TTFT (default: 0.1)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plan.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (needs kvx[bench])")


def _run_plan(args: argparse.Namespace) -> int:
    from kvx.plan import files, links, model, render, shapes

    try:
        shape = shapes.load_shape(args.model, args.kv_dtype)
        link, spec_nics = links.parse_link(args.link)
        prompt = files.read_histogram(args.prompt_hist) if args.prompt_hist else ((args.prompt_tokens, 1.0),)
        curve = files.read_curve(args.curve) if args.curve else link.curve()
        if args.nics is not None and spec_nics is not None and args.nics != spec_nics:
            raise ConfigError(f"--link {args.link} names {spec_nics} NICs and --nics {args.nics}; give one")
        nics = (
            args.nics
            or spec_nics
            or (args.prefill_tp * args.prefill_pp if link.kind in ("nvlink", "pcie") else 1)
        )
        cluster = model.Cluster(
            shape,
            prompt,
            args.rate,
            curve,
            prefill_instances=args.prefill_instances,
            prefill_tokens_per_s=(
                model.DEFAULT_PREFILL_TOKENS_PER_S
                if args.prefill_tokens_per_s is None
                else args.prefill_tokens_per_s
            ),
            overhead_s=model.DEFAULT_OVERHEAD_S if args.overhead_s is None else args.overhead_s,
            nics=nics,
            block_tokens=args.block_size,
            prefill_tp=args.prefill_tp,
            prefill_pp=args.prefill_pp,
            decode_tp=args.decode_tp,
            decode_pp=args.decode_pp,
            target_share=args.target_share,
        )
        plan = model.evaluate(cluster)
        print(
            render.to_json(cluster, plan, link.name) if args.json else render.table(cluster, plan, link.name)
        )
        if args.plot:
            for path in render.plot(cluster, args.plot, link.name):
                print(f"wrote {path}", file=sys.stderr)
    except ConfigError as exc:
        # Bad input, like a bad flag: exit 2.
        print(f"kvx plan: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """kvx's parser. With ``command`` (the command word of the line to parse), the
    daemons' options (pydantic's settings, 0.2 s to import) are added only when it
    is ``prefill`` or ``decode``; without it, every command's options are."""
    from kvx import __version__

    parser = argparse.ArgumentParser(
        prog="kvx", description="KV-cache transfer for disaggregated LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvx {__version__}")
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default: INFO for the metadata service and the proxy, WARNING otherwise)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_demo(sub)

    bench = sub.add_parser(
        "bench",
        help="transfer benchmark against the limit of its path",
        description="Moves --blocks non-adjacent blocks per transfer between two "
        "processes and measures, in the same run and alternating with it, the limit "
        "of the path the backend takes: the raw loopback socket with the same bytes "
        "per request (tcp), or one process_vm_readv/writev of the same ranges (shm).",
    )
    bench.add_argument("--op", choices=["read", "write"], default="read", help="operation (default: read)")
    bench.add_argument(
        "--block-size", type=_size, default=_size("32KiB"), help="bytes per block (default: 32KiB)"
    )
    bench.add_argument("--blocks", type=_positive, default=1000, help="blocks per transfer (default: 1000)")
    bench.add_argument("--iters", type=_positive, default=20, help="measured transfers (default: 20)")
    bench.add_argument("--warmup", type=int, default=3, help="unmeasured transfers first (default: 3)")
    bench.add_argument("--streams", type=_positive, default=1, help="connections per peer (default: 1)")
    bench.add_argument(
        "--backend",
        choices=["auto", *backends.names()],
        default="auto",
        help="transport; auto picks as agents do: shm on one host when permitted, "
        "cuda_ipc there for GPU memory (default: auto); rdma opens the endpoint "
        "KVX_RDMA_PROVIDER names on both sides (else the best NIC, else libfabric's tcp provider)",
    )
    bench.add_argument(
        "--memory",
        choices=["host", "cuda"],
        default="host",
        help="where both sides' blocks live: host memory, or CUDA device 0 (needs kvx[gpu]; default: host)",
    )
    bench.add_argument(
        "--sweep",
        action="store_true",
        help="measure the curve instead: transfer sizes from 4 KiB to 64 MiB in 16 KiB blocks "
        "(--block-size, --blocks, --iters and --warmup are then chosen per size)",
    )
    bench.add_argument(
        "--sizes",
        metavar="SIZE,SIZE,...",
        help="with --sweep: these transfer sizes instead (multiples of 16KiB above it, e.g. "
        "64KiB,128KiB,256KiB: a denser curve for kvx plan --curve)",
    )
    bench.add_argument(
        "--plot", metavar="FILE.png", help="with --sweep: draw the curve into FILE.png (needs kvx[bench])"
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_plan(sub)
    _add_cluster_commands(sub)
    _add_doctor(sub)
    _add_daemon_commands(sub, with_options=command in (None, "prefill", "decode"))
    meta = sub.add_parser(
        "metadata",
        help="run the metadata service (gRPC registry, admin REST API)",
        description="Agents register here under a lease and find each other by name. "
        "The memory store needs nothing else (agents re-register by themselves after a "
        "restart); etcd keeps the state across restarts and lets several replicas "
        "serve one cluster.",
    )
    meta.add_argument("--listen", default="127.0.0.1:50051", help="gRPC host:port (default: 127.0.0.1:50051)")
    meta.add_argument(
        "--store",
        default="memory",
        help="memory (default), etcd://host:port[,host:port...], or mirror://host:port: a read "
        "replica of that service, which answers lookups and watches from a copy it keeps "
        "and refuses registrations and renewals",
    )
    meta.add_argument(
        "--admin-listen",
        default="127.0.0.1:8081",
        help="admin REST API host:port; 'off' disables it (default: 127.0.0.1:8081)",
    )
    meta.add_argument(
        "--admin-token-file",
        help="file holding the bearer token for state-changing admin "
        "calls; without it those calls are refused. Must differ from --token-file",
    )
    meta.add_argument(
        "--admin-reads-need-token",
        action="store_true",
        help="require a token for admin reads too (not /healthz, /readyz); always on with --token-file, "
        "where reads take the admin or the gRPC token",
    )
    meta.add_argument("--token-file", help="file holding the bearer token every gRPC call must carry")
    meta.add_argument("--tls-cert", help="PEM certificate for gRPC TLS (with --tls-key)")
    meta.add_argument("--tls-key", help="PEM private key for gRPC TLS (with --tls-cert)")
    meta.add_argument(
        "--tls-client-ca",
        help="PEM CA: require client certificates signed by it (with --tls-cert and --tls-key)",
    )
    meta.add_argument(
        "--default-ttl-s", type=_positive, default=10, help="lease TTL when an agent asks none (default: 10)"
    )
    meta.add_argument(
        "--etcd-lease-backstop-s",
        type=_positive,
        default=60,
        help="with an etcd store: the etcd lease behind each agent lease lives this long unless "
        "renewed (at least the agent's TTL); the service enforces the agent's TTL itself and renews "
        "the etcd lease every third of this. An agent that died with its replica lingers up to it "
        "(default: 60)",
    )
    meta.add_argument(
        "--etcd-compact-every-s",
        type=_compact_period,
        default=300,
        help="with an etcd store: compact etcd's history this often, up to the revision read one "
        "period before. etcd's quota counts old revisions too, and past it etcd refuses every "
        "registration; 0 leaves compaction to etcd's own --auto-compaction-* (default: 300)",
    )
    meta.add_argument(
        "--mirror-stale-s",
        type=_positive,
        default=None,
        help="with a mirror store: once its copy has not followed the primary for this long, the "
        "replica answers no read (UNAVAILABLE) until it follows again (default: 10, the default lease)",
    )
    meta.add_argument(
        "--primary-tls-ca",
        help="with a mirror store: PEM CA of the primary's certificate (TLS to the primary); the "
        "mirror sends the primary the token of --token-file",
    )
    meta.add_argument("--primary-tls-cert", help="with a mirror store: client certificate for the primary")
    meta.add_argument("--primary-tls-key", help="with a mirror store: its private key")
    meta.add_argument(
        "--max-agents",
        type=_positive,
        default=100_000,
        help="registered agents at most; a new name past it is refused (default: 100000; the memory store holds 100,000 agents in about 450 MiB)",
    )
    meta.add_argument(
        "--max-registry-bytes",
        type=_positive,
        default=512 * 1024 * 1024,
        help="the registered records' bytes in all, memory store; a registration past it is "
        "refused (default: 536870912, 512 MiB: with 100,000 agents of a few KiB each, the service "
        "stays under 2 GiB)",
    )
    meta.add_argument(
        "--max-watch-streams",
        type=_positive,
        default=4096,
        help="WatchAgents streams open at once; one more is refused (default: 4096: "
        "each agent that connects to peers by name holds one; a read replica's watch counts "
        "here only once --max-replica-watch-streams are taken)",
    )
    meta.add_argument(
        "--max-replica-watch-streams",
        type=_positive,
        default=16,
        help="watch slots set aside for read replicas of this service, so that agents' watches "
        "filling --max-watch-streams cannot cut them off; past them a replica's watch takes an "
        "agent's slot (default: 16)",
    )
    meta.add_argument(
        "--event-loop",
        choices=LOOPS,
        default="asyncio",
        help="the service's event loop: asyncio's own (default) or uvloop's, which spends less CPU "
        "per call (needs the uvloop package: pip install 'kvx[uvloop]')",
    )

    proxy = sub.add_parser(
        "proxy",
        help="OpenAI-compatible router: prefill on one vLLM instance, decode on another",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serves /v1/completions and /v1/chat/completions (streamed or not),\n"
        "/v1/models, /healthz and /metrics. Each completion goes first to a prefill instance with\n"
        "max_tokens=1 and kv_transfer_params.do_remote_decode, then, with the\n"
        "kv_transfer_params that returns, to a decode instance, which pulls the KV cache\n"
        "and answers the client. The instance with the fewest requests in flight gets\n"
        "each leg; one that cannot be reached is skipped for --cooldown-s. With\n"
        "--prefill-kv-events, prefill goes where the prompt's prefix is cached (balanced\n"
        "against load); with --decode-kv-usage, equally loaded decode instances go by free KV cache.",
        epilog="vLLM instances need a KV connector, e.g.\n"
        "  vllm serve MODEL --port 8100 --kv-transfer-config "
        '\'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'\n'
        "example:\n"
        "  kvx proxy --listen 0.0.0.0:8000 --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200\n"
        "  kvx proxy --metadata 10.0.0.9:50051    # instances whose agents publish engine_info api_url\n"
        "KV-aware routing (vLLM started with --kv-events-config "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}\'):\n'
        "  kvx proxy --prefill http://10.0.0.1:8100 --prefill-kv-events http://10.0.0.1:8100=tcp://10.0.0.1:5557 \\\n"
        "            --prefill http://10.0.0.3:8100 --prefill-kv-events http://10.0.0.3:8100=tcp://10.0.0.3:5557 \\\n"
        "            --decode http://10.0.0.2:8200",
    )
    proxy.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="host:port to serve on; port 0 picks a free one (default: 127.0.0.1:8000)",
    )
    proxy.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill instance's base URL, e.g. http://127.0.0.1:8100 (repeatable)",
    )
    proxy.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode instance's base URL, e.g. http://127.0.0.1:8200 (repeatable)",
    )
    proxy.add_argument(
        "--metadata",
        metavar="HOST:PORT",
        help="also use the instances registered at this kvx metadata service (agents of "
        "role prefill or decode whose engine_info has api_url)",
    )
    proxy.add_argument(
        "--metadata-token-file", metavar="FILE", help="file holding the bearer token of the metadata service"
    )
    proxy.add_argument(
        "--refresh-s",
        type=_seconds,
        metavar="SECONDS",
        default=2.0,
        help="how often to ask the metadata service for instances (default: 2)",
    )
    proxy.add_argument(
        "--timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=300.0,
        help="longest wait for an instance to send the next bytes, for an answer's headers (with "
        "--connect-timeout-s, from sending), and for the whole of an answer that is not a stream "
        "(default: 300)",
    )
    proxy.add_argument(
        "--connect-timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=10.0,
        help="longest wait to connect to an instance (default: 10)",
    )
    proxy.add_argument(
        "--cooldown-s",
        type=_seconds,
        metavar="SECONDS",
        default=5.0,
        help="how long an unreachable instance is skipped while others are up (default: 5)",
    )
    proxy.add_argument(
        "--max-body-size",
        type=_size,
        metavar="SIZE",
        default=_size("8MiB"),
        help="largest request body a client may send; larger ones get 413 (default: 8MiB)",
    )
    proxy.add_argument(
        "--max-answer-size",
        type=_size,
        metavar="SIZE",
        default=_size("64MiB"),
        help="largest answer an instance may send that is not a stream (a prefill's, a /tokenize, "
        "a decode's without stream); read whole within --timeout-s, larger ones are 502 (default: 64MiB)",
    )
    proxy.add_argument(
        "--header-timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=10.0,
        help="longest wait for a client's request headers; then the connection is closed (default: 10)",
    )
    proxy.add_argument(
        "--body-timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=60.0,
        help="longest wait for a client's whole request body; then 408 (default: 60)",
    )
    proxy.add_argument(
        "--send-timeout-s",
        type=_seconds,
        metavar="SECONDS",
        default=60.0,
        help="while a client's buffers are full it must take 64 KiB of its answer in this time; "
        "else its connection is reset and the instance serving it released (default: 60)",
    )
    proxy.add_argument(
        "--mode",
        choices=("pull", "push"),
        default="pull",
        help="pull: prefill, then decode reads the KV cache; push: both legs at once, prefill "
        'writes each layer into decode\'s blocks as it computes (engines with "mode": "push"; '
        "the first request to each prefill instance runs in pull mode) (default: pull)",
    )
    proxy.add_argument(
        "--prefill-kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="KV-aware routing: subscribe to the KV cache events of the prefill instance URL "
        "(also given with --prefill), published by its vLLM on ENDPOINT (tcp://host:port or "
        "ipc://path of --kv-events-config; REPLAY: that of its replay_endpoint, asked for missed "
        "batches), and "
        "send each prompt to the prefill instance with the longest cached prefix, balanced "
        "against load (repeatable; default: route by load only)",
    )
    proxy.add_argument(
        "--kv-alpha",
        type=float,
        metavar="WEIGHT",
        default=1.0,
        help="KV-aware routing: an instance scores cached_tokens - WEIGHT * queued_tokens (the prompt "
        "tokens it still computes for requests in flight); the highest wins (default: 1)",
    )
    proxy.add_argument(
        "--decode-kv-usage",
        action="store_true",
        help="read each decode instance's vllm:kv_cache_usage_perc from its /metrics every "
        "--refresh-s; of the decode instances with the fewest requests in flight, the one with "
        "the most free KV cache gets the request (default: off)",
    )
    return parser


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise KvxError(f"cannot read token file {path}: {exc}") from None
    if len(token) < 16:
        raise KvxError(f"the token in {path} is shorter than 16 characters")
    return token


def _run_cluster(args: argparse.Namespace) -> int:
    import json

    from kvx import _status

    if args.command == "agents":
        token = _read_token(args.metadata_token_file)
        print(_status.run_agents(args.metadata, token, args.role, args.json))
        return 0
    if args.command == "status":
        report = _status.collect(
            args.metadata,
            _read_token(args.metadata_token_file),
            _read_token(args.admin_token_file),
            args.timeout_s,
            args.interval_s,
        )
        print(json.dumps(report, indent=2) if args.json else _status.render_status(report))
        return 0 if report["ok"] else 1
    token = _read_token(args.token_file)
    assert token is not None, "--token-file is required"
    state = _status.run_drain(args.admin, token, args.wait, args.timeout_s)
    print(f"{args.admin}: {state}")
    return 0


def _run_metadata(args: argparse.Namespace) -> int:
    from kvx import _loop
    from kvx.metadata.service import MetadataServer, ServiceLimits, TlsConfig
    from kvx.metadata.store import MemoryStore, Store

    new_loop = _loop.loop_factory(args.event_loop)  # an unusable choice fails before anything starts
    primary_tls = (args.primary_tls_ca, args.primary_tls_cert, args.primary_tls_key)
    if (any(primary_tls) or args.mirror_stale_s is not None) and not args.store.startswith("mirror://"):
        raise KvxError(
            "--mirror-stale-s, --primary-tls-ca, --primary-tls-cert and --primary-tls-key go with "
            "--store mirror://"
        )
    if args.store == "memory":
        store: Store = MemoryStore()
    elif args.store.startswith("etcd://"):
        from kvx.metadata.etcd import EtcdStore

        store = EtcdStore(
            args.store,
            backstop_s=args.etcd_lease_backstop_s,
            compact_every_s=args.etcd_compact_every_s,
        )
    elif args.store.startswith("mirror://"):
        from kvx.metadata.client import MetadataOptions
        from kvx.metadata.mirror import MirrorStore, parse_mirror_url

        options = MetadataOptions(
            token=_read_token(args.token_file),
            tls_ca=args.primary_tls_ca,
            tls_cert=args.primary_tls_cert,
            tls_key=args.primary_tls_key,
        )
        primary = parse_mirror_url(args.store)
        if options.token and not args.primary_tls_ca and not _loopback(primary):
            logging.getLogger("kvx.metadata").warning(
                "read replica: the token of --token-file goes to the primary %s in plaintext; "
                "give --primary-tls-ca (the primary serving TLS) outside a trusted network",
                primary,
            )
        store = MirrorStore(
            primary,
            options,
            stale_s=args.mirror_stale_s or 10,
            max_agents=args.max_agents,
            max_bytes=args.max_registry_bytes,
        )
    else:
        raise KvxError(
            f"--store must be 'memory', etcd://host:port[,...] or mirror://host:port, not {args.store!r}"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise KvxError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        # Without a server certificate there is no TLS: the CA would check nothing.
        raise KvxError(
            "--tls-client-ca needs --tls-cert and --tls-key: without them the service would "
            "serve plaintext and accept any client"
        )
    if args.admin_reads_need_token and not (args.admin_token_file or args.token_file):
        raise KvxError("--admin-reads-need-token needs --admin-token-file (or --token-file)")
    admin_token, token = _read_token(args.admin_token_file), _read_token(args.token_file)
    if admin_token is not None and admin_token == token:
        raise KvxError(
            "--admin-token-file and --token-file hold the same token: every agent could evict "
            "any other; give the admin API its own token"
        )
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    server = MetadataServer(
        args.listen,
        store,
        admin_listen=None if args.admin_listen == "off" else args.admin_listen,
        admin_token=admin_token,
        admin_reads_need_token=args.admin_reads_need_token,
        token=token,
        tls=tls,
        limits=ServiceLimits(
            default_ttl_s=args.default_ttl_s,
            max_agents=args.max_agents,
            max_registry_bytes=args.max_registry_bytes,
            max_watch_streams=args.max_watch_streams,
            max_replica_watch_streams=args.max_replica_watch_streams,
        ),
    )
    with contextlib.suppress(KeyboardInterrupt):
        _loop.run(new_loop, server.serve_forever(freeze_gc=True))
    return 0


def _kv_events_pair(text: str) -> tuple[str, str]:
    url, sep, endpoint = text.partition("=")
    if not sep:
        raise KvxError(
            f"--prefill-kv-events {text!r}: expected URL=ENDPOINT, e.g. http://p1:8100=tcp://p1:5557"
        )
    return url, endpoint


def _run_proxy(args: argparse.Namespace) -> int:
    from kvx.metadata.client import MetadataOptions
    from kvx.proxy import ProxyConfig, serve

    if not args.metadata and not (args.prefill and args.decode):
        raise KvxError(
            "give at least one --prefill URL and one --decode URL, or --metadata HOST:PORT to find them"
        )
    token = _read_token(args.metadata_token_file)
    config = ProxyConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        metadata_target=args.metadata,
        metadata_options=MetadataOptions(token=token) if token else None,
        listen=args.listen,
        timeout_s=args.timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        refresh_s=args.refresh_s,
        cooldown_s=args.cooldown_s,
        max_body_bytes=args.max_body_size,
        max_answer_bytes=args.max_answer_size,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        send_timeout_s=args.send_timeout_s,
        mode=args.mode,
        prefill_kv_events=tuple(_kv_events_pair(text) for text in args.prefill_kv_events),
        kv_alpha=args.kv_alpha,
        decode_kv_usage=args.decode_kv_usage,
    )
    with contextlib.suppress(KeyboardInterrupt):
        serve(config)
    return 0


def _add_daemon_commands(sub: argparse._SubParsersAction, with_options: bool) -> None:
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        daemon = sub.add_parser(
            role,
            help=f"run a {role} daemon: an engine, its kvx agent, an admin API; drains on SIGTERM",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            usage=f"kvx {role} [OPTIONS] [-- ENGINE ARGUMENTS]",
            description=f"Runs a {role} instance: the engine (--engine synthetic: kvx's own, no model;\n"
            f"vllm or sglang: started with the arguments after --, the KV connector set for {role}),\n"
            "published in the metadata service for `kvx proxy --metadata`, and an admin API\n"
            "(/healthz, /readyz, /v1/status, POST /v1/drain, /metrics). SIGTERM drains: the\n"
            "instance is marked draining, finishes what it has, unregisters and exits 0.\n\n"
            "Every option is also an environment variable KVX_<OPTION> (--drain-timeout-s:\n"
            "KVX_DRAIN_TIMEOUT_S) and a key of the --config file (drain_timeout_s: 30);\n"
            "flags come first, then the environment, then the file.",
            epilog="examples:\n"
            f"  kvx {role} --metadata 127.0.0.1:50051 --secret-file secret\n"
            f"  kvx {role} --engine vllm --metadata 10.0.0.9:50051 --secret-file /etc/kvx/secret \\\n"
            "      -- --model meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2\n"
            f"  (its {other} counterpart: kvx {other} ...)",
        )
        if with_options:
            from kvx.daemon.settings import add_arguments

            add_arguments(daemon)


def _run_daemon(args: argparse.Namespace, engine_args: list[str]) -> int:
    from kvx.daemon import run, settings

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "log_level", "config")}
    if args.command == "prefill":
        return run.main(settings.load("prefill", flags, args.config, engine_args))
    return run.main(settings.load("decode", flags, args.config, engine_args))


# The options build_parser gives before the command, and whether each takes a value.
_GLOBAL_OPTIONS = {"--log-level": True, "--version": False, "-h": False, "--help": False}


def _command_index(argv: list[str]) -> int:
    """Where the command word is in ``argv``: after the global options
    (``kvx --log-level INFO plan ...``); len(argv) when there is none."""
    at = 0
    while at < len(argv) and argv[at].startswith("-"):
        name = argv[at].split("=", 1)[0]
        takes_value = _GLOBAL_OPTIONS.get(name, False) and "=" not in argv[at]
        at += 2 if takes_value else 1
    return at


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv and any(a in ("prefill", "decode") for a in argv[: argv.index("--")]):
        at = argv.index("--")
        argv, engine_args = argv[:at], argv[at + 1 :]
    at = _command_index(argv)
    if argv[at : at + 1] == ["plan"] and not set(argv[at + 1 : at + 2]) & {
        "model",
        "simulate",
        "-h",
        "--help",
    }:
        argv.insert(at + 1, "model")  # `kvx plan --model ...` is `kvx plan model --model ...`
    args = build_parser(argv[at] if at < len(argv) else "").parse_args(argv)
    level = args.log_level or (
        "INFO" if args.command in ("metadata", "proxy", "prefill", "decode") else "WARNING"
    )
    logging.basicConfig(level=level, format=LOG_FORMAT)
    try:
        if args.command in ("prefill", "decode"):
            return _run_daemon(args, engine_args)
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "doctor":
            return _run_doctor(args)
        if args.command in ("agents", "status", "drain"):
            return _run_cluster(args)
        if args.command == "metadata":
            return _run_metadata(args)
        if args.command == "proxy":
            return _run_proxy(args)
        if args.command == "plan" and args.action == "simulate":
            from kvx.plan.simulate import run_simulate

            try:
                return run_simulate(args)
            except ConfigError as exc:
                print(f"kvx plan simulate: {exc}", file=sys.stderr)
                return 2
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "bench":
            from kvx import _bench

            if args.plot and not args.sweep:
                raise ConfigError("--plot draws the curve of --sweep; add --sweep")
            if args.sizes and not args.sweep:
                raise ConfigError("--sizes are the sizes of --sweep; add --sweep")
            if args.sweep:
                sizes = _sweep_sizes(args.sizes) if args.sizes else _bench.SWEEP_SIZES
                curve = _bench.sweep(
                    args.op,
                    args.streams,
                    backend=args.backend,
                    memory=args.memory,
                    sizes=sizes,
                    progress=not args.json and sys.stderr.isatty(),
                )
                print(_bench.main_json(curve) if args.json else _bench.render_sweep(curve))
                if args.plot:
                    _bench.plot_sweep(curve, args.plot)
                return 0 if all(p["verified"] for p in curve["points"]) else 1
            result = _bench.run(
                args.op,
                args.block_size,
                args.blocks,
                args.iters,
                args.streams,
                max(0, args.warmup),
                progress=not args.json and sys.stderr.isatty(),
                backend=args.backend,
                memory=args.memory,
            )
            print(_bench.main_json(result) if args.json else _bench.render(result))
            return 0 if result["verified"] else 1
    except KvxError as exc:
        print(f"kvx {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
