"""The ``kvx`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from kvx.config import parse_size
from kvx.errors import KvxError


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


def build_parser() -> argparse.ArgumentParser:
    from kvx import __version__

    parser = argparse.ArgumentParser(
        prog="kvx", description="KV-cache transfer for disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvx {__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="move KV blocks between a prefill and a decode agent and verify them",
                          description="Starts a prefill agent (child process) and a decode agent (this "
                          "process), fills prefill's KV pool with known bytes, READs a request's blocks "
                          "with a notification, WRITEs a few back, and verifies every byte.")
    demo.add_argument("--layers", type=_positive, default=8, help="KV layers (default: 8)")
    demo.add_argument("--num-blocks", type=_positive, default=256, help="blocks per layer and pool (default: 256)")
    demo.add_argument("--block-size", type=_size, default=_size("16KiB"), help="bytes per block (default: 16KiB)")
    demo.add_argument("--blocks", type=_positive, default=100, help="blocks in the request (default: 100)")

    bench = sub.add_parser("bench", help="transfer benchmark against the raw loopback socket",
                           description="Moves --blocks non-adjacent blocks per transfer between two "
                           "processes and measures the raw loopback socket with the same bytes per "
                           "request in the same run, alternating the two.")
    bench.add_argument("--op", choices=["read", "write"], default="read", help="operation (default: read)")
    bench.add_argument("--block-size", type=_size, default=_size("32KiB"), help="bytes per block (default: 32KiB)")
    bench.add_argument("--blocks", type=_positive, default=1000, help="blocks per transfer (default: 1000)")
    bench.add_argument("--iters", type=_positive, default=20, help="measured transfers (default: 20)")
    bench.add_argument("--warmup", type=int, default=3, help="unmeasured transfers first (default: 3)")
    bench.add_argument("--streams", type=_positive, default=1, help="connections per peer (default: 1)")
    bench.add_argument("--backend", choices=["tcp"], default="tcp", help="transport (default: tcp)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from kvx import _demo

            if args.blocks > args.num_blocks:
                print("kvx demo: --blocks must not exceed --num-blocks", file=sys.stderr)
                return 2
            return _demo.run(args.layers, args.num_blocks, args.block_size, args.blocks)
        if args.command == "bench":
            from kvx import _bench

            result = _bench.run(args.op, args.block_size, args.blocks, args.iters, args.streams,
                                max(0, args.warmup), progress=not args.json and sys.stderr.isatty())
            print(_bench.main_json(result) if args.json else _bench.render(result))
            return 0 if result["verified"] else 1
    except KvxError as exc:
        print(f"kvx {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
