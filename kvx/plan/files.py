"""Reading the files ``kvx plan`` takes: prompt-length histograms and sweeps."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from kvx.errors import ConfigError
from kvx.plan.links import Curve
from kvx.plan.model import PROMPT_BINS_MAX

FILE_BYTES_MAX = 16 << 20


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(FILE_BYTES_MAX + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if len(raw) > FILE_BYTES_MAX:
        raise ConfigError(f"{path} is over {FILE_BYTES_MAX >> 20} MiB")
    try:
        # utf-8-sig: editors on Windows start UTF-8 files with a byte order mark.
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None


def load_json(text: str | bytes, path: str, hint: str = "") -> Any:
    """``json.loads`` with its failures as ConfigError; nesting deep enough
    to exhaust the parser's recursion (``[`` x 100000) among them."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a kvx plan input{hint}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not JSON ({exc}){hint}") from None


def read_curve(path: str) -> Curve:
    """The curve of a ``kvx bench --sweep --json`` file."""
    # _read is outside load_json's except: its ConfigError (a ValueError too)
    # must not be reported as "not JSON".
    text = _read(path)
    data = load_json(text, path, f"; write it with `kvx bench --sweep --json > {path}`")
    return Curve.from_sweep(data, f"{path}")


def read_histogram(path: str) -> tuple[tuple[int, float], ...]:
    """(tokens, weight) pairs from JSON (``[[tokens, weight], ...]``,
    ``[{"tokens": .., "weight": ..}, ...]`` or ``{"tokens": weight}``) or
    CSV (``tokens,weight`` lines, a header line allowed)."""
    text = _read(path)
    rows: list[tuple[Any, Any]]
    if text.lstrip()[:1] in ("[", "{"):
        data = load_json(text, path)
        if isinstance(data, dict):
            rows = list(data.items())
        elif isinstance(data, list):
            rows = [_json_row(r, path) for r in data]
        else:
            raise ConfigError(f"{path}: a histogram is a JSON list or object")
    else:
        rows = []
        first = True
        for i, line in enumerate(csv.reader(io.StringIO(text))):
            if not line or not "".join(line).strip() or line[0].lstrip().startswith("#"):
                continue  # blank lines and comments, before the header too
            if len(line) != 2:
                raise ConfigError(f"{path} line {i + 1}: want 'tokens,weight', got {','.join(line)!r}")
            if first and not line[0].strip().isdigit():
                first = False
                continue  # a header: the first line that is not a comment
            first = False
            if len(rows) >= PROMPT_BINS_MAX:
                raise ConfigError(f"{path}: a histogram needs 1..{PROMPT_BINS_MAX} rows, not more")
            rows.append((line[0], line[1]))
    if not 1 <= len(rows) <= PROMPT_BINS_MAX:
        raise ConfigError(f"{path}: a histogram needs 1..{PROMPT_BINS_MAX} rows, not {len(rows)}")
    return tuple(_row(t, w, path) for t, w in rows)


def _json_row(row: Any, path: str) -> tuple[Any, Any]:
    if isinstance(row, dict):
        return row.get("tokens"), row.get("weight", 1)
    if isinstance(row, list) and len(row) == 2:
        return row[0], row[1]
    raise ConfigError(f"{path}: each row is [tokens, weight] or {{'tokens': .., 'weight': ..}}, not {row!r}")


def _row(tokens: Any, weight: Any, path: str) -> tuple[int, float]:
    try:
        t = int(str(tokens).strip())
        w = float(str(weight).strip())
    except ValueError:
        raise ConfigError(
            f"{path}: {tokens!r}, {weight!r} is not a whole number of tokens and a weight"
        ) from None
    if not 1 <= t <= 1 << 24 or not 0 <= w < float("inf"):
        raise ConfigError(f"{path}: tokens must be 1..16777216 and weights >= 0, not {t}, {w}")
    return t, w
