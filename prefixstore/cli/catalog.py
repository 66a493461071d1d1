"""List a cache's catalog: its nodes, files, journal and meta rows, read-only.

For a person investigating a cache. Nothing is written and no lock is taken: with
no engine the catalog is opened immutable; beside a running engine (or with a
crash's write-ahead log) read-only, its shared-memory index included; a log without
its index is read from a private copy. All tables come from one consistent snapshot.

Text output: per table its row count and the rows in key order (nodes by id, files
by rank and name, journal by id, meta by key); BLOBs (keys, digests) as hex, long
ones shortened; sizes in bytes; states as stored. --json prints one object:
{dir, source, schema_version, summary, tables: {NAME: {present, columns, count,
rows}}} with every BLOB in full hex.

Exit status: 0, or 2 when DIR cannot be read as a cache (not a cache, newer schema,
unreadable) or an argument is bad.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.engine.catalog_reader import TABLES, CatalogListing, TableRows, read_listing

NAME = "catalog"
HELP = "list the catalog's nodes, files, journal and meta rows (read-only)"
BLOB_SHOWN = 16
"""BLOBs up to this many bytes are shown whole in text; longer ones by their first 8."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the cache directory")
    p.add_argument("--json", action="store_true", help="print one JSON object (BLOBs as hex)")
    p.add_argument("--table", action="append", choices=TABLES, default=None,
                   help="list only this table (repeatable; default: all)")
    p.add_argument("--limit", default=None, metavar="N", help="at most N rows per table (default: all)")


def run(args: argparse.Namespace) -> int:
    listing = read_listing(args.dir, args.table or TABLES, parse_limit(args.limit))
    if args.json:
        print(json.dumps(listing.to_dict()))
    else:
        print("\n".join(text_lines(listing)))
    return 0


def parse_limit(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise InvalidArgumentError("--limit", f"must be a whole number >= 0, got {text!r}")
    return n


# ---------------------------------------------------------------------- text


def text_lines(listing: CatalogListing) -> list[str]:
    nodes = listing.nodes_by_state
    files = listing.files_by_status
    out = [
        f"catalog of {listing.root}: schema version {listing.schema_version}; opened {listing.source}",
        f"  nodes: {sum(nodes.values())} ({_parts(nodes, ('ready', 'damaged'))}); "
        f"files: {sum(n for n, _ in files.values())} "
        f"({_parts({s: n for s, (n, _) in files.items()}, ('live', 'writing', 'garbage'))}), "
        f"{_size(sum(b for _, b in files.values()))} charged of capacity "
        f"{'-' if listing.capacity is None else _size(listing.capacity)}",
    ]
    for table in listing.tables:
        out.append("")
        out.extend(_table_lines(table))
    return out


def _parts(counts: dict[str, int], usual: tuple[str, ...]) -> str:
    names = list(usual) + sorted(set(counts) - set(usual))
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in names)


def _table_lines(table: TableRows) -> list[str]:
    if not table.present:
        return [f"{table.name}: no such table"]
    shown = len(table.rows)
    head = f"{table.name}: {table.count} row(s)"
    if shown < table.count:
        head += f", first {shown} shown"
    if not table.rows:
        return [head]
    grid = [table.columns] + [[cell(table.name, c, r.get(c)) for c in table.columns] for r in table.rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(table.columns))]
    lines = [head]
    for line in grid:
        padded = [v.ljust(w) for v, w in zip(line[:-1], widths[:-1], strict=True)] + line[-1:]
        lines.append("  " + "  ".join(padded).rstrip())
    return lines


def cell(table: str, column: str, value: Any) -> str:
    """One value as text: NULL as '-', BLOBs as hex, whitespace runs as one space."""
    if value is None:
        return "-"
    if isinstance(value, bytes):
        if len(value) <= BLOB_SHOWN:
            return value.hex()
        return f"{value[:8].hex()}...({len(value)} B)"
    if table == "nodes" and column == "has_snapshot":
        return "yes" if value else "no"
    return " ".join(str(value).split())


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"

