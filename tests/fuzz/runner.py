"""Runs one fuzz target under atheris (libFuzzer):

    python -m tests.fuzz.runner TARGET [libFuzzer flags] [CORPUS_DIR | INPUT_FILE ...]

TARGET is one of tests/fuzz/targets.py's TARGETS. kvx is instrumented for
coverage (its Python code: the C extensions are not built for libFuzzer, so
their branches count only through the Python that calls them). A corpus
directory is seeded with the target's starting inputs; an input file given
instead is run once (how a finding is reproduced). Every 2**k inputs, and at
the last of a ``-runs`` budget, a line ``kvx-fuzz-stats {json}`` counts the
paths the inputs took.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import atheris

    if len(argv) < 2:
        sys.exit(__doc__)
    name, flags = argv[1], argv[2:]
    include = ["kvx"]
    if os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION") == "python":
        include.append("google.protobuf")  # its pure-Python decoder is code under test too
    with atheris.instrument_imports(include=include):
        from tests.fuzz import targets
    if name not in targets.TARGETS:
        sys.exit(f"unknown target {name!r}; one of {', '.join(targets.TARGETS)}")
    for arg in flags:
        if not arg.startswith("-") and Path(arg).is_dir():
            for i, data in enumerate(targets.seeds(name)):
                (Path(arg) / f"seed-{i}").write_bytes(data)
    fn = targets.TARGETS[name]
    # libFuzzer ends the process from C, past Python's atexit: report at the last
    # input of a -runs budget, and every 2**k inputs on the way.
    last = max((int(f.split("=", 1)[1]) for f in flags if f.startswith("-runs=")), default=-1)
    runs = [0]

    def one(data: bytes) -> None:
        runs[0] += 1
        fn(data)
        if runs[0] == last or runs[0] & (runs[0] - 1) == 0:
            stats = {"target": name, "inputs": runs[0], "paths": dict(sorted(targets.STATS.items()))}
            print("kvx-fuzz-stats " + json.dumps(stats), file=sys.stderr, flush=True)

    if not any(f.startswith("-max_len=") for f in flags):
        flags.append(f"-max_len={targets.MAX_LEN}")
    atheris.Setup([argv[0], *flags], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
