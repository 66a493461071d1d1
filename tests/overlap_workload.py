"""The workload of tests/test_crash_overlap.py: a store written beside its intent's
log sync (``store.written_beside_intent``), SIGKILLed while that sync is held.

``python overlap_workload.py BASE POINT[:PLANT] ...`` runs, for each POINT, a child
(``workload``) on ``BASE/<n>/cache`` (2 ranks, ``synchronous=FULL``, every store
gated: ``staging.GATED_MIN_BYTES`` is lowered to 0 so the small test stores take
that path) with group_workload's model of the catalog's log. The child's one store
commits its intent; the intent's log sync is held, before group_workload saves the log
(so a power loss takes the intent back), until every rank wrote and fsynced its
shard's temporary and ``GATE_S`` passed (a rank that does not wait for the sync
renames meanwhile); the child then says ``paused`` and the parent SIGKILLs it.
POINT is ``intent-sync`` (the only one: the power loss is the test's choice).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from conftest import make_layout, store_tokens, tokens_for  # noqa: E402
from group_workload import CAP, GroupPoint, kill_at, say  # noqa: E402

from prefixstore.engine import staging  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.fuzz import plants  # noqa: E402
from prefixstore.gpu.ranks import TMP_SUFFIX  # noqa: E402

LAYOUT = make_layout(ranks=2)
GATE_S = 0.2
"""How long the held sync waits, once every temporary is fsynced, for a rename it must not see."""


def hold_until(cond, limit_s: float = 60.0) -> None:
    """Return once ``cond()`` holds (checked every millisecond); AssertionError after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.001)


def the_store() -> list[int]:
    return tokens_for(800, 3)


class IntentPoint(GroupPoint):
    """GroupPoint, holding the first armed log sync (the intent's) as described above;
    ``fail`` raises EIO from it instead of stopping (the in-process test)."""

    def __init__(self, root: str, point: str, fail: bool = False) -> None:
        super().__init__(root, point)
        self.fail = fail
        self.temps = 0
        """Temporaries fsynced since armed."""
        self.renames = 0
        self.held = False
        self.count = threading.Lock()

    def before(self, op, target, rank):
        if self.armed and op == "sync" and not self.held:
            self.held = True
            hold_until(lambda: self.temps >= LAYOUT.ranks)
            time.sleep(GATE_S)
            if self.fail:
                raise OSError(5, "injected EIO on the intent's log sync", target)
            self.stop()  # before the log is saved: the intent is not durable
        super().before(op, target, rank)

    def after(self, op, target, rank):
        super().after(op, target, rank)
        if not self.armed:
            return
        with self.count:
            if op == "fsync" and target.endswith(TMP_SUFFIX):
                self.temps += 1
            elif op == "rename":
                self.renames += 1


def workload(root: str, point: str, plant_name: str | None) -> None:
    """The child: the store, stopped at ``point`` (it never returns)."""
    plant = plants.get(plant_name) if plant_name else None
    staging.GATED_MIN_BYTES = 0
    hook = IntentPoint(root, point)
    with plant.active() if plant is not None else contextlib.nullcontext():
        eng = Engine.open(root, LAYOUT, CAP, hook=hook)
        hook.save()
        hook.armed = True
        if store_tokens(eng, the_store()).ok:
            say("acked 0")
        say("done")  # the point was never reached
        time.sleep(600)


def main() -> None:
    """``overlap_workload.py BASE POINT[:PLANT] ...``: one killed run per POINT, each in
    ``BASE/<n>/cache``; prints what each acknowledged, as JSON."""
    torch.set_num_threads(1)
    base, out = sys.argv[1], []
    for n, spec in enumerate(sys.argv[2:]):
        point, _, plant = spec.partition(":")
        root = os.path.join(base, str(n), "cache")
        os.makedirs(os.path.dirname(root))
        out.append({"root": root, "point": point, "plant": plant or None,
                    **kill_at(root, point, plant or None, workload)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
