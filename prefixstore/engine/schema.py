"""The catalog's schema: the DDL the engine creates, and the check that a catalog holds
exactly that.

A catalog is trusted only as the schema the engine made (DESIGN.md section 9): a
trigger runs inside the engine's own writes, a view answers the engine's reads with
anything, an extra index may call functions. The expected objects are not written
down twice: ``expected()`` applies ``MIGRATIONS`` to an in-memory database and reads
back its ``sqlite_master``, so the reference is the engine's own DDL as this SQLite
stores it. ``problems(conn)`` compares a catalog's ``sqlite_master`` with it: every
table, index, trigger and view by type, name, table and SQL text (a column added,
dropped or retyped changes the text). SQLite's own statistics tables
(``sqlite_stat1``..``4``, written by ``ANALYZE``) hold no code and are not compared.

``plan_fix`` / ``apply_fix`` (for ``audit --repair``): drop what is foreign (triggers
first, then views, indexes, tables), recreate a missing index, and recreate an altered
engine table with the engine's DDL when every one of its rows copies across by column
name; a table that is missing, or whose rows would not copy, is left as it is and the
plan says why.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence

import attrs

CATALOG_NAME = "catalog.sqlite"
FORMAT_MARKER = "prefixstore"
SCHEMA_VERSION = 1

MIGRATIONS: dict[int, str] = {
    # version -> SQL that brings version-1 up to version
    1: """
    CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE nodes(
        id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a stale Match cannot alias
        key BLOB NOT NULL UNIQUE,
        parent INTEGER REFERENCES nodes(id),
        start_block INTEGER NOT NULL,
        end_block INTEGER NOT NULL CHECK(end_block > start_block),
        digests BLOB NOT NULL,
        has_snapshot INTEGER NOT NULL,
        state TEXT NOT NULL CHECK(state IN ('ready', 'damaged')),
        generation INTEGER NOT NULL,
        last_used INTEGER NOT NULL,
        snap_used INTEGER NOT NULL
    );
    CREATE INDEX nodes_parent ON nodes(parent);
    CREATE TABLE files(
        rank INTEGER NOT NULL,
        name TEXT NOT NULL,
        node INTEGER REFERENCES nodes(id),
        generation INTEGER NOT NULL,
        size INTEGER NOT NULL,
        checksum TEXT,
        status TEXT NOT NULL CHECK(status IN ('writing', 'live', 'garbage')),
        txn INTEGER,
        PRIMARY KEY(rank, name)
    );
    CREATE INDEX files_node ON files(node);
    CREATE INDEX files_txn ON files(txn);
    CREATE TABLE journal(
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        state TEXT NOT NULL,
        payload TEXT NOT NULL
    );
    """,
}

_IGNORED = ("sqlite_stat1", "sqlite_stat2", "sqlite_stat3", "sqlite_stat4")
_DROP_ORDER = ("trigger", "view", "index", "table")


def split_sql(script: str) -> list[str]:
    """The statements of a migration script."""
    return [s.strip() for s in script.split(";") if s.strip()]


@attrs.frozen
class SchemaObject:
    """One ``sqlite_master`` row: its type, name, the table it belongs to, its SQL."""

    type: str
    name: str
    table: str
    sql: str | None

    def describe(self) -> str:
        on = f" on {self.table}" if self.type in ("index", "trigger") else ""
        return f"{self.type} {self.name}{on}"


@attrs.frozen
class SchemaProblem:
    """An object the engine did not create (``foreign``), an engine object that is
    missing (``missing``) or not as the engine made it (``altered``)."""

    kind: str
    found: SchemaObject | None
    expected: SchemaObject | None

    @property
    def detail(self) -> str:
        obj = self.found or self.expected
        assert obj is not None
        if self.kind == "foreign":
            sql = " ".join((obj.sql or "").split())
            return f"{obj.describe()} was not created by the engine: {sql[:160]}"
        if self.kind == "missing":
            return f"{obj.describe()} of the engine's schema is missing"
        assert self.found is not None and self.expected is not None
        if self.found.type != self.expected.type:
            return f"{self.expected.type} {obj.name} of the engine's schema is a {self.found.type} here"
        return f"{obj.describe()} is not as the engine created it: {' '.join((self.found.sql or '').split())[:160]}"


def _objects(conn: sqlite3.Connection, schema: str = "main") -> dict[str, SchemaObject]:
    rows = conn.execute(f"SELECT type, name, tbl_name, sql FROM {schema}.sqlite_master").fetchall()
    return {r[1]: SchemaObject(r[0], r[1], r[2], r[3]) for r in rows
            if r[1] not in _IGNORED and not r[1].startswith("sqlite_autoindex_")}


@functools.lru_cache(maxsize=1)
def _reference() -> tuple[dict[str, SchemaObject], dict[str, tuple[str, ...]]]:
    """The objects the engine's DDL creates, by name, and each table's columns (built
    once, in a private in-memory database)."""
    conn = sqlite3.connect(":memory:")
    try:
        for v in range(1, SCHEMA_VERSION + 1):
            for stmt in split_sql(MIGRATIONS[v]):
                conn.execute(stmt)
        objects = _objects(conn)
        return objects, {n: tuple(_columns(conn, n)) for n, o in objects.items() if o.type == "table"}
    finally:
        conn.close()


def expected() -> dict[str, SchemaObject]:
    """The objects the engine's DDL creates, by name."""
    return _reference()[0]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA table_info({_quote(table)})").fetchall()]


