"""The shared directory fsync under crashes and faults: stores whose shards are renamed
into one rank directory share its fsync, and what a returned success promises is
unchanged (the shard's entry durable before the store returns).

A child process (``tests/dirsync_workload.py``, FULL) is SIGKILLed before a directory
fsync shared by two stores and after it before they return, with a power loss too
(the catalog's log cut back to its last durability point, the rank directory's
entries to what its last returned fsync covered); and in a run whose second store
renames its shard while the first one's fsync runs. After each, recovery leaves the
audit clean and every store that returned success restores bit for bit. The plant
``dir-sync-stale-cover`` (a fsync begun before a rename taken as covering it) loses
an acknowledged store there, and the check says so. A failed directory fsync fails
every store that shared it, and none other (neither a store whose own fsync ran
meanwhile nor one after it).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import assert_restores, key_at, store_tokens, tokens_for
from dirsync_workload import HOLD_S, LAYOUT, dirsync_power_loss, hold_until, joining, stores
from group_workload import CAP
from test_crash_group import lose_power

import prefixstore
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.results import FAILED, STORED
from prefixstore.gpu.fileio import FaultHook

TESTS = os.path.dirname(os.path.abspath(__file__))

POINTS = ["dir-sync", "after-dir-sync", "after-dir-sync", "stale", "stale:dir-sync-stale-cover"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> list[dict]:
    """One killed run per entry of ``POINTS``."""
    base = str(tmp_path_factory.mktemp("dirsync"))
    here = os.path.dirname(os.path.dirname(prefixstore.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "dirsync_workload.py"), base, *POINTS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert len(runs) == len(POINTS)
    return runs


def recovered(root: str, point: str, acked: set[int]) -> tuple[set[int], list[str]]:
    """Reopen (recovery): the stores present, and what is wrong (an audit finding, an
    acknowledged store missing, a present one that does not restore bit for bit)."""
    todo = stores(point)
    with Engine.open(root, LAYOUT, CAP) as eng:
        rep = eng.audit()
        wrong = [] if rep.ok else [f"audit: {rep.to_dict()}"]
        present = {i for i, t in enumerate(todo) if key_at(t) in eng.index.by_key}
        wrong += [f"store {i} acknowledged, not in the catalog" for i in sorted(acked - present)]
        for i in sorted(present):  # acknowledged, or published before the kill: whole
            try:
                assert_restores(eng, todo[i], blocks=len(todo[i]) // 4)
            except AssertionError as exc:
                wrong.append(f"store {i} (acknowledged: {i in acked}) does not restore: {exc}")
    return present, wrong


@pytest.mark.parametrize(("n", "power"), [(0, True), (1, True), (2, False), (3, True)])
def test_a_kill_at_a_shared_directory_fsync_loses_no_acknowledged_store(killed, n, power):
    run = killed[n]
    assert run["last"] == "paused", run  # killed at its point, not after the workload
    if power:
        lose_power(run["root"])
        dirsync_power_loss(run["root"])
    present, wrong = recovered(run["root"], run["point"], set(run["acked"]))
    assert not wrong, wrong
    assert len(present) < len(stores(run["point"]))  # the kill did interrupt stores


def test_a_rename_taken_as_covered_by_a_fsync_begun_before_it_is_caught(killed):
    run = killed[4]
    assert run["plant"] == "dir-sync-stale-cover"
    assert run["last"] == "done"  # the second store returned without a fsync of its own
    lose_power(run["root"])
    dirsync_power_loss(run["root"])
    _, wrong = recovered(run["root"], run["point"], set(run["acked"]))
    assert wrong, "the planted stale cover lost nothing"


class FailGroupDirSync(FaultHook):
    """Holds the first armed fsync of the rank directory (store 0's) until the fsync of a
    round of ``group`` renames (gathered by ``JoiningSync``) ran meanwhile, and fails
    that one with EIO."""

    def __init__(self, group: int) -> None:
        self.group, self.armed, self.syncs, self.shared_by = group, False, 0, 0
        self.failed = threading.Event()
        self.eng: Engine | None = None

    def before(self, op, target, rank):
        if not self.armed or op != "fsync_dir":
            return
        self.syncs += 1
        dir_sync = self.eng.tiers.ranks[0].dir_sync
        rnd = dir_sync.leading.get(threading.get_ident())
        if self.syncs == 1:
            assert self.failed.wait(HOLD_S), "the group's fsync never ran"
        elif rnd is not None and rnd.size == self.group:
            self.shared_by = rnd.size
            self.failed.set()
            raise OSError(errno.EIO, "injected EIO on a shared directory fsync", target)


def test_a_failed_shared_directory_fsync_fails_every_store_of_its_group_and_none_other(tmp_path):
    group = 4
    todo = [tokens_for(900 + i, 2) for i in range(1 + group)]
    later = [tokens_for(950 + i, 2) for i in range(4)]
    hook = FailGroupDirSync(group)
    with Engine.open(str(tmp_path / "cache"), LAYOUT, CAP, hook=hook) as eng:
        dir_sync = joining(eng, join=1, linger_s=HOLD_S)
        hook.eng, hook.armed = eng, True
        results: dict[int, object] = {}

        def work(i: int) -> None:
            results[i] = store_tokens(eng, todo[i])

        first = threading.Thread(target=work, args=(0,))
        first.start()
        hold_until(lambda: hook.syncs == 1)  # the first store's fsync runs, held
        dir_sync.join = group  # the next renames gather into one round
        rest = [threading.Thread(target=work, args=(i,)) for i in range(1, len(todo))]
        for x in rest:
            x.start()
        for x in [first, *rest]:
            x.join()
        assert results[0].status == STORED, results[0]  # its own fsync, running meanwhile
        assert hook.shared_by == group  # the failed fsync was the one the others shared
        for i in range(1, len(todo)):
            assert results[i].status == FAILED and "injected EIO" in results[i].reason, results[i]
        hook.armed, dir_sync.join = False, 1
        outs: dict[int, object] = {}
        ts = [threading.Thread(target=lambda i=i: outs.__setitem__(i, store_tokens(eng, later[i])))
              for i in range(len(later))]
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        assert all(r.status == STORED for r in outs.values()), outs
        for t in [todo[0], *later]:
            assert_restores(eng, t, blocks=len(t) // 4)
        for t in todo[1:]:
            assert eng.lookup(Prefix.from_tokens(t, 4)).blocks != len(t) // 4
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
