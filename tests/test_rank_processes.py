"""Rank processes over torch.distributed (gloo on loopback, ports chosen free).

Two kinds of rank servers:

- in a thread of this process (fast): the same ``RankServer`` and the same gloo pair
  groups, used for the protocol, error mapping, per-rank faults, a rank that dies
  mid-store (its server aborts its connection, as a dead process's sockets close)
  and a rank that stalls past the deadline;
- real processes (``python -m prefixstore.gpu.distributed`` / ``prefixstore
  rank-server``): a rank process SIGKILLed in the middle of a store (it dies with its
  temporary file written), on 2 and 4 ranks, and a coordinator SIGKILLed just before
  it publishes a multi-rank store.

In every case: the store rolls back (or recovery does), the audit is clean, and every
store that had returned success restores bit-identically once every rank is back
(while a rank is down, restores needing it are misses, never other bytes).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import BT, assert_restores, make_layout, node_at, store_tokens, tokens_for
from remote_helpers import wait_until

from prefixstore.base.errors import RankUnavailableError
from prefixstore.base.keys import Prefix
from prefixstore.cli import main
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import FaultFS, FaultPlan
from prefixstore.gpu.distributed import RankGroup, RemoteRank
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.rank_server import RankServer
from prefixstore.gpu.ranks import LocalRank

CAP = 16 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


class _Die(BaseException):
    """Ends a rank server thread the way process death ends a rank process."""


class ThreadRank:
    """A RankServer on its own thread of this process."""

    def __init__(self, group: RankGroup, rank: int, directory: str, *, fs=None, hook=None) -> None:
        self.server = RankServer(rank, directory, "127.0.0.1", group.port, fs=fs, hook=hook,
                                 connect_timeout=20, gloo_host="127.0.0.1")
        self.exit: object = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"rank-server-{rank}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.exit = self.server.serve()
        except _Die:
            self.exit = "died"


def rank_dir(base, r: int) -> str:
    return os.path.join(str(base), f"host{r}", f"rank{r}")


def thread_group(base, ranks: int, *, op_timeout: float = 20, fs=None, hooks=None):
    group = RankGroup(op_timeout=op_timeout, connect_timeout=20, gloo_host="127.0.0.1")
    servers = [ThreadRank(group, r, rank_dir(base, r), fs=(fs or {}).get(r), hook=(hooks or {}).get(r))
               for r in range(ranks)]
    return group, servers, group.connect(range(ranks), timeout=20)


def assert_clean(eng: Engine) -> None:
    rep = eng.audit()
    assert rep.ok, rep.to_dict()
    assert eng.account.charged == eng.catalog.charged()
    assert not eng.catalog.journal()


# ------------------------------------------------------------------------ rank threads


def test_remote_rank_implements_rank_io(tmp_path):
    group, servers, (rr,) = thread_group(tmp_path, 1)
    try:
        d = rr.directory
        assert d == rank_dir(tmp_path, 0) and rr.info()["pid"] == os.getpid()
        data = bytes(range(256)) * 999
        rr.write_shard("a.st", data)
        assert rr.read_shard("a.st") == data
        assert rr.size("a.st") == len(data) and rr.size("nope.st") is None
        assert rr.listdir() == ["a.st"]
        with pytest.raises(FileExistsError):
            rr.write_shard("a.st", b"x")  # never overwritten in place
        with pytest.raises(FileNotFoundError):
            rr.read_shard("nope.st")
        for bad in ("../escape", "/etc/passwd", "..", "a/b", ""):
            with pytest.raises(OSError) as ei:
                rr.size(bad)
            assert ei.value.errno == errno.EINVAL
        open(os.path.join(d, "b.st.tmp"), "wb").close()
        rr.remove_temp("b.st")
        assert rr.remove("a.st") is True and rr.remove("a.st") is False  # missing is success
        rr.sync_dir()
        open(os.path.join(d, "notes.txt"), "w").close()
        dest = rr.quarantine("notes.txt")
        assert os.path.exists(dest) and "lost+found" in dest and rr.listdir() == []
        assert rr.available
    finally:
        group.close()
    servers[0].thread.join(10)
    assert servers[0].exit == 0
    with pytest.raises(RankUnavailableError):
        rr.listdir()
    assert not rr.available


@pytest.mark.parametrize("ranks", [2, 4])
def test_engine_over_remote_ranks_round_trip_and_recovery(tmp_path, ranks, monkeypatch):
    def no_pickle(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    group, _, remotes = thread_group(tmp_path, ranks)
    L = make_layout(ranks=ranks)
    root = str(tmp_path / "cache")
    a, b = tokens_for(1, 6), tokens_for(2, 4)
    try:
        with Engine.open(root, L, CAP, ranks=remotes) as eng:
            for t in (a[:8], a, b):
                assert store_tokens(eng, t).status == "stored"
            assert_restores(eng, a, blocks=6)
            assert eng.evict(prefix=Prefix.from_tokens(b, BT)) > 0
            assert_clean(eng)
        # a leftover temporary and a foreign file appear on the ranks while closed
        open(os.path.join(remotes[-1].directory, "0" * 32 + "-g1.st.tmp"), "wb").close()
        open(os.path.join(remotes[0].directory, "junk"), "w").close()
        with Engine.open(root, L, CAP, ranks=remotes) as eng:
            rep = eng.recovery_report
            assert rep.orphans_removed and rep.quarantined
            assert_restores(eng, a, blocks=6)
            assert eng.lookup(Prefix.from_tokens(b, BT)).outcome == "miss"
            assert_clean(eng)
    finally:
        group.close()


@pytest.mark.parametrize(("ranks", "bad"), [(2, 0), (4, 2), (4, 3)], ids=["2r-first", "4r-middle", "4r-last"])
def test_rank_errors_cross_the_wire_and_roll_back(tmp_path, ranks, bad):
    """ENOSPC on one rank process: same errno at the coordinator, rollback, the garbage
    of a failed remote unlink stays charged until reclaimed, a damaged prior is
    invalidated and refilled, all over the wire."""
    plan = FaultPlan()
    group, _, remotes = thread_group(tmp_path, ranks, fs={bad: FaultFS(plan)})
    try:
        eng = Engine.open(str(tmp_path / "cache"), make_layout(ranks=ranks), CAP, ranks=remotes)
        a = tokens_for(3, 6)
        store_tokens(eng, a[:8])
        charged = eng.account.charged
        plan.add("write", "ENOSPC", at=1)
        plan.fail_nth("unlink", 1, "EIO")
        res = store_tokens(eng, a)
        assert res.status == "failed" and f"rank {bad}:" in res.reason and "[Errno 28]" in res.reason
        garbage = eng.stats()["garbage_bytes"]
        assert garbage > 0 and eng.account.charged == charged + garbage
        assert_clean(eng)
        assert eng.reclaim() == garbage and eng.account.charged == charged
        # a damaged prior record (altered on the failing rank) is invalidated, then refilled
        p = node_at(eng, a[:8])
        path = os.path.join(remotes[bad].directory, f"{p.key.hex()}-g{p.generation}.st")
        with open(path, "r+b") as f:
            f.seek(-3, 2)
            f.write(b"\xff\xfe\xfd")
        plan.fail_nth("write", 1, "EIO")
        assert store_tokens(eng, a).status == "failed"
        assert p.state == "damaged"
        assert store_tokens(eng, a[:8]).status == "refilled"
        assert store_tokens(eng, a).status == "stored"
        assert_restores(eng, a, blocks=6)
        assert_clean(eng)
        eng.close()
    finally:
        group.close()


class _DieAfter(FaultHook):
    def __init__(self, op: str, n: int) -> None:
        self.op, self.n, self.seen = op, n, 0

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == self.op:
            self.seen += 1
            if self.seen == self.n:
                raise _Die()


class _StallAfter(FaultHook):
    def __init__(self, op: str, n: int, seconds: float) -> None:
        self.op, self.n, self.seconds, self.seen = op, n, seconds, 0

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == self.op:
            self.seen += 1
            if self.seen == self.n:
                time.sleep(self.seconds)


def _outage_then_return(eng, remotes, bad, acked, target, restart) -> None:
    """While rank ``bad`` is down: misses, fast failures, survivors answer. Then it
    comes back (``restart()``), the garbage is reclaimed, everything restores."""
    ranks = len(remotes)
    t0 = time.monotonic()
    with pytest.raises(RankUnavailableError):
        remotes[bad].listdir()
    assert time.monotonic() - t0 < 5  # a typed error at once, not a hang
    assert not remotes[bad].available
    for r in range(ranks):
        if r != bad:
            remotes[r].listdir()  # the survivors keep serving
    for t, blocks in acked:
        m = eng.lookup(Prefix.from_tokens(t, BT))
        assert m.hit and m.blocks == blocks  # the catalog still knows it...
        assert eng.restore(m) is None  # ...but it needs the dead rank: a miss
        assert node_at(eng, t).state == "ready"  # not damage
    charged, n_jobs = eng.account.charged, eng.catalog.query("SELECT count(*) FROM files")[0][0]
    res = store_tokens(eng, tokens_for(99, 2))
    assert res.status == "failed" and "unavailable" in res.reason
    assert (eng.account.charged, eng.catalog.query("SELECT count(*) FROM files")[0][0]) == (charged, n_jobs)
    assert_clean(eng)
    restart()
    assert eng.reclaim() > 0  # the dead rank's leftover of the interrupted store
    assert eng.stats()["garbage_bytes"] == 0
    for t, blocks in acked:
        assert_restores(eng, t, blocks=blocks)
    assert store_tokens(eng, target).status == "stored"
    assert_restores(eng, target, blocks=len(target) // BT)
    assert_clean(eng)


@pytest.mark.parametrize(("ranks", "bad"), [(2, 0), (2, 1), (4, 0), (4, 2), (4, 3)],
                         ids=["2r-first", "2r-last", "4r-first", "4r-middle", "4r-last"])
def test_rank_thread_dies_mid_store(tmp_path, ranks, bad):
    group, servers, remotes = thread_group(tmp_path, ranks, hooks={bad: _DieAfter("write", 3)})
    try:
        eng = Engine.open(str(tmp_path / "cache"), make_layout(ranks=ranks), CAP, ranks=remotes)
        a, b = tokens_for(4, 6), tokens_for(5, 3)
        acked = [(a[:8], 2), (b, 3)]
        for t, _ in acked:
            assert store_tokens(eng, t).status == "stored"
        res = store_tokens(eng, a)  # rank `bad` dies with its temporary written
        assert res.status == "failed" and f"rank {bad}:" in res.reason
        servers[bad].thread.join(10)
        assert servers[bad].exit == "died"
        tmp = [e for e in os.listdir(remotes[bad].directory) if e.endswith(".tmp")]
        assert len(tmp) == 1
        assert eng.stats()["garbage_bytes"] > 0  # its file could not be removed: charged

        def restart():
            ThreadRank(group, bad, rank_dir(tmp_path, bad))
            remotes[bad].reconnect(timeout=20)

        _outage_then_return(eng, remotes, bad, acked, a, restart)
        assert remotes[bad].incarnation == 2
        eng.close()
    finally:
        group.close()


def test_stalled_rank_times_out_then_comes_back(tmp_path):
    ranks, bad = 2, 1
    group, servers, remotes = thread_group(tmp_path, ranks, op_timeout=0.5,
                                           hooks={bad: _StallAfter("rename", 2, 2.0)})
    try:
        eng = Engine.open(str(tmp_path / "cache"), make_layout(ranks=ranks), CAP, ranks=remotes)
        a = tokens_for(6, 5)
        assert store_tokens(eng, a[:8]).status == "stored"
        res = store_tokens(eng, a)
        assert res.status == "failed" and "[Errno 110]" in res.reason and "timed out" in res.reason.lower()
        with pytest.raises(RankUnavailableError) as ei:
            remotes[bad].size("x.st")
        assert ei.value.errno == errno.EHOSTDOWN or ei.value.errno == errno.ETIMEDOUT
        # the stalled process finishes, finds its connection gone and registers again
        remotes[bad].reconnect(timeout=20)
        assert remotes[bad].incarnation == 2 and servers[bad].thread.is_alive()
        assert eng.reclaim() > 0  # the shard it completed after the deadline
        assert_restores(eng, a, blocks=2)
        assert store_tokens(eng, a).status == "stored"
        assert_restores(eng, a, blocks=5)
        assert_clean(eng)
        eng.close()
    finally:
        group.close()


# ------------------------------------------------------------------------ real processes


def spawn_rank(rank: int, directory: str, init_method: str, log_path: str, *extra: str,
               cli: bool = False) -> subprocess.Popen:
    cmd = ([sys.executable, "-m", "prefixstore.cli", "rank-server"] if cli
           else [sys.executable, "-m", "prefixstore.gpu.distributed"])
    cmd += ["--rank", str(rank), "--dir", directory, "--init-method", init_method,
            "--gloo-host", "127.0.0.1", "--connect-timeout", "30", *extra]
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    finally:
        log.close()


def _logs(tmp_path) -> str:
    out = []
    for name in sorted(os.listdir(tmp_path)):
        if name.endswith(".log"):
            with open(os.path.join(tmp_path, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-2000:]}")
    return "\n".join(out)


def holds_flock(pid: int, path: str) -> bool:
    """Whether process ``pid`` holds a flock on ``path`` (read from /proc/locks, so the
    lock is never contended: a rank server that finds its directory locked exits)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()  # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4] == str(pid) \
                    and fields[5].rsplit(":", 1)[-1] == str(ino):
                return True
    return False


