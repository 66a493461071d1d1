"""The work one store does that can be derived instead of asked again: its journal
row read once per commit, the disk's room measured once per decision. Each cached
value has a test here that fails when the cache goes stale."""

from __future__ import annotations

import sqlite3

from conftest import make_layout, store_tokens, tokens_for

from prefixstore.engine.api import Engine
from prefixstore.engine.driver import DEBUG_ENV


def statements(conn: sqlite3.Connection, out: list[str]) -> None:
    conn.set_trace_callback(out.append)


def test_a_publish_reads_its_journal_row_once_and_writes_it_once(tmp_path, monkeypatch):
    """A store with nothing to retire goes INTENT -> PUBLISHED -> DONE in its publish
    commit: one read of its journal row, then its delete (before: a read, an update
    to PUBLISHED, a second read, the delete)."""
    monkeypatch.setenv(DEBUG_ENV, "0")  # the debug checks read the row again on purpose
    with Engine.open(str(tmp_path / "c"), make_layout(), 1 << 30) as eng:
        store_tokens(eng, tokens_for(1, 2))
        sql: list[str] = []
        statements(eng.ledger.catalog.conn, sql)
        assert store_tokens(eng, tokens_for(2, 2)).status == "stored"
        eng.ledger.catalog.conn.set_trace_callback(None)
    reads = [s for s in sql if s.startswith("SELECT kind, state FROM journal")]
    writes = [s.split(" WHERE")[0] for s in sql if s.startswith(("UPDATE journal", "DELETE FROM journal"))]
    assert len(reads) == 1 and writes == ["DELETE FROM journal"], sql


def test_a_refill_still_stops_in_published_until_its_old_files_go(tmp_path, monkeypatch):
    """A refill (an old generation to retire) publishes into PUBLISHED and ends in the
    retire's own commit: the one-read publish changes nothing there."""
    monkeypatch.setenv(DEBUG_ENV, "0")
    toks = tokens_for(3, 2)
    with Engine.open(str(tmp_path / "c"), make_layout(), 1 << 30) as eng:
        store_tokens(eng, toks)
        node = next(iter(eng.index))
        node.state = "damaged"  # a refill is a store of a damaged row's checkpoint
        eng.ledger.catalog.conn.execute("UPDATE nodes SET state='damaged' WHERE id=?", (node.id,))
        sql: list[str] = []
        statements(eng.ledger.catalog.conn, sql)
        assert store_tokens(eng, toks).status == "refilled"
        eng.ledger.catalog.conn.set_trace_callback(None)
        assert node.generation == 2 and eng.audit().ok
    writes = [s.split(" WHERE")[0] for s in sql if s.startswith(("UPDATE journal", "DELETE FROM journal"))]
    assert writes == ["UPDATE journal SET state='PUBLISHED'", "DELETE FROM journal"], sql
