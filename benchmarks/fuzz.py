"""Runs each fuzz target of tests/fuzz long, and reports inputs/s, coverage
reached and findings.

    python benchmarks/fuzz.py [--runs N] [--targets header,descs,...] [--native 1,0] [--seed S]

Each target runs in its own process (tests/fuzz/runner.py under atheris) for
N inputs (default 1,000,000), once per data path named by --native
(KVX_NATIVE=1: the C extensions, 0: the pure-Python twins); ``protobuf``
runs once more on protobuf's pure-Python decoder. Coverage is libFuzzer's
count of instrumented edges in kvx's Python (``cov``) and of features
(``ft``); C code is not instrumented. A finding leaves its input in
--out (default a temporary directory), with the command that replays it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["header", "descs", "protobuf", "handshake"]
_DONE = re.compile(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


def run(target: str, native: str, runs: int, seed: int, out: Path, env_extra: dict[str, str]) -> dict:
    label = f"{target}{'-pyproto' if env_extra else ''}-native{native}"
    work = out / label
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tests.fuzz.runner",
        target,
        f"-runs={runs}",
        f"-seed={seed}",
        "-timeout=60",
        "-rss_limit_mb=4096",
        "-print_final_stats=1",
        f"-artifact_prefix={work}/",
        str(corpus),
    ]
    env = {**os.environ, "KVX_NATIVE": native, **env_extra}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    (work / "log.txt").write_text(proc.stderr)
    done = _DONE.findall(proc.stderr) or _STATUS.findall(proc.stderr)
    inputs, cov, ft, corp = (int(x) for x in done[-1]) if done else (0, 0, 0, 0)
    stats = [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stderr.splitlines()
        if line.startswith("kvx-fuzz-stats ")
    ]
    findings = sorted(str(p) for p in work.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    return {
        "run": label,
        "inputs": inputs,
        "seconds": round(elapsed, 1),
        "inputs_per_s": round(inputs / elapsed) if elapsed else 0,
        "cov": cov,
        "ft": ft,
        "corpus": corp,
        "findings": findings,
        "exit": proc.returncode,
        "paths": stats[-1]["paths"] if stats else {},
        "replay": [f"KVX_NATIVE={native} python -m tests.fuzz.runner {target} {f}" for f in findings],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000, help="inputs per target (default 1,000,000)")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated, of " + ", ".join(TARGETS)
    )
    parser.add_argument("--native", default="1,0", help="KVX_NATIVE values to run, comma-separated")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="where corpora, logs and findings go")
    parser.add_argument("--json", action="store_true", help="one JSON line per run instead of the table")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvx-fuzz-"))
    print(f"# {args.runs} inputs per target, seed {args.seed}; corpora, logs and findings in {out}")
    if not args.json:
        print(
            f"{'run':<28} {'inputs':>9} {'s':>7} {'inputs/s':>9} {'cov':>5} {'ft':>6} {'corpus':>6}  findings"
        )
    failed = False
    for target in args.targets.split(","):
        for native in args.native.split(","):
            variants: list[dict[str, str]] = [{}]
            if target == "protobuf":
                variants.append({"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"})
            for extra in variants:
                r = run(target, native, args.runs, args.seed, out, extra)
                failed |= bool(r["findings"]) or r["exit"] != 0
                if args.json:
                    print(json.dumps(r), flush=True)
                    continue
                print(
                    f"{r['run']:<28} {r['inputs']:>9} {r['seconds']:>7} {r['inputs_per_s']:>9} "
                    f"{r['cov']:>5} {r['ft']:>6} {r['corpus']:>6}  {len(r['findings']) or 'none'}"
                    + (f" (exit {r['exit']})" if r["exit"] else ""),
                    flush=True,
                )
                for line in r["replay"]:
                    print(f"    replay: {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
