"""Group commit under crashes and faults: concurrent stores share one sync of the
catalog's log, and what a returned success promises is unchanged.

A child process (``tests/group_workload.py``: 6 threads, 12 stores, 2 ranks, FULL) is
SIGKILLed inside a group commit (before and after its log sync) and between two stores
of one group (one's publish written, the next one's about to be); with a power loss
too (the log cut back to its last durability point, as the fault file system does to
unsynced file bytes). After each, recovery leaves the audit clean, the journal empty,
and every store that returned success restores bit for bit. The same kill with the
plant ``ack-before-group-sync`` loses an acknowledged store, and the check says so.
A write fault on one store of a group fails that store only.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import assert_restores, key_at, store_tokens
from group_workload import CAP, LAYOUT, stores

import prefixstore
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import catalog_path
from prefixstore.engine.results import FAILED, STORED
from prefixstore.gpu.fileio import FaultHook

TESTS = os.path.dirname(os.path.abspath(__file__))


POINTS = ["sync", "between", "after-sync", "sync:ack-before-group-sync"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, dict]:
    """One killed run per point of ``POINTS`` (one process imports, then forks each run)."""
    base = str(tmp_path_factory.mktemp("group"))
    here = os.path.dirname(os.path.dirname(prefixstore.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "group_workload.py"), base, *POINTS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    for spec, run in zip(POINTS, runs, strict=True):
        assert run["last"] == "paused", (spec, run)  # killed at its point, not after the workload
    return dict(zip(POINTS, runs, strict=True))


def lose_power(root: str) -> None:
    """The catalog as a power loss leaves it: its log back to the last durability point
    (the shard files keep what they had; recovery must handle both)."""
    side = os.path.dirname(os.path.abspath(root))
    with open(os.path.join(side, "db.stat")) as f:
        size, mtime = (int(x) for x in f.read().split())
    st = os.stat(catalog_path(root))
    assert (st.st_size, st.st_mtime_ns) == (size, mtime), "a checkpoint ran: the saved log is stale"
    os.replace(os.path.join(side, "wal.durable"), catalog_path(root) + "-wal")
    os.unlink(catalog_path(root) + "-shm")


def recovered(root: str, acked: set[int]) -> tuple[set[int], list[str]]:
    """Reopen (recovery): the stores present, and every acknowledged one missing."""
    todo = stores()
    with Engine.open(root, LAYOUT, CAP) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert not eng.catalog.journal()
        present = {i for i, t in enumerate(todo) if key_at(t) in eng.index.by_key}
        lost = [f"store {i} acknowledged, not in the catalog" for i in sorted(acked - present)]
        for i in sorted(acked & present):
            assert_restores(eng, todo[i], blocks=len(todo[i]) // 4)
        for i in sorted(present - acked):  # published before the kill: whole
            assert_restores(eng, todo[i], blocks=len(todo[i]) // 4)
    return present, lost


@pytest.mark.parametrize(("point", "power"), [("sync", True), ("between", True), ("after-sync", False)])
def test_a_kill_inside_or_between_a_group_loses_no_acknowledged_store(killed, point, power):
    run = killed[point]
    if power:
        lose_power(run["root"])
    present, lost = recovered(run["root"], set(run["acked"]))
    assert not lost, lost
    assert len(present) < len(stores())  # the kill did interrupt stores


def test_a_store_acknowledged_before_its_group_sync_is_caught(killed):
    run = killed["sync:ack-before-group-sync"]
    lose_power(run["root"])
    _, lost = recovered(run["root"], set(run["acked"]))
    assert lost, "the planted early acknowledgement lost nothing"


class FailOneWrite(FaultHook):
    """EIO on rank 1's shard write of the store whose key is ``key``, once ``beside``
    stores (itself included) were seen in flight during that write (waiting up to 10 s:
    on a loaded machine the others may start only after it); each log sync is slowed
    so that the stores in flight share it."""

    def __init__(self, key: bytes, beside: int = 3) -> None:
        self.key, self.beside, self.eng = key.hex(), beside, None
        self.seen: set[int] = set()  # the transactions in flight during the failing write

    def before(self, op, target, rank):
        if op == "sync":
            threading.Event().wait(0.02)
        if op == "write" and rank == 1 and self.key in os.path.basename(target):
            deadline = time.monotonic() + 10.0
            while True:
                self.seen |= set(self.eng.holds.inflight_blocks.values())  # one C call: no resize mid-read
                if len(self.seen) >= self.beside or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            raise OSError(errno.EIO, "injected EIO on one store's write", target)


def test_a_write_fault_on_one_store_of_a_group_fails_only_that_store(tmp_path):
    todo = stores()
    bad = 3
    hook = FailOneWrite(key_at(todo[bad]))
    with Engine.open(str(tmp_path / "cache"), LAYOUT, CAP, hook=hook) as eng:
        hook.eng = eng
        results: dict[int, object] = {}
        barrier = threading.Barrier(len(todo))

        def work(i: int) -> None:
            barrier.wait()
            results[i] = store_tokens(eng, todo[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(todo))]
        for x in threads:
            x.start()
        for x in threads:
            x.join()
        assert results[bad].status == FAILED and "injected EIO" in results[bad].reason, results[bad]
        assert all(results[i].status == STORED for i in range(len(todo)) if i != bad), results
        assert len(hook.seen) >= 3  # the failed write had other stores in flight beside it
        wal = eng.catalog.wal
        assert wal.syncs < wal.written  # their commits shared syncs
        for i, t in enumerate(todo):
            if i != bad:
                assert_restores(eng, t, blocks=len(t) // 4)
        assert eng.lookup(Prefix.from_tokens(todo[bad], 4)).blocks != len(todo[bad]) // 4
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
