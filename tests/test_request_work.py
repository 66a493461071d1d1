"""The work one store does that can be derived instead of asked again: its journal
row read once per commit, the disk's room measured once per decision. Each cached
value has a test here that fails when the cache goes stale."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest
from conftest import make_layout, store_tokens, tokens_for

from prefixstore.engine.api import Engine
from prefixstore.engine.driver import DEBUG_ENV
from prefixstore.gpu import diskroom
from prefixstore.gpu.diskroom import LOW_WATER, ROOM_FRESH_S, DiskRoom, free_bytes


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


class Statvfs:
    """Counts ``os.statvfs`` calls."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = os.statvfs

        def counted(path):
            self.calls += 1
            return real(path)

        monkeypatch.setattr(os, "statvfs", counted)


def test_a_store_measures_the_disk_once_for_its_space_step_and_intent(tmp_path, monkeypatch):
    """A store that evicts nothing measures the catalog's file system for its space
    step, its intent commit's reserve check takes that measure, and its publish's check
    measures again (the measure is spent): two ``statvfs``, not three. ``ROOM_FRESH_S``
    is raised so a loaded machine's preemption cannot age the measure."""
    monkeypatch.setattr(diskroom, "ROOM_FRESH_S", 60.0)
    with Engine.open(str(tmp_path / "c"), make_layout(), 1 << 30) as eng:
        store_tokens(eng, tokens_for(1, 2))
        eng.disk._measured = None  # nothing left from the first store
        count = Statvfs(monkeypatch)
        assert store_tokens(eng, tokens_for(2, 2)).status == "stored"
    assert count.calls == 2, count.calls


@pytest.fixture
def disk(small_fs):
    """A DiskRoom on a 16 MiB tmpfs of its own, holding its reserve, watching its root."""
    root = os.path.join(small_fs, "cache")
    os.mkdir(root)
    d = DiskRoom(root, reserve_bytes=1 << 20)
    d.bind([root], 1)
    assert d.restore() and d.held
    return d


def fill(path: str, leave: int) -> None:
    """Another writer takes the file system's free bytes down to ``leave``."""
    with open(path, "wb") as f:
        f.write(b"\xa5" * (free_bytes(path.rsplit("/", 1)[0]) - leave))
        f.flush()
        os.fsync(f.fileno())


def test_a_reserve_check_measures_again_once_the_last_measure_is_too_old(disk, small_fs):
    """The space step measured room; then another writer takes the disk below the
    low-water mark. A catalog write more than ``ROOM_FRESH_S`` later measures again and
    releases the reserve (a cache that kept the measure would keep it and let the
    commit find no byte)."""
    assert not disk.shortfall(4096, 1)
    fill(os.path.join(small_fs, "filler"), LOW_WATER // 2)
    time.sleep(2 * ROOM_FRESH_S)
    disk.before_catalog_write()
    assert not disk.held and disk.releases == 1


def test_a_measure_serves_one_reserve_check_only(disk, small_fs, monkeypatch):
    """A measure is spent by the check that takes it: the next check, however soon,
    measures again and sees the disk another writer filled meanwhile."""
    monkeypatch.setattr(diskroom, "ROOM_FRESH_S", 60.0)  # only the spending can make it measure
    assert not disk.shortfall(4096, 1)
    fill(os.path.join(small_fs, "filler"), LOW_WATER // 2)
    disk.before_catalog_write()  # takes the space step's measure: room, as it was
    assert disk.held
    disk.before_catalog_write()
    assert not disk.held and disk.releases == 1


def test_the_space_step_after_evicting_measures_the_disk_once_more_not_twice(tmp_path, monkeypatch):
    """A store that evicts measures the disk before (its shortfall) and once after the
    evictions (the verdict): no second measure right after the first."""
    layout = make_layout()
    with Engine.open(str(tmp_path / "c"), layout, 1 << 30) as eng:
        store_tokens(eng, tokens_for(1, 2))
        one = eng.account.charged
        eng.capacity = int(one * 1.5)  # the next store must evict the first
        calls = []
        real = eng.disk.shortfall
        monkeypatch.setattr(eng.disk, "shortfall", lambda *a: calls.append(a) or real(*a))
        assert store_tokens(eng, tokens_for(2, 2)).status == "stored"
        assert len(eng.index) == 1
    assert len(calls) == 2, calls
