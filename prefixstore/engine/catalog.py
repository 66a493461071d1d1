"""The SQLite WAL catalog: nodes, files and the journal.

One writer (the engine, under its lock); readers (audit, stats from another
process) open their own read-only connection and never block on it.

Tables:

- ``meta``: format marker, layout, capacity.
- ``nodes``: one row per checkpoint (``key`` = chained hash at ``end_block``).
- ``files``: every file the catalog or journal owns, on every rank. ``status`` is
  ``writing`` (reserved by an in-flight transaction), ``live`` (a node's shard) or
  ``garbage`` (to be unlinked). Charged bytes are the sum of ``size`` over all rows.
- ``journal``: unfinished transactions (kind, state, JSON payload).

The schema is exactly the DDL of ``engine/schema.py``: a catalog holding a trigger,
view, index or table the engine did not create (or an altered one) is refused with
ForeignSchemaError before any statement of the engine runs on it, and checked again
whenever its schema cookie moves under a running engine. Every SQLite error that
reaches a caller is typed: CatalogIOError (I/O), CatalogCorruptError (anything else).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import quote

import attrs

from prefixstore.base.errors import (
    CatalogCorruptError,
    CatalogIOError,
    EngineClosedError,
    ForeignSchemaError,
    IllegalTransitionError,
    NotACacheError,
    PrefixStoreError,
    ReadOnlyError,
    RowTransitionError,
    SchemaVersionError,
)
from prefixstore.engine import schema, trust
from prefixstore.engine.schema import (
    CATALOG_NAME,
    FORMAT_MARKER,
    MIGRATIONS,
    SCHEMA_VERSION,
    split_sql,
)
from prefixstore.engine.structure import FILE_COLUMNS, NODE_COLUMNS
from prefixstore.engine.walsync import WalSync
from prefixstore.gpu.diskroom import WAL_AUTOCHECKPOINT_PAGES, WAL_LIMIT_BYTES
from prefixstore.gpu.fileio import FaultHook
from prefixstore.statemachine.machine import Machine
from prefixstore.statemachine.rows import FILE, NODE

# Where each row table's rows live: (SQL table, state column).
_ROWS = {FILE.name: ("files", "status"), NODE.name: ("nodes", "state")}
_CHUNK = 400  # rows named per statement (two parameters each for a file row)

# Repair and recovery's reconcile rewrite rows whatever state they hold (a catalog
# that contradicts itself): outside the tables' edges, they write the state an
# event's rows take (a published file row's, a retired one's).
REPAIRED_LIVE = FILE.target("published")
REPAIRED_GARBAGE = FILE.target("retired")


SYNCED_COMMITS = ("barrier", "evict.remove")
"""The labels of the commits written with ``txn(durable=True)``: synced by SQLite even
under ``synchronous=NORMAL`` (each makes every commit before it durable too)."""


def catalog_path(root: str) -> str:
    return os.path.join(root, CATALOG_NAME)


@attrs.define(slots=True, eq=False, init=False, repr=False)
class Catalog:
    """The engine's single writer connection, with fault-hooked commits. Every write
    transaction runs under the engine lock (``CallGuard.lock``); ``check_same_thread``
    is off because the engine's threads take turns under that lock."""

    path: str
    root: str
    synchronous: str
    hook: FaultHook
    before_write: Callable[[], None]
    conn: Any
    """The ``sqlite3`` connection (a test may wrap it)."""
    failed: str | None
    """Why a write failed and the catalog refuses writes until reopened (None: it writes)."""
    read_only: PrefixStoreError | None
    """Set on a catalog opened by ``read_only``: why; every write transaction is refused."""
    closed: bool
    failed_corrupt: bool
    """Whether the write that failed (``failed``) found the catalog not as the engine wrote it."""
    cookie: int
    """The schema cookie when the schema was last checked (``schema.cookie``)."""
    level: str | None
    """The connection's ``PRAGMA synchronous`` as the last write transaction set it
    (``txn``; None: unknown, set again before the next)."""
    unsynced: bool
    """Under ``synchronous=NORMAL``: whether a commit may have been written since the last
    one SQLite synced (a ``durable`` one); ``barrier`` has nothing to do when not."""
    wal: WalSync
    """The log's durability point: group commits (``txn(grouped=True)``, ``sync``)."""

    def __init__(
        self,
        root: str,
        *,
        synchronous: str = "FULL",
        hook: FaultHook | None = None,
        create: bool = True,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        """``before_write`` runs before the connection opens and before every write
        transaction (the engine releases its disk reserve there when the disk is full)."""
        if synchronous.upper() not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path, self.root = catalog_path(root), root
        self.read_only, self.closed, self.failed_corrupt, self.cookie = None, False, False, 0
        self.synchronous = synchronous.upper()
        self.level, self.unsynced = None, True
        self.hook = hook or FaultHook()
        self.wal = WalSync(self.path + "-wal", self.hook)
        self.before_write = before_write or (lambda: None)
        exists = os.path.exists(self.path)
        if not exists and not create:
            raise NotACacheError(f"{root}: no catalog")
        self.before_write()
        try:
            self.conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30
            )
        except sqlite3.Error as exc:
            raise CatalogIOError(f"{root}: cannot open {CATALOG_NAME}: {exc}") from exc
        self.failed = None
        try:
            self._setup(fresh=not exists)
        except sqlite3.Error as exc:
            self.conn.close()
            if isinstance(exc, sqlite3.DatabaseError) and _io_error(exc) and exc.sqlite_errorcode & 0xFF != 11:  # I/O: no verdict on the file
                raise CatalogIOError(f"{root}: cannot read {CATALOG_NAME}: {exc}") from exc
            raise NotACacheError(f"{root}: {CATALOG_NAME} is not a prefixstore catalog: {exc}") from exc
        except BaseException:
            self.conn.close()
            raise

    @classmethod
    def open_read_only(cls, root: str, reason: PrefixStoreError, hook: FaultHook | None = None) -> Catalog:
        """The catalog opened without writing a byte: ``immutable`` when it has no log
        (no ``-wal`` / ``-shm`` is created), read-only over its log and index when both
        exist; ``reason`` is raised when only one of them does (the log cannot be read
        without writing its index). Every write transaction raises ReadOnlyError."""
        path = catalog_path(root)
        if _size(path + "-wal"):
            if not os.path.exists(path + "-shm"):
                raise reason
            mode = "mode=ro"
        else:
            mode = "immutable=1"  # an empty or absent log: the file holds every commit
        self = cls.__new__(cls)
        self.path, self.synchronous, self.hook, self.root = path, "FULL", hook or FaultHook(), root
        self.wal = WalSync(path + "-wal", self.hook)
        self.before_write, self.failed, self.read_only = (lambda: None), None, reason
        self.closed, self.failed_corrupt, self.cookie, self.level, self.unsynced = False, False, 0, None, True
        try:
            self.conn = sqlite3.connect(f"file:{quote(path)}?{mode}", uri=True, isolation_level=None,
                                        check_same_thread=False, timeout=30)
        except sqlite3.Error as exc:
            raise CatalogIOError(f"{root}: cannot open {CATALOG_NAME} read-only: {exc}") from exc
        try:
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise SchemaVersionError(f"catalog schema version {version} > {SCHEMA_VERSION}")
            if self.meta("format") != FORMAT_MARKER:
                raise NotACacheError(f"{root}: catalog has no prefixstore format marker")
            self.check_schema()
        except sqlite3.Error as exc:
            self.conn.close()
            raise CatalogIOError(f"{root}: cannot read {CATALOG_NAME} read-only: {exc}") from exc
        except BaseException:
            self.conn.close()
            raise
        return self

    def _setup(self, fresh: bool) -> None:
        c = self.conn
        if not fresh and not c.execute("PRAGMA user_version").fetchone()[0] \
                and not c.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            # read before any pragma writes: a refused open leaves the directory as it was
            size = os.path.getsize(self.path)
            trust.refuse_unless_new(self.root, f"{CATALOG_NAME} is empty (0 bytes)" if not size
                                    else f"{CATALOG_NAME} holds no schema")
        c.execute("PRAGMA journal_mode=WAL")
        c.execute(f"PRAGMA synchronous={self.synchronous}")
        self.level = self.synchronous
        c.execute("PRAGMA foreign_keys=ON")
        c.execute("PRAGMA trusted_schema=OFF")  # no function with side effects from the schema
        # a bounded log: checkpointed every ~1 MiB and truncated back to that size
        c.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
        c.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        version = c.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"catalog schema version {version} is newer than this prefixstore "
                f"(supports up to {SCHEMA_VERSION}); upgrade prefixstore"
            )
        if version == 0:
            tables = c.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if tables and not fresh:
                raise NotACacheError("catalog file holds foreign tables")
        for v in range(version + 1, SCHEMA_VERSION + 1):
            c.execute("BEGIN IMMEDIATE")
            try:
                for stmt in split_sql(MIGRATIONS[v]):
                    c.execute(stmt)
                if v == 1:
                    c.execute("INSERT INTO meta VALUES('format', ?)", (FORMAT_MARKER,))
                c.execute(f"PRAGMA user_version={v}")
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        if self.meta("format") != FORMAT_MARKER:
            raise NotACacheError("catalog has no prefixstore format marker")
        self.check_schema()

    def check_schema(self) -> None:
        """Raise ForeignSchemaError unless the catalog's schema is exactly the engine's
        (``engine/schema.py``). Runs at open, before any statement of the engine touches
        a row, and again whenever the schema cookie moved."""
        c = self.conn
        cookie = schema.cookie(c)
        found = schema.problems(c)
        if found:
            raise ForeignSchemaError(
                f"{self.root}: the catalog's schema is not the one the engine created: "
                f"{schema.describe(found)}; nothing was changed. "
                f"Run `prefixstore audit --repair {self.root}` to drop what is foreign."
            )
        self.cookie = cookie

    def _schema_unchanged(self, c: sqlite3.Connection) -> None:
        """Check the schema again when its cookie moved since the last check (another
        connection changed it under the engine)."""
        if schema.cookie(c) != self.cookie:
            self.check_schema()

    # -- transactions ----------------------------------------------------------------

    @contextmanager
    def txn(self, label: str, *, grouped: bool = False, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction; its COMMIT is an effect reported to the fault hook.
        ``durable``: synced by SQLite whatever the catalog's level (``SYNCED_COMMITS``),
        so it and every commit before it are durable when it returns (a barrier). ``grouped``: under ``synchronous=FULL`` the commit is written without a sync of
        the log; it is durable once ``sync(wal.written)`` (read under the engine lock
        right after it) returns, together with the others written meanwhile (group
        commit, ``walsync.py``). Any other commit under FULL is synced by SQLite itself:
        the connection's ``PRAGMA synchronous`` is set before the transaction when it
        is not the level this one needs (``level``), and left there for the next.

        An I/O error (or full disk) from SQLite inside it raises CatalogIOError and
        makes the catalog refuse every later write (sticky, as SQLite's pager ERROR
        state): a transaction whose next state could not be committed is left to
        recovery, which runs when the engine is reopened. Any other SQLite error (a
        constraint the rows break, a table gone) raises CatalogCorruptError, and a
        schema changed under the engine ForeignSchemaError, both as sticky.
        """
        if self.read_only is not None:
            raise ReadOnlyError(f"catalog write {label!r} refused: opened read-only ({self.read_only})",
                                self.read_only)
        if self.failed is not None:
            kind = CatalogCorruptError if self.failed_corrupt else CatalogIOError
            raise kind(f"an earlier catalog write failed ({self.failed}); reopen the engine")
        c = self.conn
        self.before_write()
        deferred = grouped and self.synchronous == "FULL" and not durable
        level = "FULL" if durable else "NORMAL" if deferred else self.synchronous
        try:
            if self.level != level:  # left as the last transaction set it: grouped ones run in a row
                self.level = None  # unknown until the pragma returns
                c.execute(f"PRAGMA synchronous={level}")
                self.level = level
            c.execute("BEGIN IMMEDIATE")
            try:
                self._schema_unchanged(c)
                yield c
            except ForeignSchemaError as exc:
                self._rollback()
                self.failed, self.failed_corrupt = f"{label}: {exc}", True
                raise
            except BaseException:
                self._rollback()
                raise
            try:
                self.hook.before("commit", label, None)
            except BaseException:
                self._rollback()
                raise
            self.unsynced = True  # until the COMMIT returns: written, maybe not synced
            c.execute("COMMIT")
            self.unsynced = level != "FULL"
        except sqlite3.Error as exc:
            self._rollback()
            if self.closed:
                raise EngineClosedError(f"catalog write {label!r}: the catalog was closed") from exc
            self.failed = f"{label}: {exc}"
            if isinstance(exc, sqlite3.DatabaseError) and _io_error(exc):
                raise CatalogIOError(f"catalog write {label!r} failed: {exc}") from exc
            self.failed_corrupt = True
            raise CatalogCorruptError(
                f"catalog write {label!r} failed ({type(exc).__name__}: {exc}): the catalog's rows or "
                f"schema refuse the engine's statement; reopen the engine (`prefixstore audit {self.root}` "
                "says what is wrong)"
            ) from exc
        if deferred:
            self.wal.wrote()
        elif self.synchronous == "FULL":
            self.wal.all_durable()  # SQLite synced the log: every commit before is durable too
        self.hook.after("commit", label, None)

    def sync(self, seq: int) -> None:
        """Wait until commit ``seq`` of the log (``wal.written`` after it) and every one
        before it are durable: the group commit of ``txn(grouped=True)``. Call it without
        the engine lock. A failed sync raises CatalogIOError and makes the catalog refuse
        every later write. A no-op under ``synchronous=NORMAL``, which promises no commit."""
        if self.synchronous != "FULL":
            return
        try:
            self.wal.wait(seq)
        except CatalogIOError as exc:
            self.fail(str(exc))
            raise

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            with suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")

    def barrier(self) -> None:
        """Make every earlier commit durable (a no-op cost under FULL).

        Under ``synchronous=NORMAL`` the last commits may be lost at power loss; an
        effect that destroys data (unlink of a retired file) must not outrun them. A
        commit of its own (``barrier``, synced by SQLite) makes them durable, unless the
        last commit was synced already (``durable``, e.g. an evict's removal: ``unsynced``).
        """
        if self.synchronous == "FULL":
            self.sync(self.wal.written)  # the grouped commits not synced yet
            return
        if not self.unsynced:
            return
        with self.txn("barrier", durable=True) as c:
            c.execute("UPDATE meta SET value=value WHERE key='format'")

    # -- meta ------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, c: sqlite3.Connection, key: str, value: str) -> None:
        c.execute("INSERT OR REPLACE INTO meta VALUES(?, ?)", (key, value))

    # -- reads -----------------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The connection for reads outside a write transaction: an I/O error of SQLite
        in them (a failed page read can also look like corruption) raises CatalogIOError."""
        try:
            if not self.conn.in_transaction:  # inside a write transaction: checked at its start
                self._schema_unchanged(self.conn)
            yield self.conn
        except sqlite3.Error as exc:
            if self.closed:
                raise EngineClosedError("catalog read: the catalog was closed") from exc
            if isinstance(exc, sqlite3.DatabaseError) and _io_error(exc):
                raise CatalogIOError(f"catalog read failed: {exc}") from exc
            raise CatalogCorruptError(
                f"catalog read failed ({type(exc).__name__}: {exc}): the catalog's schema refuses the "
                f"engine's statement (`prefixstore audit {self.root}` says what is wrong)"
            ) from exc

    def fail(self, reason: str) -> None:
        """Refuse every later write until the engine is reopened (as a failed commit does)."""
        if self.failed is None:
            self.failed = reason

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self.reading() as c:
            return c.execute(sql, args).fetchall()

    def holds_rows(self) -> bool:
        """Whether any node, file or journal row exists."""
        return bool(self.query("SELECT EXISTS(SELECT 1 FROM nodes) OR EXISTS(SELECT 1 FROM files) "
                               "OR EXISTS(SELECT 1 FROM journal)")[0][0])

    def charged(self) -> int:
        return self.query("SELECT coalesce(sum(size), 0) FROM files")[0][0]

    # -- store, evict, lookup, restore, stats ------------------------------------------

    def live_sizes(self) -> dict[int, int]:
        """``{node id: bytes}`` of every node's live files."""
        return dict(self.query(
            "SELECT node, sum(size) FROM files WHERE status='live' AND node IS NOT NULL GROUP BY node"
        ))

    def node_rows(self) -> list[sqlite3.Row]:
        """Every node row (the index's fields), parents before children."""
        return self.query(
            "SELECT id, key, parent, start_block, end_block, digests, has_snapshot, state, "
            "generation, last_used, snap_used FROM nodes ORDER BY end_block, id"
        )

    def bytes_by_status(self) -> dict[str, int]:
        """``{file status: bytes}``."""
        return dict(self.query("SELECT status, coalesce(sum(size),0) FROM files GROUP BY status"))

    def damaged_bytes(self) -> int:
        """Bytes of the files of damaged nodes."""
        return self.query(
            "SELECT coalesce(sum(f.size),0) FROM files f JOIN nodes n ON f.node=n.id WHERE n.state='damaged'"
        )[0][0]

    def live_files(self, node_id: int) -> list[sqlite3.Row]:
        """(rank, name, size, checksum) of the live files of node ``node_id``."""
        return self.query(
            "SELECT rank, name, size, checksum FROM files WHERE node=? AND status='live'", (node_id,)
        )

    def live_files_of(self, node_ids: Sequence[int]) -> list[sqlite3.Row]:
        """(node, rank, name, size, checksum) of the live files of ``node_ids`` (at most 500)."""
        marks = ",".join("?" * len(node_ids))
        return self.query(
            "SELECT node, rank, name, size, checksum FROM files WHERE status='live' AND node IN "
            f"({marks})", tuple(node_ids)
        )

    def files_of(self, node_ids: Sequence[int]) -> list[sqlite3.Row]:
        """(rank, name, size) of every file of ``node_ids``."""
        marks = ",".join("?" * len(node_ids))
        return self.query(f"SELECT rank, name, size FROM files WHERE node IN ({marks})", tuple(node_ids))

    def txn_files(self, tid: int) -> list[sqlite3.Row]:
        """(rank, name, size) of the files transaction ``tid`` owns."""
        return self.query("SELECT rank, name, size FROM files WHERE txn=?", (tid,))

    def loose_garbage(self) -> list[sqlite3.Row]:
        """(rank, name, size) of garbage no transaction owns."""
        return self.query("SELECT rank, name, size FROM files WHERE status='garbage' AND txn IS NULL")

    def add_writing(self, c: sqlite3.Connection, tid: int, name: str, gen: int,
                    shards: Sequence[tuple[int, str]]) -> None:
        """Reserve ``name`` on every rank for ``tid``: ``shards`` is (size, checksum) per rank."""
        self.insert_writing_files(c, tid, [(r, name, gen, size, ck) for r, (size, ck) in enumerate(shards)])

    def retire_live(self, c: sqlite3.Connection, tid: int, node_id: int) -> list[tuple]:
        """Hand the files of ``node_id`` (each live) to ``tid`` as garbage; their (rank, name, size)."""
        return self.file_event(c, "retired", "node=?", (node_id,), sets="node=NULL, txn=?", values=(tid,))

    def refill_node(self, c: sqlite3.Connection, node_id: int, gen: int, has_snapshot: bool, now: int) -> None:
        """Make node ``node_id`` ready at generation ``gen``, used at ``now``."""
        self.node_event(c, "published", [node_id], sets="generation=?, has_snapshot=?, last_used=?, snap_used=?",
                        values=(gen, int(has_snapshot), now, now))

    def insert_node(self, c: sqlite3.Connection, key: bytes, parent: int | None, start: int, end: int,
                    digests: bytes, has_snapshot: bool, gen: int, now: int) -> int:
        """Add a ready node; its id."""
        cur = c.execute(
            "INSERT INTO nodes(key, parent, start_block, end_block, digests, has_snapshot, "
            "state, generation, last_used, snap_used) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key, parent, start, end, digests, int(has_snapshot), _inserted(NODE, "published"), gen, now, now),
        )
        return int(cur.lastrowid)

    def owned_event(self, c: sqlite3.Connection, event: str, tid: int) -> None:
        """Feed FILE's ``event`` to every file row ``tid`` owns (a transition's ``owned``
        event, e.g. a rollback's ``abandoned``: writing -> garbage)."""
        self.file_event(c, event, "txn=?", (tid,))

    def evict_nodes(self, c: sqlite3.Connection, tid: int, node_ids: Sequence[int]) -> list[tuple]:
        """Delete nodes ``node_ids`` (each after its children), handing their files to
        ``tid`` as garbage; their (rank, name, size)."""
        rows: list[tuple] = []
        for i in range(0, len(node_ids), _CHUNK):
            part = tuple(node_ids[i:i + _CHUNK])
            rows += self.file_event(c, "retired", f"node IN ({','.join('?' * len(part))})", part,
                                    sets="node=NULL, txn=?", values=(tid,))
        self.node_event(c, "removed", node_ids)
        return rows

    def settle_files(self, c: sqlite3.Connection, rows: Sequence[tuple], left: set[tuple[int, str]]) -> None:
        """After unlinking the garbage ``rows``: delete those gone (``unlinked``), release
        those ``left`` to loose garbage (``unlink_failed``)."""
        kept = [(r, name) for r, name, *_ in rows if (r, name) in left]
        self._files_event(c, "unlinked", [(r, name) for r, name, *_ in rows if (r, name) not in left])
        self._files_event(c, "unlink_failed", kept, sets="txn=NULL")

    def delete_files(self, c: sqlite3.Connection, rows: Sequence[tuple], left: set[tuple[int, str]]) -> None:
        """Delete the rows of the garbage ``rows`` not in ``left`` (``unlinked``)."""
        self._files_event(c, "unlinked", [(r, name) for r, name, *_ in rows if (r, name) not in left])

    def mark_damaged(self, c: sqlite3.Connection, node_id: int) -> None:
        self.node_event(c, "invalidated", [node_id])

    def set_recency(self, c: sqlite3.Connection, rows: Sequence[tuple[int, int, int]]) -> None:
        """``rows``: (last_used, snap_used, node id)."""
        c.executemany("UPDATE nodes SET last_used=?, snap_used=? WHERE id=?", rows)

    def journal(self) -> list[tuple[int, str, str, dict]]:
        rows = self.query("SELECT id, kind, state, payload FROM journal ORDER BY id")
        out = []
        for tid, kind, state, payload in rows:
            try:
                out.append((tid, kind, state, json.loads(payload)))
            except ValueError as exc:
                raise CatalogCorruptError(f"journal row {tid} has a corrupt payload") from exc
        return out

    # -- recovery, repair, replace, audit -------------------------------------------

    def node_rows_by_id(self) -> dict[int, tuple]:
        """Every node row (``structure.NODE_COLUMNS``), by id."""
        return {r[0]: tuple(r) for r in self.query(f"SELECT {NODE_COLUMNS} FROM nodes")}

    def file_rows(self) -> list[tuple]:
        """Every file row (``structure.FILE_COLUMNS``)."""
        return [tuple(r) for r in self.query(f"SELECT {FILE_COLUMNS} FROM files")]

    def file_names(self) -> list[sqlite3.Row]:
        """(rank, name) of every file row."""
        return self.query("SELECT rank, name FROM files")

    def node_generations(self) -> list[sqlite3.Row]:
        """(key, generation) of every node."""
        return self.query("SELECT key, generation FROM nodes")

    def node_fields(self) -> dict[int, tuple]:
        """Per node id: (parent, start, end, state, generation, has_snapshot)."""
        return {r[0]: tuple(r[1:]) for r in self.query(
            "SELECT id, parent, start_block, end_block, state, generation, has_snapshot FROM nodes")}

    def ready_node_ids(self) -> list[int]:
        return [r[0] for r in self.query("SELECT id FROM nodes WHERE state='ready'")]

    def files_of_txn(self, tid: int) -> list[sqlite3.Row]:
        """(rank, name, size) of every file row transaction ``tid`` owns."""
        return self.query("SELECT rank, name, size FROM files WHERE txn=?", (tid,))

    def unpublished_files_of_txn(self, tid: int) -> list[sqlite3.Row]:
        """(rank, name, size) of the files of ``tid`` that are not live."""
        return self.query("SELECT rank, name, size FROM files WHERE txn=? AND status!='live'", (tid,))

    def garbage_files(self) -> list[sqlite3.Row]:
        """(rank, name, size) of every garbage file row."""
        return self.query("SELECT rank, name, size FROM files WHERE status='garbage'")

    def all_live_files(self) -> list[sqlite3.Row]:
        """(node, rank, name, size, checksum) of every live file row."""
        return self.query("SELECT node, rank, name, size, checksum FROM files WHERE status='live'")

    def node_live_files(self) -> list[sqlite3.Row]:
        """(node, rank, name, size, checksum) of every live file row that names a node."""
        return self.query(
            "SELECT node, rank, name, size, checksum FROM files WHERE status='live' AND node IS NOT NULL")

    def live_file_rows(self, nid: int) -> dict[int, tuple[str, int, str]]:
        """Node ``nid``'s live files: rank -> (name, size, checksum)."""
        return {r: (name, size, ck) for r, name, size, ck in self.query(
            "SELECT rank, name, size, checksum FROM files WHERE node=? AND status='live'", (nid,))}

    def nodes_with_txn_files(self) -> list[int | None]:
        """The distinct nodes of file rows an unfinished transaction owns."""
        return [r[0] for r in self.query("SELECT DISTINCT node FROM files WHERE txn IS NOT NULL")]

    def max_generation(self, key_hex: str, ranks: int) -> int:
        """The highest generation of any file row (even garbage) of the key ``key_hex``
        on ranks ``0..ranks-1``; 0 when none."""
        marks = ",".join(str(r) for r in range(ranks))
        (top,) = self.query(
            f"SELECT coalesce(max(generation), 0) FROM files WHERE rank IN ({marks}) AND name >= ? AND name < ?",
            (f"{key_hex}-g", f"{key_hex}-h"),
        )[0]
        return int(top)

    def garbage_stray_writing(self, c: sqlite3.Connection) -> None:
        """Every row that can be abandoned (``writing``) becomes garbage of no transaction."""
        self.file_event(c, "abandoned", "1", sets="txn=NULL", every=False)

    def set_node_generation(self, c: sqlite3.Connection, nid: int, gen: int) -> None:
        c.execute("UPDATE nodes SET generation=? WHERE id=?", (gen, nid))

    def attach_file(self, c: sqlite3.Connection, rank: int, name: str, nid: int, gen: int) -> None:
        """File ``rank``/``name`` becomes node ``nid``'s live file of generation ``gen``."""
        c.execute("UPDATE files SET status=?, node=?, txn=NULL, generation=? WHERE rank=? AND name=?",
                  (REPAIRED_LIVE, nid, gen, rank, name))

    def insert_live_file(self, c: sqlite3.Connection, rank: int, name: str, nid: int, gen: int,
                         size: int, checksum: str) -> None:
        c.execute("INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
                  "VALUES(?, ?, ?, ?, ?, ?, ?, NULL)", (rank, name, nid, gen, size, checksum, REPAIRED_LIVE))

    def set_file_size(self, c: sqlite3.Connection, rank: int, name: str, size: int) -> None:
        c.execute("UPDATE files SET size=? WHERE rank=? AND name=?", (size, rank, name))

    def set_file_sizes(self, c: sqlite3.Connection, sizes: Iterable[tuple[int, int, str]]) -> None:
        """Each (size, rank, name): that file row's size."""
        c.executemany("UPDATE files SET size=? WHERE rank=? AND name=?", sizes)

    def garbage_file(self, c: sqlite3.Connection, rank: int, name: str) -> None:
        """File ``rank``/``name`` becomes garbage of no node and no transaction."""
        c.execute("UPDATE files SET status=?, node=NULL, txn=NULL WHERE rank=? AND name=?",
                  (REPAIRED_GARBAGE, rank, name))

    def forget_file(self, c: sqlite3.Connection, rank: Any, name: Any) -> None:
        """Delete the file row (never the file): its rank or name may be of any type."""
        c.execute("DELETE FROM files WHERE rank IS ? AND name IS ?", (rank, name))

    def mark_nodes_damaged(self, c: sqlite3.Connection, ids: Iterable[int]) -> None:
        """Nodes ``ids`` (each ready) become damaged."""
        self.node_event(c, "invalidated", list(ids))

    def damage_node(self, c: sqlite3.Connection, nid: int) -> None:
        """Repair: node ``nid`` becomes damaged whatever its state (outside NODE's edges)."""
        c.execute("UPDATE nodes SET state=? WHERE id=?", (NODE.target("invalidated"), nid))

    def set_parent(self, c: sqlite3.Connection, nid: int, parent: int | None) -> None:
        c.execute("UPDATE nodes SET parent=? WHERE id=?", (parent, nid))

    def drop_nodes(self, c: sqlite3.Connection, ids: Sequence[int]) -> None:
        """Repair: delete nodes ``ids``, their files (whatever their status) becoming
        garbage of no node."""
        marks = ",".join("?" * len(ids))
        c.execute(f"UPDATE files SET status=?, node=NULL, txn=NULL WHERE node IN ({marks})",
                  (REPAIRED_GARBAGE, *ids))
        c.execute(f"UPDATE nodes SET parent=NULL WHERE id IN ({marks})", ids)
        c.execute(f"DELETE FROM nodes WHERE id IN ({marks})", ids)

    def release_txn_files(self, c: sqlite3.Connection, tid: int) -> None:
        """Transaction ``tid``'s files that can be abandoned (``writing``) become
        garbage; none stays its."""
        self.file_event(c, "abandoned", "txn=?", (tid,), every=False)
        c.execute("UPDATE files SET txn=NULL WHERE txn=?", (tid,))

    def insert_writing_files(self, c: sqlite3.Connection, tid: int,
                             rows: Iterable[tuple[int, str, int, int, str]]) -> None:
        """Each (rank, name, generation, size, checksum): a ``writing`` row of ``tid``."""
        c.executemany(
            "INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
            "VALUES(?, ?, NULL, ?, ?, ?, ?, ?)",
            [(*r, _inserted(FILE, "reserved"), tid) for r in rows],
        )

    def retire_node_files(self, c: sqlite3.Connection, ids: Sequence[int], tid: int) -> list[tuple[int, str, int]]:
        """The files of nodes ``ids`` (each live) become garbage held by ``tid``; returns
        their (rank, name, size)."""
        marks = ",".join("?" * len(ids))
        return self.file_event(c, "retired", f"node IN ({marks})", ids, sets="node=NULL, txn=?", values=(tid,))

    def rewrite_node(self, c: sqlite3.Connection, nid: int, fields: tuple) -> None:
        """Node ``nid`` becomes ready with ``fields`` = (parent, start, end, digests,
        has_snapshot, generation, last_used, snap_used)."""
        self.node_event(c, "published", [nid], sets="parent=?, start_block=?, end_block=?, digests=?, "
                        "has_snapshot=?, generation=?, last_used=?, snap_used=?", values=fields)

    def insert_node_fields(self, c: sqlite3.Connection, key: bytes, fields: tuple) -> int:
        """A new ready node of ``key`` with ``fields`` (as ``rewrite_node``); its id."""
        cur = c.execute("INSERT INTO nodes(parent, start_block, end_block, digests, has_snapshot, state, "
                        "generation, last_used, snap_used, key) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (*fields[:5], _inserted(NODE, "published"), *fields[5:], key))
        return int(cur.lastrowid)

    def publish_file(self, c: sqlite3.Connection, tid: int, name: str, nid: int) -> None:
        """``tid``'s files named ``name`` (at least one, each ``writing``) become node
        ``nid``'s live files."""
        if not self.file_event(c, "published", "txn=? AND name=?", (tid, name), sets="node=?, txn=NULL",
                               values=(nid,)):
            raise RowTransitionError(FILE.name, f"{name} of transaction {tid}", FILE.initial, "published")

    def delete_node(self, c: sqlite3.Connection, nid: int) -> None:
        self.node_event(c, "removed", [nid])

    # -- row events (statemachine/rows.py) ----------------------------------------------

    def file_event(self, c: sqlite3.Connection, event: str, where: str, args: Sequence[Any] = (), *,
                   sets: str = "", values: Sequence[Any] = (), every: bool = True) -> list[tuple[int, str, int]]:
        """Feed FILE's ``event`` to the file rows ``where`` selects, inside ``c``: each row
        in one of the event's source statuses (``FILE.sources``) takes its target status
        (deleted when that is final) and the columns ``sets`` (``"col=?, ..."`` with
        ``values``). With ``every``, a selected row in another status raises
        RowTransitionError naming it and nothing is written; without, it is left as it
        is. Returns the (rank, name, size) of the rows moved."""
        select, params = f"SELECT rank, name, size, status FROM files WHERE ({where})", tuple(args)
        if not every:  # only the rows that take the event are read
            sources = _sources(FILE, event)
            select, params = f"{select} AND status IN ({','.join('?' * len(sources))})", (*params, *sources)
        found = c.execute(select, params).fetchall()
        moved = self._move(c, FILE, event, where, tuple(args), sets, tuple(values), found, every)
        return [(r[0], r[1], r[2]) for r in moved]

    def node_event(self, c: sqlite3.Connection, event: str, ids: Sequence[int], *,
                   sets: str = "", values: Sequence[Any] = ()) -> None:
        """Feed NODE's ``event`` to nodes ``ids``, inside ``c``: each must be in one of its
        source states (a missing one is ``absent``), else RowTransitionError names it and
        nothing is written; each takes the target state (deleted when final) and ``sets``."""
        for i in range(0, len(ids), _CHUNK):
            part = tuple(ids[i:i + _CHUNK])
            where = f"id IN ({','.join('?' * len(part))})"
            found = c.execute(f"SELECT id, state FROM nodes WHERE {where}", part).fetchall()
            if missing := sorted(set(part) - {r[0] for r in found}):
                raise RowTransitionError(NODE.name, str(missing[0]), NODE.initial, event)
            self._move(c, NODE, event, where, part, sets, tuple(values), found, True)

    def _files_event(self, c: sqlite3.Connection, event: str, files: Sequence[tuple[int, str]],
                     sets: str = "") -> None:
        """``file_event`` on the rows of ``files`` ((rank, name) each), every one of them."""
        for i in range(0, len(files), _CHUNK):
            part = files[i:i + _CHUNK]
            # an OR of key lookups: SQLite scans the whole table for a row-value IN (VALUES ...)
            where = " OR ".join(["(rank=? AND name=?)"] * len(part))
            args = [x for f in part for x in f]
            if len(self.file_event(c, event, where, args, sets=sets)) != len(set(part)):
                gone = set(part) - {(r[0], r[1]) for r in c.execute(f"SELECT rank, name FROM files WHERE {where}",
                                                                    args)}
                r, name = min(gone)
                raise RowTransitionError(FILE.name, f"rank{r}/{name}", FILE.initial, event)

    @staticmethod
    def _move(c: sqlite3.Connection, m: Machine, event: str, where: str, args: tuple, sets: str,
              values: tuple, found: list, every: bool) -> list:
        """The write of a row event: ``found`` are the rows ``where`` selects (their
        state last); those in a source state of ``event`` move."""
        table, col = _ROWS[m.name]
        sources = _sources(m, event)
        moved = [r for r in found if r[-1] in sources]
        if every and len(moved) != len(found):
            bad = next(r for r in found if r[-1] not in sources)
            raise RowTransitionError(m.name, _row_name(m, bad), bad[-1], event)
        if not moved:
            return moved
        dst, marks = m.target(event), ",".join("?" * len(sources))
        if m.is_final(dst):
            sql, params = f"DELETE FROM {table} WHERE ({where}) AND {col} IN ({marks})", (*args, *sources)
        else:
            sql = f"UPDATE {table} SET {col}=?{', ' + sets if sets else ''} WHERE ({where}) AND {col} IN ({marks})"
            params = (dst, *values, *args, *sources)
        if (n := c.execute(sql, params).rowcount) != len(moved):
            raise CatalogCorruptError(f"{table}: event {event!r} moved {n} rows of the {len(moved)} it selected")
        return moved

    def close(self) -> None:
        self.closed = True
        with suppress(sqlite3.Error):
            self.conn.close()
        self.wal.close()


# SQLite primary result codes of the catalog's I/O: READONLY (the file could only be
# opened read-only), IOERR, CORRUPT (what a failed read of a page can look like), FULL,
# CANTOPEN, PROTOCOL.
_IO_CODES = frozenset({8, 10, 11, 13, 14, 15})


def _sources(m: Machine, event: str) -> list[str]:
    """The states of existing rows that take ``event`` (its ``WHERE state IN (...)``)."""
    if not (sources := sorted(m.sources(event) - {m.initial})):
        raise IllegalTransitionError(f"{m.name}: event {event!r} moves no existing row")
    return sources


def _inserted(m: Machine, event: str) -> str:
    """The state a new row takes by ``event`` (which an absent row must take)."""
    if m.initial not in m.sources(event):
        raise IllegalTransitionError(f"{m.name}: event {event!r} cannot add a row (no {m.initial} --{event}-->)")
    return m.target(event)


def _row_name(m: Machine, row: Sequence[Any]) -> str:
    """How an error names a row of ``m``'s table (``rank0/NAME``, a node's id)."""
    return f"rank{row[0]}/{row[1]}" if m is FILE else str(row[0])


def _io_error(exc: sqlite3.DatabaseError) -> bool:
    """An error of the catalog's I/O, not of a statement (a bad query stays as it is)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _IO_CODES


LOG_SUFFIXES = ("-wal", "-shm")


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def log_files(root: str) -> frozenset[str]:
    """Which of the catalog's log files (``LOG_SUFFIXES``) exist."""
    path = catalog_path(root)
    return frozenset(s for s in LOG_SUFFIXES if os.path.lexists(path + s))


def drop_empty_log(root: str, existed: frozenset[str]) -> None:
    """After an open that failed with no connection left: remove the log files it
    created (those not in ``existed``), when the write-ahead log is empty (it then
    holds no commit, and its index describes nothing)."""
    path = catalog_path(root)
    if _size(path + "-wal"):
        return
    for s in LOG_SUFFIXES:
        if s not in existed:
            with suppress(FileNotFoundError):
                if os.path.isfile(path + s) and not os.path.islink(path + s):
                    os.unlink(path + s)


def open_readonly(root: str) -> sqlite3.Connection:
    """A read-only connection that neither blocks nor disturbs a running engine."""
    path = catalog_path(root)
    if not os.path.exists(path):
        raise NotACacheError(f"{root}: no {CATALOG_NAME}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(f"catalog schema version {version} > {SCHEMA_VERSION}")
        marker = conn.execute("SELECT value FROM meta WHERE key='format'").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise NotACacheError(f"{root}: not a prefixstore catalog: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    if not marker or marker[0] != FORMAT_MARKER:
        conn.close()
        raise NotACacheError(f"{root}: catalog has no prefixstore format marker")
    return conn


@attrs.define(slots=True, eq=False, repr=False)
class CatalogView:
    """The reads of a catalog opened read-only without an engine (audit, ``prefixstore
    catalog``): ``conn`` is a ``sqlite3`` connection, or anything with its ``execute``
    (a sqlite-utils Database)."""

    conn: Any

    @contextmanager
    def snapshot(self) -> Iterator[CatalogView]:
        """One read transaction: every read inside sees one consistent snapshot."""
        self.conn.execute("BEGIN")
        try:
            yield self
        finally:
            self.conn.execute("COMMIT")

    def user_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def schema_objects(self) -> int:
        """How many objects the catalog's schema holds."""
        return self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]

    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())

    def node_rows(self) -> dict[int, tuple]:
        """Every node row (``structure.NODE_COLUMNS``), by id."""
        return {r[0]: tuple(r) for r in self.conn.execute(f"SELECT {NODE_COLUMNS} FROM nodes")}

    def file_rows(self) -> list[tuple]:
        """Every file row (``structure.FILE_COLUMNS``), by rank and name."""
        return [tuple(r) for r in self.conn.execute(f"SELECT {FILE_COLUMNS} FROM files ORDER BY rank, name")]

    def journal_rows(self) -> list[tuple]:
        """(id, kind, state, payload) of every journal row, by id; payloads unparsed."""
        return [tuple(r) for r in self.conn.execute("SELECT id, kind, state, payload FROM journal ORDER BY id")]

    def quick_check(self) -> str:
        """SQLite's ``quick_check`` verdict (``ok`` when the file is sound)."""
        return "; ".join(str(r[0]) for r in self.conn.execute("PRAGMA quick_check").fetchall())

    def node_states(self) -> dict[str, int]:
        """How many nodes are in each state."""
        return dict(self.conn.execute("SELECT state, count(*) FROM nodes GROUP BY state ORDER BY state"))

    def file_statuses(self) -> dict[str, tuple[int, int]]:
        """Per file status: (rows, bytes)."""
        return {s: (n, b) for s, n, b in self.conn.execute(
            "SELECT status, count(*), coalesce(sum(size), 0) FROM files GROUP BY status ORDER BY status")}
