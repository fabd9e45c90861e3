"""Parsing a client's request body without letting it recurse the parser out.

Python's ``json`` parser recurses once per nesting level, so a body of a
hundred thousand ``[`` ends in a RecursionError. ``parse_object`` first
measures the nesting with a flat scan (string literals removed, brackets
counted) and refuses a body nested deeper than the limit before the parser
sees it. It is CPU work linear in the body, up to ``max_body_bytes``: callers run
it on a worker thread, off the event loop (which does not free the event
loop from the scan's time: ``re`` holds the GIL while it runs).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvx.errors import ProtocolError

# A JSON string literal: quotes around anything but a quote or a backslash, or an escape.
# The closing quote is optional: a string left open runs to the end of the body and
# the match still succeeds. Were it required, each quote of an unclosed string would
# start a scan to the end that fails, quadratic in the body: a 1 MiB body of escaped
# quotes would hold the interpreter (re keeps the GIL) for an hour. The body is not
# valid JSON then, and the parser refuses it.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")


def nests_deeper_than(data: bytes, max_depth: int) -> bool:
    """True when arrays and objects in ``data`` nest deeper than ``max_depth``.

    Brackets inside string literals do not count. On text that is not JSON the
    answer may be either; the parser refuses such text anyway.
    """
    depth = 0
    for byte in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if byte in _OPENERS:
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def parse_object(data: bytes, max_depth: int) -> dict[str, Any]:
    """``data`` as a JSON object, or a ProtocolError that says what is wrong with it."""
    if nests_deeper_than(data, max_depth):
        raise ProtocolError(
            f"request body nests arrays and objects deeper than {max_depth} levels; flatten it"
        )
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: only a guard, the scan comes first
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body
