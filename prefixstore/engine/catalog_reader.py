"""Read a cache's catalog tables without writing a byte, beside a running engine or not.

How the catalog is opened depends only on the files next to it; the engine's lock
(its ``flock`` on the directory and ``LOCK``) is neither taken nor probed:

- no ``-wal`` file (no engine has the catalog open): ``immutable=1``; SQLite creates
  no ``-wal``/``-shm`` file and takes no lock of its own either;
- a ``-wal`` and a ``-shm`` file (a running engine's, or left by a crash):
  ``mode=ro&readonly_shm=1``; the shared-memory index is opened read-only: a
  running engine's is used with SQLite's shared read locks only (no read mark is
  written), a crash's is not rebuilt (SQLite indexes the log in private memory);
- a ``-wal`` without a ``-shm``: the catalog and its log are copied to a private
  temporary directory and read there.

Every table is read in one read transaction (one consistent snapshot). An
immutable or copied read is repeated when the files changed under it (an engine
opened the directory meanwhile). Tables are read with sqlite-utils.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple
from urllib.parse import quote

import attrs
import sqlite_utils

from prefixstore.base.errors import (
    CatalogIOError,
    InvalidArgumentError,
    NotACacheError,
    SchemaVersionError,
)
from prefixstore.engine import trust
from prefixstore.engine.catalog import (
    CATALOG_NAME,
    FORMAT_MARKER,
    SCHEMA_VERSION,
    CatalogView,
    catalog_path,
)

TABLES = ("nodes", "files", "journal", "meta")
ORDER_BY = {"nodes": "id", "files": "rank, name", "journal": "id", "meta": "key"}
_ATTEMPTS = 5


@attrs.frozen
class TableRows:
    """One table's columns, total row count and the rows read (at most the limit)."""

    name: str
    present: bool
    columns: list[str]
    count: int
    rows: list[dict[str, Any]]