def _reap(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.mark.parametrize(("ranks", "bad"), [(2, 1), (4, 2)], ids=["2r-last", "4r-middle"])
def test_rank_process_sigkilled_mid_store(tmp_path, ranks, bad):
    group = RankGroup(op_timeout=20, connect_timeout=30, gloo_host="127.0.0.1")
    procs = []
    try:
        for r in range(ranks):
            extra = ["--kill-at", "after:write:3"] if r == bad else []
            procs.append(spawn_rank(r, rank_dir(tmp_path, r), group.init_method,
                                    str(tmp_path / f"rank{r}.log"), *extra))
        remotes = group.connect(range(ranks), timeout=60)
        eng = Engine.open(str(tmp_path / "cache"), make_layout(ranks=ranks), CAP, ranks=remotes)
        a, b = tokens_for(7, 6), tokens_for(8, 3)
        acked = [(a[:8], 2), (b, 3)]
        for t, _ in acked:
            assert store_tokens(eng, t).status == "stored"
        res = store_tokens(eng, a)  # the third write on rank `bad`: SIGKILL after it
        assert res.status == "failed" and f"rank {bad}:" in res.reason, (res, _logs(tmp_path))
        assert procs[bad].wait(20) == -9
        assert [e for e in os.listdir(remotes[bad].directory) if e.endswith(".tmp")]
        assert eng.stats()["garbage_bytes"] > 0

        def restart():
            procs.append(spawn_rank(bad, rank_dir(tmp_path, bad), group.init_method,
                                    str(tmp_path / f"rank{bad}-again.log")))
            remotes[bad].reconnect(timeout=60)

        _outage_then_return(eng, remotes, bad, acked, a, restart)
        assert remotes[bad].pid == procs[-1].pid
        eng.close()
        group.close()
        for p in procs[:bad] + procs[bad + 1:]:
            assert p.wait(20) == 0, _logs(tmp_path)
    finally:
        _reap(procs)


def test_coordinator_sigkilled_before_publishing_real_processes(tmp_path):
    """The coordinator dies with every rank's shard durable but unpublished: the rank
    processes notice and exit; a new coordinator's recovery finds the files on every
    rank (each in its own directory), removes them, and the audit is clean."""
    ranks = 2
    root = str(tmp_path / "cache")
    coord = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "rank_coordinator.py"), root, str(ranks), "store.publish"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "coordinator.log", "wb"),  # noqa: SIM115
        text=True, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
    )
    procs = [coord]
    try:
        line = coord.stdout.readline()
        assert line.startswith("PORT "), (line, _logs(tmp_path))
        init = f"tcp://127.0.0.1:{int(line.split()[1])}"
        for r in range(ranks):
            procs.append(spawn_rank(r, rank_dir(tmp_path, r), init, str(tmp_path / f"rank{r}.log"), cli=(r == 0)))
        rest = coord.stdout.read()
        assert coord.wait(60) == -9 and "ACKED" in rest and "NOT KILLED" not in rest, (rest, _logs(tmp_path))
        for p in procs[1:]:
            assert p.wait(30) == 1, _logs(tmp_path)  # coordinator gone
        key = Prefix.from_tokens(tokens_for(21, 6), BT).keys[-1].hex()
        for r in range(ranks):  # the unpublished shard is durable on every rank
            assert [e for e in os.listdir(rank_dir(tmp_path, r)) if e.startswith(key)], r
        group = RankGroup(op_timeout=20, connect_timeout=30, gloo_host="127.0.0.1")
        for r in range(ranks):
            procs.append(spawn_rank(r, rank_dir(tmp_path, r), group.init_method, str(tmp_path / f"rank{r}-b.log")))
        remotes = group.connect(range(ranks), timeout=60)
        with Engine.open(root, make_layout(ranks=ranks), CAP, ranks=remotes) as eng:
            assert eng.recovery_report.rolled_back
            assert_clean(eng)
            a = tokens_for(21, 6)
            assert_restores(eng, a[:8], blocks=2)
            assert_restores(eng, tokens_for(22, 3), blocks=3)
            assert eng.lookup(Prefix.from_tokens(a, BT)).blocks == 2
            for r in range(ranks):
                assert not [e for e in os.listdir(rank_dir(tmp_path, r)) if e.startswith(key)], r
        group.close()
        for p in procs[-ranks:]:
            assert p.wait(20) == 0
    finally:
        _reap(procs)


