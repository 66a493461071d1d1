"""The workload of tests/test_crash_group.py: concurrent stores that share group
commits, SIGKILLed at a chosen point of a group.

``python group_workload.py BASE POINT[:PLANT] ...`` imports once, then for each POINT
forks a child (``workload``) that opens an engine on ``BASE/<n>/cache`` (2 ranks,
``synchronous=FULL``) and runs ``THREADS`` threads of ``PER_THREAD`` stores each
(``stores()``); each sync of the catalog's log is slowed (``SLOW_SYNC_S``) so that the
stores commit meanwhile and share it. The thread that reaches POINT says ``paused``
and sleeps; the parent SIGKILLs the child then:

- ``sync``: inside a group commit, before the log sync of a group of at least two
  commits, one of them a publish;
- ``after-sync``: inside a group commit, after such a sync, before its stores return;
- ``between``: between two stores of one group: before the publish commit of a store
  while another store's publish is written and not yet synced.

A child says ``acked N`` once store N returned success; the parent prints, as JSON,
what each acknowledged. The power-loss model of the catalog: ``BASE/<n>/wal.durable``
holds the log as it was at its last durability point (a commit SQLite synced itself,
or the start of a log sync: what that sync makes durable), ``BASE/<n>/db.stat`` the
catalog file's size and mtime when the log was first saved (a checkpoint would change
it and void the model). PLANT names a plant of ``prefixstore.fuzz.plants`` active in
that child.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from conftest import make_layout, store_tokens, tokens_for  # noqa: E402

from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.engine.catalog import catalog_path  # noqa: E402
from prefixstore.engine.journal import GROUPED_COMMITS as GROUPED_RECLAIMS  # noqa: E402
from prefixstore.engine.store import GROUPED_COMMITS  # noqa: E402
from prefixstore.fuzz import plants  # noqa: E402
from prefixstore.gpu.fileio import FaultHook  # noqa: E402

THREADS, PER_THREAD = 6, 2
CAP = 16 << 20
SLOW_SYNC_S = 0.03
LAYOUT = make_layout(ranks=2)


def say(line: str) -> None:
    """One line to the parent in one write (threads print at once)."""
    os.write(1, (line + "\n").encode())


def stores() -> list[list[int]]:
    """The tokens of every store, by number (thread t stores t, t + THREADS, ...)."""
    return [tokens_for(500 + i, 2 + i % 3) for i in range(THREADS * PER_THREAD)]


class GroupPoint(FaultHook):
    """Saves the durable log at each durability point; stops at ``point``."""

    def __init__(self, root: str, point: str) -> None:
        self.point, self.wal = point, catalog_path(root) + "-wal"
        self.side = os.path.dirname(os.path.abspath(root))
        self.pending: list[str] = []  # grouped commits written since the last sync began
        self.group: list[str] = []  # those the running sync makes durable
        self.lock = threading.Lock()
        self.armed = False

    def save(self) -> None:
        tmp = os.path.join(self.side, "wal.tmp")
        shutil.copyfile(self.wal, tmp)
        os.replace(tmp, os.path.join(self.side, "wal.durable"))
        stat = os.path.join(self.side, "db.stat")
        if not os.path.exists(stat):
            st = os.stat(catalog_path(os.path.dirname(self.wal)))
            with open(stat, "w") as f:
                f.write(f"{st.st_size} {st.st_mtime_ns}")

    def stop(self) -> None:
        say("paused")
        time.sleep(600)

    def before(self, op, target, rank):
        if not self.armed:
            return
        if op == "commit" and target == "store.publish" and self.point == "between":
            with self.lock:
                unsynced = "store.publish" in self.pending
            if unsynced:
                self.stop()
        if op == "sync":
            with self.lock:
                self.group, self.pending = self.pending, []
            self.save()
            time.sleep(SLOW_SYNC_S)
            if self.point == "sync" and self.full_group():
                self.stop()

    def full_group(self) -> bool:
        """Whether the running sync covers two commits or more, a publish among them."""
        return len(self.group) >= 2 and "store.publish" in self.group

    def after(self, op, target, rank):
        if not self.armed:
            return
        if op == "commit":
            if target in GROUPED_COMMITS + GROUPED_RECLAIMS:
                with self.lock:
                    self.pending.append(target)
            else:
                self.save()
        elif op == "sync" and self.point == "after-sync" and self.full_group():
            self.stop()


def workload(root: str, point: str, plant_name: str | None) -> None:
    """The child: the stores, stopped at ``point`` (it never returns)."""
    plant = plants.get(plant_name) if plant_name else None
    hook = GroupPoint(root, point)
    cls = plant.engine_cls if plant is not None and plant.engine_cls else Engine
    with plant.active() if plant is not None else contextlib.nullcontext():
        eng = cls.open(root, LAYOUT, CAP, hook=hook)
        hook.save()
        hook.armed = True
        todo = stores()

        def work(t: int) -> None:
            for i in range(t, len(todo), THREADS):
                if store_tokens(eng, todo[i]).ok:
                    say(f"acked {i}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for x in threads:
            x.start()
        for x in threads:
            x.join()
        say("done")  # the point was never reached
        time.sleep(600)


def kill_at(root: str, point: str, plant: str | None, run=None) -> dict:
    """Fork the workload (``run``, default ``workload``) on ``root``, SIGKILL it once it
    says ``paused`` (or ``done``); what it said."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's runs past this
        try:
            os.close(r)
            os.dup2(w, 1)
            (run or workload)(root, point, plant)
        finally:
            os._exit(1)
    os.close(w)
    lines: list[str] = []
    with os.fdopen(r) as f:
        try:
            for line in f:
                lines.append(line.strip())
                if lines[-1] in ("paused", "done"):
                    break
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return {"acked": sorted(int(x.split()[1]) for x in lines if x.startswith("acked ")),
            "last": lines[-1] if lines else None}


def main() -> None:
    """``group_workload.py BASE POINT[:PLANT] ...``: one killed run per POINT, each in
    ``BASE/<n>/cache``; prints what each acknowledged, as JSON."""
    torch.set_num_threads(1)
    base, out = sys.argv[1], []
    for n, spec in enumerate(sys.argv[2:]):
        point, _, plant = spec.partition(":")
        root = os.path.join(base, str(n), "cache")
        os.makedirs(os.path.dirname(root))
        out.append({"root": root, "point": point, "plant": plant or None, **kill_at(root, point, plant or None)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
