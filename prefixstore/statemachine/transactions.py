"""The transactions of the engine: one transition table each.

Every mutation is a journaled transaction. The engine commits the state a
transaction reaches to the catalog *before* running the effects of the next step,
so recovery can resume it: forward when it had published, back otherwise.

STORE (also REPLACE: compact-replace, snapshot retirement, refill)::

    INTENT --durable--> PUBLISHED --retired--> DONE
      |                     \\--retire_failed--> DONE   (old files stay as garbage)
      +--failed / recover--> ROLLING_BACK --cleaned--> ROLLED_BACK
                                   \\--cleanup_failed--> ROLLED_BACK (files stay as garbage)

    INTENT      the journal row and the new files' rows ('writing', charged) are
                committed; files may or may not exist on some ranks.
    PUBLISHED   the rows point at the new generation, which is durable on every rank;
                the old generation (if any) is garbage owned by this transaction.
    ROLLING_BACK the new files' rows are garbage owned by this transaction.
    DONE / ROLLED_BACK  the journal row is gone.

EVICT::

    REMOVED --reclaimed--> DONE
       \\--reclaim_failed--> DONE (files stay as garbage, reclaimed later)

    REMOVED     the node row is gone (or its snapshot was retired) and its old files
                are garbage owned by this transaction, all in the same commit as the
                journal row: an evict that committed is never undone.

Loose garbage (rows with status 'garbage' and no transaction, left by a failed
cleanup) needs no journal row: the committed garbage rows are themselves the durable
intent. Reclaiming unlinks each file (a missing file is success) and deletes the rows
of the files it removed; it is idempotent, so recovery simply runs it again.
"""

from __future__ import annotations

from prefixstore.statemachine.machine import Machine

STORE = Machine(
    "store",
    initial="INTENT",
    finals={"DONE", "ROLLED_BACK"},
    edges=[
        ("INTENT", "durable", "PUBLISHED"),
        ("INTENT", "failed", "ROLLING_BACK"),
        ("INTENT", "recover", "ROLLING_BACK"),
        ("PUBLISHED", "retired", "DONE"),
        ("PUBLISHED", "retire_failed", "DONE"),
        ("ROLLING_BACK", "cleaned", "ROLLED_BACK"),
        ("ROLLING_BACK", "cleanup_failed", "ROLLED_BACK"),
    ],
)

# compact-replace shares the store's shape: new generation, swap, retire the old one.
REPLACE = Machine("replace", STORE.initial, STORE.finals, STORE.edges())

EVICT = Machine(
    "evict",
    initial="REMOVED",
    finals={"DONE"},
    edges=[
        ("REMOVED", "reclaimed", "DONE"),
        ("REMOVED", "reclaim_failed", "DONE"),
    ],
)

MACHINES: dict[str, Machine] = {m.name: m for m in (STORE, REPLACE, EVICT)}

# What recovery feeds an unfinished transaction found in the journal, by state.
RECOVERY_EVENT: dict[str, dict[str, str]] = {
    "store": {"INTENT": "recover", "PUBLISHED": "retired", "ROLLING_BACK": "cleaned"},
    "replace": {"INTENT": "recover", "PUBLISHED": "retired", "ROLLING_BACK": "cleaned"},
    "evict": {"REMOVED": "reclaimed"},
}


def recovery_direction(kind: str, state: str) -> str:
    """'forward' when the transaction had published (or removed), else 'back'."""
    return "forward" if state in ("PUBLISHED", "REMOVED") else "back"


# ---------------------------------------------------------------------------- COMPACT
# (issue 5) compact-replace: a chain of old rows replaced by a chain of new rows covering
# the same span (merge, split, republish, snapshot retirement). Driven by
# ``prefixstore.engine.replace``::
#
#     INTENT --durable--> PUBLISHED --retired--> DONE
#       |                     \--retire_failed--> DONE   (old files stay as garbage)
#       +--failed / stale / recover--> ROLLING_BACK --cleaned--> ROLLED_BACK
#                                            \--cleanup_failed--> ROLLED_BACK
#
#     INTENT     the journal row (use, old row ids, new rows) and the new generation's
#                file rows ('writing', charged) are committed; the old rows serve, fenced.
#     PUBLISHED  one commit swapped the rows: the new rows are in the catalog (a row
#                whose key survives keeps its id, so descendants keep their parent) and
#                every file of the old rows is garbage owned by this transaction.
#     'stale'    the old rows changed (or stayed pinned) while the new files were written.

COMPACT = Machine(
    "compact",
    initial="INTENT",
    finals={"DONE", "ROLLED_BACK"},
    edges=[
        ("INTENT", "durable", "PUBLISHED"),
        ("INTENT", "failed", "ROLLING_BACK"),
        ("INTENT", "stale", "ROLLING_BACK"),
        ("INTENT", "recover", "ROLLING_BACK"),
        ("PUBLISHED", "retired", "DONE"),
        ("PUBLISHED", "retire_failed", "DONE"),
        ("ROLLING_BACK", "cleaned", "ROLLED_BACK"),
        ("ROLLING_BACK", "cleanup_failed", "ROLLED_BACK"),
    ],
)
MACHINES[COMPACT.name] = COMPACT
RECOVERY_EVENT[COMPACT.name] = {"INTENT": "recover", "PUBLISHED": "retired", "ROLLING_BACK": "cleaned"}