def test_remote_rank_requires_the_same_directory_after_restart(tmp_path):
    """A rank process restarted on another directory is refused (its files would all
    look missing and every node would be marked damaged)."""
    group, servers, (rr,) = thread_group(tmp_path, 1)
    try:
        rr.close()  # the server registers again...
        rr.reconnect(timeout=20)
        assert rr.incarnation == 2
        rr.shutdown_server()
        servers[0].thread.join(10)
        ThreadRank(group, 0, str(tmp_path / "elsewhere" / "rank0"))
        with pytest.raises(RankUnavailableError, match="expected rank 0 at"):
            rr.reconnect(timeout=2)  # refused, and no other incarnation comes
        assert not rr.available
    finally:
        group.close()
    assert isinstance(rr, RemoteRank)


def test_concurrent_callers_over_remote_ranks(tmp_path):
    """32 callers storing and restoring at once through 2 rank servers."""
    ranks = 2
    group, _, remotes = thread_group(tmp_path, ranks)
    errors: list[BaseException] = []
    try:
        eng = Engine.open(str(tmp_path / "cache"), make_layout(ranks=ranks), CAP, ranks=remotes)

        def caller(i: int) -> None:
            try:
                t = tokens_for(100 + i, 4)
                for blocks in (2, 4):
                    assert store_tokens(eng, t[: blocks * BT]).ok
                assert_restores(eng, t, blocks=4)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(32)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors[:3]
        assert len(eng.index) == 64
        assert_clean(eng)
        eng.close()
    finally:
        group.close()


