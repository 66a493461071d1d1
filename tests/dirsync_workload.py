"""The workload of tests/test_crash_dirsync.py: concurrent stores that share the rank
directory's fsync, SIGKILLed at a chosen point of a shared fsync.

``python dirsync_workload.py BASE POINT[:PLANT] ...`` runs, for each POINT, a child
(``workload``) on ``BASE/<n>/cache`` (one rank, so that the stores' shard writes run on
their own threads, ``synchronous=FULL``) with group_workload's model of the catalog's
log; each fsync of the rank directory is slowed (``SLOW_DIR_SYNC_S``), and a store
that renamed its shard lingers briefly for another rename to join its round
(``JoiningSync``), so that fsyncs are shared and run at once. The parent SIGKILLs the
child once it says ``paused`` or ``done``:

- ``dir-sync`` (6 threads, 12 stores): before a directory fsync shared by two renames
  or more;
- ``after-dir-sync`` (same): after such a fsync, before its stores return;
- ``stale`` (2 threads, 2 stores): the second store starts once the first directory
  fsync began, which is held, after it ran, until that store renamed its shard and
  either began its own directory fsync (the child stops there) or waits behind the
  first one (it then returns without a fsync of its own; the child says ``done``).

The power-loss model of the rank directory: ``BASE/<n>/rank0.durable`` lists the
directory's entries at the start of the latest-begun directory fsync that returned
(what that fsync made durable, and every one begun before it: ``dirsync_power_loss``
undoes every later entry).
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

from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.fuzz import plants  # noqa: E402
from prefixstore.gpu.ranks import SHARD_SUFFIX, TMP_SUFFIX, rank_dir_name  # noqa: E402
from prefixstore.gpu.sharedsync import SharedSync  # noqa: E402

LAYOUT = make_layout(ranks=1)
SLOW_DIR_SYNC_S = 0.02
HOLD_S = 60.0
"""How long the ``stale`` point holds the first fsync for the other store's rename."""


def hold_until(cond, limit_s: float = HOLD_S) -> None:
    """Return once ``cond()`` holds (checked every millisecond); AssertionError after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.001)


def threads_of(point: str) -> tuple[int, int]:
    """(threads, stores per thread) of ``point``."""
    return (2, 1) if point == "stale" else (6, 2)


def stores(point: str) -> list[list[int]]:
    """The tokens of every store of ``point``'s run, by number."""
    threads, per = threads_of(point)
    return [tokens_for(700 + i, 2 + i % 3) for i in range(threads * per)]


class JoiningSync(SharedSync):
    """SharedSync whose changer lingers after joining the open round until ``join``
    changes joined it (or ``linger_s`` passed): the interleaving that sharing needs
    (another thread's rename between one's rename and its wait), rare in a process this
    small, made likely. ``leading`` maps a thread to the round it leads."""

    join = 2
    linger_s = 0.05

    def changed(self):
        rnd = super().changed()
        deadline = time.monotonic() + self.linger_s
        while rnd is self.open and rnd.size < self.join and time.monotonic() < deadline:
            time.sleep(0.001)
        return rnd

    def wait(self, rnd) -> None:
        with self.cv:
            if rnd is self.open:
                self.leading[threading.get_ident()] = rnd
        super().wait(rnd)


def joining(eng: Engine, join: int = 2, linger_s: float = 0.05) -> JoiningSync:
    """Replace rank 0's directory sync by a ``JoiningSync`` (before any store)."""
    rank = eng.tiers.ranks[0]
    js = JoiningSync(rank.dir_sync.run, rank.dir_sync.what)
    js.join, js.linger_s, js.leading = join, linger_s, {}
    rank.dir_sync = js
    return js