def problems(conn: sqlite3.Connection) -> list[SchemaProblem]:
    """How the catalog on ``conn`` differs from ``expected()`` (empty when it is exactly it)."""
    want = expected()
    have = _objects(conn)
    out = [SchemaProblem("foreign", obj, None) for name, obj in sorted(have.items()) if name not in want]
    for name, obj in want.items():
        got = have.get(name)
        if got is None:
            out.append(SchemaProblem("missing", None, obj))
        elif got != obj:
            out.append(SchemaProblem("altered", got, obj))
    return out


def unreadable_tables(conn: sqlite3.Connection, found: Sequence[SchemaProblem]) -> set[str]:
    """The engine's tables whose rows cannot be read as the engine's from ``conn``:
    missing, something else in their place (a view), or lacking one of its columns."""
    out = set()
    for p in found:
        if p.expected is None or p.expected.type != "table":
            continue
        if p.found is None or p.found.type != "table" or (
                set(_reference()[1][p.expected.name]) - set(_columns(conn, p.found.name))):
            out.add(p.expected.name)
    return out


def describe(found: Sequence[SchemaProblem], limit: int = 5) -> str:
    """The problems in one line (the first ``limit``)."""
    shown = "; ".join(p.detail for p in found[:limit])
    return shown + (f" (and {len(found) - limit} more)" if len(found) > limit else "")


def cookie(conn: sqlite3.Connection) -> int:
    """The catalog's schema cookie: it changes with every change of its schema."""
    return int(conn.execute("PRAGMA schema_version").fetchone()[0])


# ---------------------------------------------------------------------- repair


@attrs.define
class SchemaFix:
    """What ``apply_fix`` does: objects to drop, engine tables to recreate (rows kept),
    engine indexes to create; ``unfixable``: why some problem cannot be fixed without
    losing rows (then nothing is applied)."""

    drop: list[SchemaObject] = attrs.field(factory=list)
    recreate: list[str] = attrs.field(factory=list)
    create: list[SchemaObject] = attrs.field(factory=list)
    unfixable: list[str] = attrs.field(factory=list)

    @property
    def empty(self) -> bool:
        return not (self.drop or self.recreate or self.create)

    def lines(self) -> list[str]:
        out = [f"dropped {o.describe()} (not created by the engine)" for o in self.drop]
        out += [f"recreated table {t} with the engine's schema (every row kept)" for t in self.recreate]
        out += [f"recreated {o.describe()}" for o in self.create]
        return out