def test_rank_server_options(monkeypatch, capsys):
    import argparse

    from prefixstore.gpu import rank_server

    def parse(*argv):
        p = argparse.ArgumentParser()
        rank_server.add_arguments(p)
        return p.parse_args(list(argv))

    for var in ("PREFIXSTORE_RANK", "PREFIXSTORE_INIT_METHOD", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert rank_server.run(parse("--dir", "/nonexistent")) == 2  # no rank
    assert rank_server.run(parse("--dir", "/nonexistent", "--rank", "1")) == 2  # no init method
    assert rank_server.run(parse("--dir", "/x", "--rank", "1", "--init-method", "udp://h:1")) == 2
    assert "tcp://HOST:PORT" in capsys.readouterr().out
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("PREFIXSTORE_RANK", "3")
    args = parse("--dir", "/x")
    assert (args.rank, args.init_method) == (3, "tcp://10.0.0.7:29500")
    assert rank_server.parse_init_method("tcp://[::1]:29500") == ("::1", 29500)
    with pytest.raises(ValueError):
        rank_server.parse_init_method("tcp://host")


def test_audit_exits_3_naming_a_rank_whose_server_is_stopped(tmp_path, capsys):
    """``audit --ranks``: with both rank server processes serving, exit 0; with rank 1's
    process stopped (SIGSTOP: it never registers), rank 0 is audited and the exit is 3
    (no violation found, not shown sound), stderr naming rank 1."""
    root = str(tmp_path / "cache")
    dirs = [str(tmp_path / f"host{r}" / f"rank{r}") for r in range(2)]
    with Engine.open(root, make_layout(ranks=2), CAP, ranks=[LocalRank(r, d) for r, d in enumerate(dirs)]) as eng:
        assert store_tokens(eng, tokens_for(94, 3)).status == "stored"

    def audit(stop: int | None) -> tuple[int, dict, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [spawn_rank(r, d, f"tcp://127.0.0.1:{port}", str(tmp_path / f"rank{r}.log"), cli=True)
                 for r, d in enumerate(dirs)]
        try:
            if stop is not None:
                os.kill(procs[stop].pid, signal.SIGSTOP)
            # a loaded machine takes seconds to start a process that imports torch: the
            # audit's --rank-timeout starts once the serving ones hold their directories
            serving = [(p, dirs[r]) for r, p in enumerate(procs) if r != stop]
            assert wait_until(lambda: all(holds_flock(p.pid, d) for p, d in serving), timeout=120), _logs(tmp_path)
            rc = main(["audit", root, "--json", "--ranks", f"tcp://127.0.0.1:{port}", "--rank-timeout",
                       "20" if stop is None else "10"])
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
            _reap(procs)
        out = capsys.readouterr()
        return rc, json.loads(out.out.strip().splitlines()[-1]), out.err

    rc, rep, err = audit(None)
    assert rc == 0 and rep["ok"] and not any("unavailable" in r for r in rep["ranks"]), (rep, _logs(tmp_path))
    rc, rep, err = audit(1)
    assert rc == 3 and rep["ok"], (rc, rep["ranks"], err)
    assert [("unavailable" in r, r["files"]) for r in rep["ranks"]] == [(False, 1), (True, 0)], rep
    assert "rank 1 could not be reached, its files were not checked" in err, err