class DirPoint(GroupPoint):
    """GroupPoint's durable log, plus the rank directory's durable listing; stops at
    ``point`` (GroupPoint's own points never match these)."""

    def __init__(self, root: str, point: str) -> None:
        super().__init__(root, point)
        self.dir = os.path.join(root, rank_dir_name(0))
        self.eng: Engine | None = None
        self.started = 0
        """Directory fsyncs begun (each numbered by its order)."""
        self.saved = -1
        """The number of the fsync whose listing ``rank0.durable`` holds."""
        self.listings: dict[int, tuple[int, list[str]]] = {}
        """By thread: the number of the fsync it runs, and the entries when it began."""
        self.began = threading.Event()
        """Set at the first directory fsync (the ``stale`` point's second store waits for it)."""

    def save_listing(self, names: list[str]) -> None:
        tmp = os.path.join(self.side, "rank0.tmp")
        with open(tmp, "w") as f:
            json.dump(names, f)
        os.replace(tmp, os.path.join(self.side, "rank0.durable"))

    def shared(self) -> bool:
        """Whether the directory fsync this thread runs covers two renames or more."""
        rnd = getattr(self.eng.tiers.ranks[0].dir_sync, "leading", {}).get(threading.get_ident())
        return rnd is not None and rnd.size >= 2

    def before(self, op, target, rank):
        super().before(op, target, rank)
        if not self.armed or op != "fsync_dir" or target != self.dir:
            return
        with self.lock:
            n = self.started
            self.started += 1
            self.listings[threading.get_ident()] = (n, sorted(os.listdir(self.dir)))
        if self.point == "stale" and n >= 1:
            self.stop()  # the other store's own directory fsync
        self.began.set()
        time.sleep(SLOW_DIR_SYNC_S)
        if self.point == "dir-sync" and self.shared():
            self.stop()

    def after(self, op, target, rank):
        super().after(op, target, rank)
        if not self.armed or op != "fsync_dir" or target != self.dir:
            return
        n, listing = self.listings.pop(threading.get_ident())
        with self.lock:  # the fsync returned: what it covered is durable
            if n > self.saved:  # else one begun after it returned first, and covers more
                self.saved = n
                self.save_listing(listing)
        if self.point == "after-dir-sync" and self.shared():
            self.stop()
        if self.point == "stale" and n == 0:  # the other store renames meanwhile, then syncs or waits
            ds = self.eng.tiers.ranks[0].dir_sync
            hold_until(lambda: ds.changes >= 2 and (ds.waiting >= 1 or self.started >= 2))


def workload(root: str, point: str, plant_name: str | None) -> None:
    """The child: the stores of ``point``, stopped there (it never returns)."""
    plant = plants.get(plant_name) if plant_name else None
    hook = DirPoint(root, point)
    with plant.active() if plant is not None else contextlib.nullcontext():
        eng = Engine.open(root, LAYOUT, CAP, hook=hook)
        hook.eng = eng
        if point != "stale":
            joining(eng)
        hook.save()
        hook.save_listing(sorted(os.listdir(hook.dir)))
        hook.armed = True
        todo = stores(point)
        threads = threads_of(point)[0]

        def work(t: int) -> None:
            if point == "stale" and t == 1:
                hook.began.wait(HOLD_S)  # its whole store runs while the first fsync is held
            for i in range(t, len(todo), threads):
                if store_tokens(eng, todo[i]).ok:
                    say(f"acked {i}")

        ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        say("done")  # the point was never reached
        time.sleep(600)


def dirsync_power_loss(root: str) -> None:
    """The rank directory as a power loss leaves it: a shard renamed in since its
    durable listing is back under its temporary name, any other new entry gone."""
    side = os.path.dirname(os.path.abspath(root))
    with open(os.path.join(side, "rank0.durable")) as f:
        durable = set(json.load(f))
    d = os.path.join(root, rank_dir_name(0))
    for name in sorted(set(os.listdir(d)) - durable):
        path = os.path.join(d, name)
        if name.endswith(SHARD_SUFFIX) and name + TMP_SUFFIX in durable:
            os.rename(path, path + TMP_SUFFIX)
        else:
            os.unlink(path)


def main() -> None:
    """``dirsync_workload.py BASE POINT[:PLANT] ...``: one killed run per POINT, each in
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
