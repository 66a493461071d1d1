"""Ending a transaction whose flow failed with an unexpected error, by its table's
abort step (forward if it had published, back otherwise)."""

from __future__ import annotations

import attrs

from prefixstore.base.errors import CatalogIOError, SimulatedCrash
from prefixstore.engine import journal, loading
from prefixstore.engine.account import Account
from prefixstore.engine.counters import Counters
from prefixstore.engine.driver import Txn
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.index import Index
from prefixstore.engine.journal import Ledger
from prefixstore.engine.recency import Recency


@attrs.frozen(slots=True, eq=False)
class Abort:
    """What ending a failed transaction touches: the lock, the ledger, and the index
    (reloaded when the transaction had published)."""

    guard: CallGuard
    ledger: Ledger
    index: Index
    recency: Recency
    account: Account
    counters: Counters


def fail_txn(a: Abort, txn: Txn, exc: BaseException) -> None:
    """End ``txn`` after an unexpected error in its flow, by its table's abort step:
    forward if it had published, back otherwise. A simulated crash is left to recovery,
    and so is a transaction the catalog can no longer read or end (it then refuses
    writes until reopened); the caller raises ``exc`` either way, never this step's error."""
    if isinstance(exc, SimulatedCrash) or a.guard.closed:
        return
    cat = a.ledger.catalog
    with a.guard.lock:
        try:
            with cat.reading() as c:
                step = a.ledger.driver.abort(c, txn)
            if step is None:
                return
            journal.end(a.ledger, txn, step)
        except CatalogIOError as err:
            cat.fail(f"{txn.kind} transaction {txn.id} left to recovery: {err}")
            a.counters.inc("faults", "txn_left_to_recovery")
            return
        if step.direction == "forward":
            # the publish committed; make the index agree with it
            loading.load(a.index, cat, a.recency, a.account, keep=True)
    a.counters.inc("faults", "txn_error")
