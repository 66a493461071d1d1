"""Mooncake-format request traces and capacity specs. Pure: no I/O besides reading the trace.

A trace is JSONL, one request per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

``hash_ids`` are chained prefix-block hashes of ``block_tokens`` (512) tokens each: equal
ids at the same chain position are a reusable block, and reuse only happens on prefixes.
Unknown keys are ignored; blank lines are skipped. Malformed lines raise
:class:`TraceFormatError` (an :class:`InvalidInputError`) naming the file and line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from prefixstore.base.errors import InvalidInputError

BLOCK_TOKENS = 512
"""Tokens per hash block in the Mooncake traces."""


class TraceFormatError(InvalidInputError):
    """A trace line is not a well-formed request record."""

    def __init__(self, message: str, *, lineno: int | None = None, path: str | None = None) -> None:
        self.lineno = lineno
        self.path = path
        where = ""
        if path is not None:
            where = f"{path}:"
        if lineno is not None:
            where += f"{lineno}: " if where else f"line {lineno}: "
        elif where:
            where += " "
        super().__init__(f"{where}{message}")


class CapacitySpecError(InvalidInputError):
    """A capacity spec ("64GiB", "10%", "4096") could not be parsed."""


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: arrival time, token counts and its prefix-block chain."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)


def _int_field(obj: dict, key: str, minimum: int, lineno: int | None, path: str | None) -> int:
    if key not in obj:
        raise TraceFormatError(f"missing field {key!r}", lineno=lineno, path=path)
    value = obj[key]
    # bool is an int subclass; a float like 3.0 is accepted only if integral.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(
            f"field {key!r} must be an integer, got {type(value).__name__}",
            lineno=lineno,
            path=path,
        )
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise TraceFormatError(
                f"field {key!r} must be an integer, got {value!r}", lineno=lineno, path=path
            )
        value = int(value)
    if value < minimum:
        raise TraceFormatError(
            f"field {key!r} must be >= {minimum}, got {value}", lineno=lineno, path=path
        )
    return value


def parse_request(
    line: str,
    lineno: int | None = None,
    *,
    path: str | None = None,
    block_tokens: int = BLOCK_TOKENS,
    check_block_count: bool = True,
) -> Request:
    """Parse one JSONL line into a :class:`Request`.

    With ``check_block_count`` the chain must hold ``ceil(input_length / block_tokens)``
    ids (true of every line of the Mooncake traces).
    """
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise TraceFormatError(f"not valid JSON ({exc})", lineno=lineno, path=path) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(
            f"expected a JSON object, got {type(obj).__name__}", lineno=lineno, path=path
        )
    ts = _int_field(obj, "timestamp", 0, lineno, path)
    inp = _int_field(obj, "input_length", 1, lineno, path)
    out = _int_field(obj, "output_length", 0, lineno, path)
    if "hash_ids" not in obj:
        raise TraceFormatError("missing field 'hash_ids'", lineno=lineno, path=path)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(
            "field 'hash_ids' must be a non-empty list", lineno=lineno, path=path
        )
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceFormatError(
                f"hash_ids[{i}] must be a non-negative integer, got {h!r}", lineno=lineno, path=path
            )
    if check_block_count:
        want = -(-inp // block_tokens)
        if len(ids) != want:
            raise TraceFormatError(
                f"{len(ids)} hash_ids for input_length {inp} (expected ceil({inp}/{block_tokens}) = {want})",
                lineno=lineno,
                path=path,
            )
    return Request(ts, inp, out, tuple(ids))


def iter_trace(
    path: str | Path,
    limit: int | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
    check_block_count: bool = True,
) -> Iterator[Request]:
    """Yield the requests of a JSONL trace in file order, at most ``limit`` of them."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidInputError(f"limit must be a non-negative integer or None, got {limit!r}")
    if block_tokens <= 0:
        raise InvalidInputError(f"block_tokens must be positive, got {block_tokens}")
    return _iter_lines(Path(path), limit, block_tokens, check_block_count)


def _iter_lines(
    path: Path, limit: int | None, block_tokens: int, check_block_count: bool
) -> Iterator[Request]:
    name = str(path)
    if limit == 0:
        return
    count = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    f"not UTF-8 text ({exc.reason})", lineno=lineno, path=name
                ) from None
            if not line.strip():
                continue
            yield parse_request(
                line,
                lineno,
                path=name,
                block_tokens=block_tokens,
                check_block_count=check_block_count,
            )
            count += 1
            if limit is not None and count >= limit:
                return


def load_trace(
    path: str | Path,
    limit: int | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
    check_block_count: bool = True,
) -> list[Request]:
    """Load a JSONL trace (see :func:`iter_trace`)."""
    return list(
        iter_trace(path, limit, block_tokens=block_tokens, check_block_count=check_block_count)
    )


def unique_blocks(requests: Iterable[Request]) -> int:
    """Distinct prefix-tree nodes: chain positions ``(parent node, id)``.

    For Mooncake traces (ids already prefix-unique) this equals the distinct ids.
    """
    nodes: dict[tuple[int, int], int] = {}
    for r in requests:
        parent = -1
        for h in r.hash_ids:
            key = (parent, h)
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(nodes)
            parent = node
    return len(nodes)


def unique_bytes(requests: Iterable[Request], block_bytes: int) -> int:
    """Bytes to hold every distinct block of the trace once."""
    return unique_blocks(requests) * block_bytes


_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SPEC = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*|%)\s*$")


def parse_capacity(spec: str | int, total: int | None = None) -> int:
    """A capacity in bytes from ``spec``.

    - an ``int`` or a digit string: bytes (``"4096"``);
    - a number with a unit: ``B``, decimal ``KB MB GB TB`` or binary ``KiB MiB GiB TiB``
      (a bare ``K M G T`` is binary); units are case-insensitive; fractions round down;
    - a percentage ``"10%"``: that share of ``total`` (e.g. the trace's unique bytes),
      which must then be given.
    """
    if isinstance(spec, bool):
        raise CapacitySpecError(f"capacity must be a size string or an integer, got {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise CapacitySpecError(f"capacity must be non-negative, got {spec}")
        return spec
    if not isinstance(spec, str):
        raise CapacitySpecError(
            f"capacity must be a size string or an integer, got {type(spec).__name__}"
        )
    m = _SPEC.match(spec)
    if m is None:
        raise CapacitySpecError(f"cannot parse capacity {spec!r} (try '64GiB', '10%' or '4096')")
    number, unit = m.group(1), m.group(2)
    if unit == "%":
        if total is None:
            raise CapacitySpecError(f"capacity {spec!r} is a percentage but no total was given")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise CapacitySpecError(f"total must be a non-negative integer, got {total!r}")
        return math.floor(Fraction(number) * total / 100)
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise CapacitySpecError(f"unknown unit {unit!r} in capacity {spec!r}")
    return math.floor(Fraction(number) * scale)
