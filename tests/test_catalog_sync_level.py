"""The catalog connection's ``PRAGMA synchronous`` per write transaction: a grouped
commit (written without a sync, made durable by the group's log sync) runs at NORMAL,
every other commit at the catalog's own level (FULL: SQLite syncs it), and a pragma is
issued only when the level changes, so grouped commits in a row issue none."""

from __future__ import annotations

import sqlite3

import pytest

from prefixstore.base.errors import CatalogCorruptError
from prefixstore.engine.catalog import Catalog

LEVELS = {0: "OFF", 1: "NORMAL", 2: "FULL"}


@pytest.fixture
def cat(tmp_path):
    c = Catalog(str(tmp_path))
    try:
        yield c
    finally:
        c.close()


def _level_inside(cat: Catalog, grouped: bool) -> tuple[str, list[str]]:
    """The level a write transaction ran at, and the pragmas it issued."""
    seen: list[str] = []
    cat.conn.set_trace_callback(seen.append)
    try:
        with cat.txn("test", grouped=grouped) as c:
            level = LEVELS[c.execute("PRAGMA synchronous").fetchone()[0]]
            c.execute("UPDATE meta SET value=value WHERE key='format'")
    finally:
        cat.conn.set_trace_callback(None)
    return level, [s for s in seen if s.startswith("PRAGMA synchronous=")]


def test_grouped_commits_in_a_row_set_the_level_once_and_others_run_at_full(cat):
    assert _level_inside(cat, grouped=True) == ("NORMAL", ["PRAGMA synchronous=NORMAL"])
    assert _level_inside(cat, grouped=True) == ("NORMAL", [])
    assert _level_inside(cat, grouped=False) == ("FULL", ["PRAGMA synchronous=FULL"])
    assert _level_inside(cat, grouped=False) == ("FULL", [])
    assert _level_inside(cat, grouped=True) == ("NORMAL", ["PRAGMA synchronous=NORMAL"])


def test_a_catalog_at_normal_never_changes_its_level(tmp_path):
    cat = Catalog(str(tmp_path), synchronous="NORMAL")
    try:
        assert _level_inside(cat, grouped=True) == ("NORMAL", [])
        assert _level_inside(cat, grouped=False) == ("NORMAL", [])
    finally:
        cat.close()


def test_a_failed_pragma_leaves_the_level_unknown_and_the_catalog_refusing_writes(cat):
    class Refusing:
        """The connection, refusing the pragma that would make the next commit synced."""

        def __init__(self, conn):
            self.conn = conn

        def execute(self, sql, *args):
            if sql == "PRAGMA synchronous=FULL":
                raise sqlite3.OperationalError("refused")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.conn, name)

    _level_inside(cat, grouped=True)
    real, cat.conn = cat.conn, Refusing(cat.conn)
    try:
        with pytest.raises(CatalogCorruptError), cat.txn("test"):
            pytest.fail("the transaction ran without its level set")
    finally:
        cat.conn = real
    assert cat.level is None and cat.failed is not None and not real.in_transaction


def test_under_normal_a_durable_commit_is_synced_and_a_barrier_after_it_writes_nothing(tmp_path):
    cat = Catalog(str(tmp_path), synchronous="NORMAL")
    seen: list[str] = []
    try:
        with cat.txn("evict.remove", durable=True) as c:
            assert LEVELS[c.execute("PRAGMA synchronous").fetchone()[0]] == "FULL"
            c.execute("UPDATE meta SET value=value WHERE key='format'")
        cat.conn.set_trace_callback(seen.append)
        cat.barrier()  # the last commit was synced: nothing to make durable
        assert seen == []
        assert _level_inside(cat, grouped=False) == ("NORMAL", ["PRAGMA synchronous=NORMAL"])
        cat.conn.set_trace_callback(seen.append)
        cat.barrier()  # a commit at NORMAL since: the barrier's own synced commit
        assert "COMMIT" in seen and "PRAGMA synchronous=FULL" in seen
    finally:
        cat.conn.set_trace_callback(None)
        cat.close()
