"""The journal's side of the engine: the driver it is built with and the output
handlers of every transaction kind.

No state is written here by hand: ``begin`` / ``fire`` go through the engine's
``Driver`` (``engine/driver.py``), which reads the current state from the journal
row and takes the next state and its outputs from the transaction's table. The
handlers are the tables' outputs: ``retire_old`` / ``reclaim`` unlink the files a
published transaction owns (the retired generation, the evicted nodes' files) and
``clean_up`` unlinks the files of one that rolled back; each then fires the event
that ends its state (or its failure sibling when a file stays).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixstore.engine import lifecycle
from prefixstore.engine.driver import Driver, Handler, Txn
from prefixstore.gpu.tier import Capability, has
from prefixstore.statemachine.machine import Step

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def build(eng: Engine) -> Driver:
    """The engine's driver (at open): its handlers, checked against the tables now."""
    return Driver(handlers=handlers(eng), ranks=eng.layout.ranks, durable=lambda r, name: durable(eng, r, name))


def handlers(eng: Engine) -> dict[str, Mapping[str, Handler]]:
    """The output handlers per transaction kind."""
    def retire(txn: Txn) -> None:
        unlink_owned(eng, txn, "retired", "retire_failed", barrier=True)

    def clean_up(txn: Txn) -> None:
        unlink_owned(eng, txn, "cleaned", "cleanup_failed", barrier=False)

    def reclaim(txn: Txn) -> None:
        unlink_owned(eng, txn, "reclaimed", "reclaim_failed", barrier=True)

    replacing = {"retire_old": retire, "clean_up": clean_up}
    return {"store": replacing, "compact": replacing, "evict": {"reclaim": reclaim}}


def durable(eng: Engine, rank: int, name: str) -> bool | None:
    """Whether rank ``rank`` holds ``name`` durably; None when its tier cannot tell."""
    tier = eng.tiers.ranks[rank]
    return tier.durable(name) if has(tier, Capability.REPORTS_DURABILITY) else None


def begin(eng: Engine, c: Any, kind: str, payload: dict[str, Any], rows=None) -> Txn:
    """Record a new ``kind`` transaction in its table's initial state, inside ``c``;
    ``rows(tid)`` writes the rows it owns from the start, in the same commit."""
    return eng.driver.begin(c, kind, payload, rows)


def fire(eng: Engine, c: Any, txn: Txn, event: str) -> tuple[str, ...]:
    """Feed ``event`` to ``txn`` inside ``c`` (the commit's last statement); its outputs."""
    return eng.driver.fire(c, txn, event)


def run(eng: Engine, txn: Txn, outputs: tuple[str, ...]) -> None:
    """Run ``outputs`` of ``txn`` (after the commit that fired them)."""
    eng.driver.run_outputs(txn, outputs)


def unlink_owned(eng: Engine, txn: Txn, ok: str, failed: str, *, barrier: bool) -> None:
    """Unlink the files ``txn`` owns, drop their rows (one left stays as loose
    garbage) and fire ``ok`` (``failed`` when one stayed); the old generation of a
    published transaction is unlinked only after its commit is durable (``barrier``)."""
    rows = eng.catalog.files_of_txn(txn.id)
    if barrier:
        eng.catalog.barrier()
    left = unlink_rows(eng, rows)
    with eng.catalog.txn(f"{txn.kind}.{ok}") as c:
        eng.catalog.settle_files(c, rows, left)
        outs = eng.driver.fire(c, txn, failed if left else ok)
    eng.account.charged -= unlinked_bytes(rows, left)
    eng.driver.run_outputs(txn, outs)


def rollback(eng: Engine, txn: Txn, event: str) -> None:
    """End a transaction that had not published: ``event`` takes it from INTENT to
    ROLLING_BACK (its new rows abandoned in the same commit), then ``clean_up`` runs."""
    with eng.catalog.txn(f"{txn.kind}.rollback") as c:
        eng.catalog.abandon_txn_files(c, txn.id)
        outs = eng.driver.fire(c, txn, event)
    eng.driver.run_outputs(txn, outs)


def end(eng: Engine, txn: Txn, step: Step) -> None:
    """End ``txn`` by a recovery or abort ``step``: fire its event (a rollback from
    INTENT), or re-run its state's outputs."""
    if step.fire is not None:
        rollback(eng, txn, step.fire)
    else:
        eng.driver.run_outputs(txn, step.outputs)


def drop_rows(eng: Engine, c: Any, tids) -> None:
    """Delete the journal rows ``tids`` inside ``c`` (repair: rows no table can read)."""
    for tid in tids:
        eng.driver.journal.delete(c, tid)


def unlink_rows(eng: Engine, rows) -> set[tuple[int, str]]:
    """Remove the files of ``rows`` on their ranks; return those that failed."""
    lifecycle.check_writable(eng, "unlink")
    failed: set[tuple[int, str]] = set()
    touched: set[int] = set()
    for r, name, _size in rows:
        try:
            eng.tiers.ranks[r].remove(name)
            touched.add(r)
        except OSError:
            eng.counters.inc("faults", "unlink")
            failed.add((r, name))
            eng.account.garbage_hint = True
    for r in sorted(touched):
        try:
            eng.tiers.ranks[r].sync_dir()
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
    eng.account.charged -= unlinked_bytes(rows, left)


def unlinked_bytes(rows, left: set[tuple[int, str]]) -> int:
    """The bytes of ``rows`` whose files are gone (not in ``left``)."""
    return sum(size for r, name, size in rows if (r, name) not in left)