@attrs.frozen
class CatalogListing:
    """What ``read_listing`` found: the tables asked for, and totals over all rows."""

    root: str
    source: str
    schema_version: int
    tables: list[TableRows]
    nodes_by_state: dict[str, int]
    files_by_status: dict[str, tuple[int, int]]
    """status -> (rows, bytes)"""
    capacity: int | None
    """meta's capacity in bytes (None when absent or not a number)"""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: BLOB values as lowercase hex."""
        return {
            "dir": self.root,
            "source": self.source,
            "schema_version": self.schema_version,
            "summary": {
                "capacity": self.capacity,
                "nodes": dict(self.nodes_by_state),
                "files": {s: {"rows": n, "bytes": b} for s, (n, b) in self.files_by_status.items()},
            },
            "tables": {
                t.name: {"present": t.present, "columns": t.columns, "count": t.count,
                         "rows": [{k: _jsonable(v) for k, v in r.items()} for r in t.rows]}
                for t in self.tables
            },
        }


def read_listing(root: str, tables: Sequence[str] = TABLES, limit: int | None = None) -> CatalogListing:
    """Read ``tables`` (at most ``limit`` rows each, in key order) and the totals.

    Raises NotACacheError (no catalog, not a prefixstore catalog, unreadable),
    SchemaVersionError (newer schema), CatalogIOError (the copy could not be made, or
    the files kept changing), InvalidArgumentError (unknown table, bad limit).
    """
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        raise InvalidArgumentError("tables", f"unknown table(s) {unknown}; known: {list(TABLES)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidArgumentError("limit", f"must be a whole number >= 0 or None, got {limit!r}")
    path = catalog_path(root)
    for _ in range(_ATTEMPTS):
        before = _files(root)
        try:
            with _snapshot(path, before) as (db, source):
                listing = _read(db, root, source, tables, limit)
        except (sqlite3.Error, OSError) as exc:
            if _mode(_files(root)) != _mode(before):
                continue  # an engine opened or closed the catalog meanwhile
            if isinstance(exc, sqlite3.Error):
                raise NotACacheError(f"{root}: {CATALOG_NAME} is not a readable prefixstore catalog: {exc}") from exc
            raise CatalogIOError(f"{root}: cannot read {CATALOG_NAME}: {exc}") from exc
        if _mode(before) == "ro" or _files(root) == before:
            return listing
    raise CatalogIOError(f"{root}: {CATALOG_NAME} kept changing while it was read; try again")


# ---------------------------------------------------------------------- opening


class _Files(NamedTuple):
    """What lies next to the catalog: (inode, size, mtime) of it and its log, and whether an index exists."""

    catalog: tuple[int, int, int]
    wal: tuple[int, int, int] | None
    shm: bool


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CatalogIOError(f"cannot stat {path}: {exc}") from exc
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _files(root: str) -> _Files:
    path = catalog_path(root)
    catalog = _stat(path) if os.path.isfile(path) else None
    if catalog is None:
        if not os.path.lexists(path):
            trust.refuse_unless_new(root, f"{CATALOG_NAME} is missing")
        raise NotACacheError(f"{root}: no {CATALOG_NAME} (not a prefixstore cache)")
    return _Files(catalog, _stat(path + "-wal"), os.path.exists(path + "-shm"))


def _mode(files: _Files) -> str:
    if files.wal is None:
        return "immutable"
    return "ro" if files.shm else "copy"


@contextmanager
def _snapshot(path: str, files: _Files) -> Iterator[tuple[sqlite_utils.Database, str]]:
    """A sqlite-utils Database on a read-only connection, inside one read transaction."""
    mode = _mode(files)
    with tempfile.TemporaryDirectory(prefix="prefixstore-catalog-") if mode == "copy" else _no_dir() as tmp:
        if mode == "immutable":
            uri, source = f"file:{quote(path)}?immutable=1", "immutable (no engine, no write-ahead log)"
        elif mode == "ro":
            uri, source = (f"file:{quote(path)}?mode=ro&readonly_shm=1",
                           "read-only, its shared-memory index too (a running engine's or a crash's write-ahead log)")
        else:
            copy = os.path.join(tmp, CATALOG_NAME)
            shutil.copyfile(path, copy)
            shutil.copyfile(path + "-wal", copy + "-wal")
            uri, source = f"file:{quote(copy)}", "from a private copy of the catalog and its write-ahead log"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30)
        try:
            with CatalogView(conn).snapshot():
                yield sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False), source
        finally:
            conn.close()


@contextmanager
def _no_dir() -> Iterator[str]:
    yield ""


# ---------------------------------------------------------------------- reading


def _read(db: sqlite_utils.Database, root: str, source: str, tables: Sequence[str],
          limit: int | None) -> CatalogListing:
    view = CatalogView(db)
    version = view.user_version()
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{root}: catalog schema version {version} is newer than this prefixstore "
            f"(supports up to {SCHEMA_VERSION}); upgrade prefixstore"
        )
    present = set(db.table_names())
    if not version and not view.schema_objects():
        state = "is empty (0 bytes)" if not os.path.getsize(catalog_path(root)) else "holds no schema"
        trust.refuse_unless_new(root, f"{CATALOG_NAME} {state}")
    marker = list(db.table("meta").rows_where("key = ?", ["format"])) if "meta" in present else []
    if not marker or marker[0].get("value") != FORMAT_MARKER:
        raise NotACacheError(f"{root}: {CATALOG_NAME} has no prefixstore format marker")
    listed = [_table(db, t, t in present, limit) for t in tables]
    nodes = {}
    if "nodes" in present:
        nodes = view.node_states()
    files = {}
    if "files" in present:
        files = view.file_statuses()
    capacity = [r["value"] for r in db.table("meta").rows_where("key = ?", ["capacity"])]
    return CatalogListing(root, source, version, listed, nodes, files, _int_or_none(capacity[0] if capacity else None))


def _table(db: sqlite_utils.Database, name: str, present: bool, limit: int | None) -> TableRows:
    if not present:
        return TableRows(name, False, [], 0, [])
    table = db.table(name)
    rows = list(table.rows_where(order_by=ORDER_BY[name], limit=limit))
    return TableRows(name, True, [c.name for c in table.columns], table.count, rows)


def _int_or_none(text: Any) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _jsonable(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value
