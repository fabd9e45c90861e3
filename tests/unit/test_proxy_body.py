"""The nesting scan kvx proxy (and the synthetic engine) run on a client's
body before the JSON parser: brackets inside strings do not count, and its
time is linear in the body, whatever the body. ``re`` holds the GIL while it
scans, so a slow scan stalls every request the process serves."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvx.errors import ProtocolError
from kvx.proxy._body import nests_deeper_than, parse_object

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        ({"prompt": "[{" * 1000}, 1),
        ({"a": ['"[', "\\", '\\"{', {"b": ["]]]"]}]}, 4),
        ([[[[]]]], 4),
        ({"s": "\u00e9\\u005b\n\t"}, 1),
    ],
)
def test_the_depth_counts_brackets_outside_strings_only(value, depth) -> None:
    data = json.dumps(value).encode()
    assert not nests_deeper_than(data, depth)
    assert nests_deeper_than(data, depth - 1)
    if isinstance(value, dict):
        assert parse_object(data, depth) == value


# Bodies a client can send that are not JSON. Each quote of an unclosed string
# once started a scan to the end of the body that failed: 16 KiB took a second,
# 1 MiB would take an hour, the 8 MiB limit days.
UNCLOSED = {
    "escaped quotes in an open string": b'{"prompt":"' + b'\\"' * (2 * MiB),
    "quote, backslash, repeated": b'{"a":' + b'"\\' * (2 * MiB),
}


@pytest.mark.parametrize("name", sorted(UNCLOSED))
def test_an_unclosed_string_is_refused_in_linear_time(name: str) -> None:
    # In a child process: a quadratic scan holds the GIL, so it could not be timed
    # out from a thread of this one. Linear, 4 MiB takes well under a second; the
    # bound is 60x that, so a busy machine does not fail it and a quadratic scan does.
    code = (
        "import sys; from kvx.proxy._body import parse_object; from tests.unit.test_proxy_body "
        "import UNCLOSED\ntry:\n parse_object(UNCLOSED[sys.argv[1]], 64)\n"
        "except Exception as exc:\n print(type(exc).__name__, exc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ProtocolError request body is not valid JSON"), done.stdout


def test_an_unclosed_string_does_not_hide_brackets_before_it() -> None:
    # The open string runs to the end, so brackets after its quote do not count;
    # those before it still do, and the parser refuses the body either way.
    assert nests_deeper_than(b"[[[" + b'"' + b"]]]", 2)
    with pytest.raises(ProtocolError, match="deeper than 2 levels"):
        parse_object(b"[[[" + b'"' + b"]]]", 2)
