"""The journal: begin a transaction, advance it along its table, end it forward
(retired files unlinked) or back (its new files unlinked)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from prefixstore.engine import lifecycle
from prefixstore.statemachine.transactions import MACHINES

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def begin(eng: Engine, c, kind: str, payload: dict[str, Any]) -> int:
    """Record a new transaction of ``kind`` in its initial state; its id."""
    state = MACHINES[kind].initial
    cur = c.execute(
        "INSERT INTO journal(kind, state, payload) VALUES(?, ?, ?)", (kind, state, json.dumps(payload))
    )
    return int(cur.lastrowid)


def advance(eng: Engine, c, tid: int, kind: str, state: str, event: str) -> str:
    """Move transaction ``tid`` along its table inside the open catalog txn ``c``."""
    nxt = MACHINES[kind].next(state, event)
    if MACHINES[kind].is_final(nxt):
        c.execute("DELETE FROM journal WHERE id=?", (tid,))
    else:
        c.execute("UPDATE journal SET state=? WHERE id=?", (nxt, tid))
    return nxt


def finish_retire(eng: Engine, tid: int, kind: str, rows) -> None:
    """Unlink a published transaction's retired files, then end it."""
    eng.catalog.barrier()
    left = unlink_rows(eng, rows)
    with eng.catalog.txn(f"{kind}.retired") as c:
        eng.catalog.settle_files(c, rows, left)
        if kind == "evict":
            advance(eng, c, tid, kind, "REMOVED", "reclaim_failed" if left else "reclaimed")
        else:
            advance(eng, c, tid, kind, "PUBLISHED", "retire_failed" if left else "retired")
    eng._charged -= unlinked_bytes(rows, left)


def rollback(eng: Engine, tid: int, kind: str, state: str, event: str) -> None:
    """Drive a transaction that had not published back to its previous record."""
    if state == "INTENT":
        with eng.catalog.txn(f"{kind}.rollback") as c:
            eng.catalog.garbage_txn_files(c, tid)
            state = advance(eng, c, tid, kind, state, event)
    rows = eng.catalog.txn_files(tid)
    left = unlink_rows(eng, rows)
    with eng.catalog.txn(f"{kind}.cleaned") as c:
        eng.catalog.settle_files(c, rows, left)
        advance(eng, c, tid, kind, state, "cleanup_failed" if left else "cleaned")
    eng._charged -= unlinked_bytes(rows, left)


def unlink_rows(eng: Engine, rows) -> set[tuple[int, str]]:
    """Remove the files of ``rows`` on their ranks; return those that failed."""
    lifecycle.check_writable(eng, "unlink")
    failed: set[tuple[int, str]] = set()
    touched: set[int] = set()
    for r, name, _size in rows:
        try:
            eng.ranks[r].remove(name)
            touched.add(r)
        except OSError:
            eng.counters.inc("faults", "unlink")
            failed.add((r, name))
            eng._garbage_hint = True
    for r in sorted(touched):
        try:
            eng.ranks[r].sync_dir()
        except OSError:
            eng.counters.inc("faults", "fsync_dir")
    return failed


def reclaim_rows(eng: Engine, tid: int | None, rows) -> None:
    """Unlink garbage ``rows`` and delete the rows of those gone."""
    if not rows:
        return
    eng.catalog.barrier()
    left = unlink_rows(eng, rows)
    with eng.catalog.txn("reclaim") as c:
        eng.catalog.delete_files(c, rows, left)
    eng._charged -= unlinked_bytes(rows, left)


def unlinked_bytes(rows, left: set[tuple[int, str]]) -> int:
    """The bytes of ``rows`` whose files are gone (not in ``left``)."""
    return sum(size for r, name, size in rows if (r, name) not in left)