def plan_fix(conn: sqlite3.Connection) -> SchemaFix:
    """Decide how to bring the catalog on ``conn`` back to the engine's schema (pure read)."""
    fix = SchemaFix()
    want = expected()
    for p in problems(conn):
        if p.kind == "foreign":
            assert p.found is not None
            fix.drop.append(p.found)
        elif p.kind == "missing":
            assert p.expected is not None
            if p.expected.type == "index":
                fix.create.append(p.expected)
            else:
                fix.unfixable.append(f"{p.detail}: its rows cannot be recovered")
        else:
            assert p.found is not None and p.expected is not None
            if p.found.type != p.expected.type:
                fix.unfixable.append(f"{p.detail}: the engine's rows are not there to keep")
                if p.found.type != "table":
                    fix.drop.append(p.found)
            elif p.expected.type == "index":
                fix.drop.append(p.found)
                fix.create.append(p.expected)
            else:
                lost = sorted(set(_reference()[1][p.expected.name]) - set(_columns(conn, p.found.name)))
                if lost:
                    fix.unfixable.append(f"{p.detail}: columns {lost} are missing, their values cannot be recovered")
                else:
                    fix.recreate.append(p.found.name)
    # an index of a recreated table goes with it: created again from the engine's DDL
    for table in fix.recreate:
        fix.create += [o for o in want.values() if o.type == "index" and o.table == table and o not in fix.create]
        fix.drop = [o for o in fix.drop if not (o.type == "index" and o.table == table)]
    fix.drop.sort(key=lambda o: (_DROP_ORDER.index(o.type) if o.type in _DROP_ORDER else 9, o.name))
    return fix


class SchemaFixError(Exception):
    """A statement of a schema fix failed (the fix is rolled back whole)."""


def apply_fix(conn: sqlite3.Connection, fix: SchemaFix) -> None:
    """Apply ``fix`` in one transaction on ``conn`` (autocommit mode, foreign keys off,
    the caller holding the directory lock). Raises SchemaFixError when a row of a
    recreated table does not copy back (nothing is changed then)."""
    want = expected()
    conn.execute("BEGIN IMMEDIATE")
    try:
        for obj in fix.drop:
            conn.execute(f"DROP {obj.type.upper()} IF EXISTS {_quote(obj.name)}")
        for table in fix.recreate:
            _recreate(conn, table, want[table])
        for obj in fix.create:
            assert obj.sql is not None
            conn.execute(obj.sql)
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        conn.execute("ROLLBACK")
        raise SchemaFixError(str(exc)) from exc
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _recreate(conn: sqlite3.Connection, table: str, obj: SchemaObject) -> None:
    """Table ``table`` again with the engine's DDL (its exact text), every row copied
    back by column name; the AUTOINCREMENT high-water mark is kept (ids never reused)."""
    assert obj.sql is not None
    cols = ", ".join(_quote(c) for c in _reference()[1][table])
    seq = (conn.execute("SELECT seq FROM sqlite_sequence WHERE name=?", (table,)).fetchone()
           if "sqlite_sequence" in _objects(conn) else None)
    n = conn.execute(f"SELECT count(*) FROM {_quote(table)}").fetchone()[0]
    hold = _quote(f"{table}__rows")
    conn.execute(f"DROP TABLE IF EXISTS {hold}")
    conn.execute(f"CREATE TABLE {hold} AS SELECT {cols} FROM {_quote(table)}")
    conn.execute(f"DROP TABLE {_quote(table)}")
    conn.execute(obj.sql)
    conn.execute(f"INSERT INTO {_quote(table)}({cols}) SELECT {cols} FROM {hold}")
    copied = conn.execute(f"SELECT count(*) FROM {_quote(table)}").fetchone()[0]
    conn.execute(f"DROP TABLE {hold}")
    if copied != n:
        raise sqlite3.IntegrityError(f"table {table}: {copied} of {n} rows copied back")
    if seq is not None and not conn.execute(
            "UPDATE sqlite_sequence SET seq=max(seq, ?) WHERE name=?", (seq[0], table)).rowcount:
        conn.execute("INSERT INTO sqlite_sequence(name, seq) VALUES(?, ?)", (table, seq[0]))
