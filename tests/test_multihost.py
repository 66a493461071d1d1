"""Rank servers on separate "hosts": Linux network namespaces on one private bridge
(``tests/netns_hosts.py``), the coordinator (this test's engine) in a namespace of its
own, each rank server a process on its host with its own directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import BT, assert_restores, make_layout, store_tokens, tokens_for
from netns_hosts import NetnsHosts, netns_leftovers, require_netns

from prefixstore.base.errors import InvalidArgumentError, RankAuthError
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir
from prefixstore.gpu.distributed import RankGroup
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.rank_auth import TOKEN_ENV, load_token

CAP = 16 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def hosts(tmp_path):
    require_netns()
    h = NetnsHosts(4, str(tmp_path))
    try:
        yield h
    finally:
        h.close()
        assert not netns_leftovers(h)


def group_in(hosts: NetnsHosts, **opts) -> RankGroup:
    return RankGroup(hosts.coord_ip, 0, gloo_host=hosts.coord_ip, **{"op_timeout": 10, "connect_timeout": 20, **opts})


def test_fixture_builds_hosts_and_removes_everything(tmp_path):
    require_netns()
    before = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    h = NetnsHosts(2, str(tmp_path))
    try:
        names = netns_leftovers(h)
        assert set(names) == {h.switch, h.coord_ns, *h.host_ns, *h.stranger_nss}
        with h.coordinator():
            group = group_in(h)
            try:
                procs = [h.start_rank(r, group.init_method) for r in range(2)]
                remotes = group.connect(range(2), timeout=60)
                for r, rr in enumerate(remotes):
                    rr.write_shard("a.st", bytes([r]) * 1000)
                    assert rr.read_shard("a.st") == bytes([r]) * 1000
                    assert rr.directory == h.rank_dir(r) and rr.pid != os.getpid()
                    assert h.pids(h.host_ns[r])  # the rank server runs in its host's namespace
                # the coordinator's store is reachable inside the bridge network only
                with socket.create_connection((h.coord_ip, group.port), timeout=5):
                    pass
            finally:
                group.close()
        for p in procs:
            assert p.wait(20) == 0, h.logs()
        # the test's own namespace has no route into the private network
        with pytest.raises(OSError):
            socket.create_connection((h.coord_ip, group.port), timeout=2)
        h.start_rank(0, f"tcp://{h.coord_ip}:1")  # left running: close() kills it
    finally:
        h.close()
    assert not netns_leftovers(h)
    assert subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout == before
    assert all(p.poll() is not None for p in h.procs)


def test_four_hosts_store_and_restore(hosts):
    with hosts.coordinator():
        group = group_in(hosts)
        try:
            for r in range(4):
                hosts.start_rank(r, group.init_method)
            remotes = group.connect(range(4), timeout=60)
            a = tokens_for(1, 6)
            with Engine.open(str(hosts.base) + "/cache", make_layout(ranks=4), CAP, ranks=remotes) as eng:
                assert store_tokens(eng, a).status == "stored"
                assert_restores(eng, a, blocks=6)
                rep = eng.audit()
                assert rep.ok, rep.to_dict()
        finally:
            group.close()


# ------------------------------------------------------------------------ the shared token

TOKEN = b"a-token-shared-by-coordinator-and-ranks"


def token_file(hosts: NetnsHosts, token: bytes = TOKEN, name: str = "token") -> str:
    path = os.path.join(hosts.base, name)
    with open(path, "wb") as f:
        f.write(token + b"\n")
    return path


def stranger(hosts: NetnsHosts, mode: str, group: RankGroup, rank: int) -> tuple[subprocess.Popen, str]:
    out = os.path.join(hosts.base, f"stranger-{mode}.jsonl")
    argv = [sys.executable, os.path.join(HERE, "netns_stranger.py"), mode, hosts.coord_ip, str(group.port),
            str(rank), out, hosts.stranger_ips[0]]
    return hosts.spawn(hosts.stranger_ns, argv, f"stranger-{mode}.log"), out


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_stranger_posing_as_a_rank_is_sent_nothing(hosts):
    """A process on another host registers as rank 1 without the token: the coordinator
    refuses it after the challenge, sends it no request and no shard; a rank server
    with a wrong token is refused too; the real one then serves the stores."""
    with hosts.coordinator():
        group = group_in(hosts, token=TOKEN, connect_timeout=5)  # a dead incarnation is given up in 5 s
        try:
            proc, out = stranger(hosts, "rank", group, 1)
            wait_until(lambda: group.latest(1) >= 1, 30, hosts.logs())
            with pytest.raises(RankAuthError, match="did not prove the shared token"):
                group.connect([1], timeout=3)
            assert proc.wait(30) == 0, hosts.logs()
            got = records(out)
            assert [r["got"]["op"] for r in got if "got" in r] == ["hello"], got
            assert all(r.get("payload_bytes", 0) == 0 for r in got)
            assert not group.remote(1).available
            hosts.start_rank(1, group.init_method, token_file=token_file(hosts, b"another-token-of-16-bytes+", "bad"))
            wait_until(lambda: group.latest(1) >= 2, 30, hosts.logs())
            with pytest.raises(RankAuthError):
                group.connect([1], timeout=3)
            hosts.kill_host(1)
            hosts.start_rank(0, group.init_method, token_file=token_file(hosts))
            hosts.start_rank(1, group.init_method, token_file=token_file(hosts))
            remotes = group.connect(range(2), timeout=60)
            a = tokens_for(3, 4)
            with Engine.open(os.path.join(hosts.base, "cache"), make_layout(ranks=2), CAP, ranks=remotes) as eng:
                assert store_tokens(eng, a).status == "stored"
                assert_restores(eng, a, blocks=4)
        finally:
            group.close()


def test_a_stale_registration_is_passed_over(hosts):
    """A rank server registers, then its host is killed before the coordinator accepts
    it; a new one registers while the coordinator is trying the dead incarnation. The
    coordinator's connect gives up on the dead one after ``connect_timeout`` (not the
    longer op timeout), passes over it and connects the new one."""
    with hosts.coordinator():
        group = group_in(hosts, token=TOKEN, connect_timeout=3)
        try:
            hosts.start_rank(0, group.init_method, token_file=token_file(hosts))
            wait_until(lambda: group.latest(0) >= 1, 30, hosts.logs())
            hosts.kill_host(0)
            later = threading.Timer(1.0, lambda: hosts.start_rank(0, group.init_method, token_file=token_file(hosts)))
            later.start()
            t0 = time.monotonic()
            (rr,) = group.connect([0], timeout=60)
            took = time.monotonic() - t0
            later.join()
            assert rr.incarnation == 2 and rr.listdir() == []
            assert took < 8, took  # the dead incarnation's pair was given up after connect_timeout (3 s)
        finally:
            group.close()


def test_stranger_posing_as_the_coordinator_changes_nothing(hosts):
    """A process on another host accepts rank 0's registration and joins its pair in
    the coordinator's place: the rank serves nothing (no file written or removed, no
    listing, no directory name), registers again, and the coordinator connects it."""
    victim = os.path.join(hosts.rank_dir(0), "victim.st")
    with open(victim, "wb") as f:
        f.write(b"v" * 64)
    with hosts.coordinator():
        group = group_in(hosts, token=TOKEN)
        try:
            hosts.start_rank(0, group.init_method, token_file=token_file(hosts))
            proc, out = stranger(hosts, "coordinator", group, 0)
            assert proc.wait(60) == 0, hosts.logs()
            got = records(out)
            assert hosts.rank_dir(0) not in json.dumps(got), got
            assert not any(r.get("reply", {}).get("ok") for r in got), got
            assert not any(r.get("body_bytes") for r in got), got
            assert sorted(os.listdir(hosts.rank_dir(0))) == ["victim.st"]
            (rr,) = group.connect([0], timeout=30)
            assert rr.incarnation >= 2 and rr.listdir() == ["victim.st"]
            assert rr.read_shard("victim.st") == b"v" * 64
        finally:
            group.close()


def test_rank_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token() is None
    monkeypatch.setenv(TOKEN_ENV, "  from-the-default-variable  ")
    assert load_token() == b"from-the-default-variable"
    monkeypatch.setenv("MY_TOKEN", "x" * 16)
    assert load_token(env="MY_TOKEN") == b"x" * 16
    (tmp_path / "t").write_bytes(b"y" * 20 + b"\n")
    assert load_token(file=str(tmp_path / "t")) == b"y" * 20
    for kw in ({"env": "UNSET_TOKEN_VAR"}, {"file": str(tmp_path / "none")}):
        with pytest.raises(InvalidArgumentError):
            load_token(**kw)
    monkeypatch.setenv("MY_TOKEN", "short")
    with pytest.raises(InvalidArgumentError, match="at least 16 bytes"):
        load_token(env="MY_TOKEN")


# ------------------------------------------------------------------------ faults on the network

OP_TIMEOUT = 3.0


class FaultAtCommit(FaultHook):
    """Runs ``action`` once, at the catalog commit ``label`` (``when``: before or after)."""

    def __init__(self, label: str, when: str) -> None:
        self.label, self.when = label, when
        self.action = None

    def _point(self, when: str, op: str, target: str) -> None:
        if self.action is not None and op == "commit" and target == self.label and when == self.when:
            action, self.action = self.action, None
            action()

    def before(self, op: str, target: str, rank: int | None) -> None:
        self._point("before", op, target)

    def after(self, op: str, target: str, rank: int | None) -> None:
        self._point("after", op, target)


def inject(hosts: NetnsHosts, fault: str, bad: int, background: list) -> None:
    if fault == "kill":
        hosts.kill_host(bad)
    elif fault == "link-down":
        hosts.set_link(bad, False)
    elif fault == "slow-lossy":
        hosts.shape(bad)
        background.append(hosts.flap(bad, 4.0, period=1.0, down_share=0.3))
    elif fault == "partition":
        background.append(hosts.partition(bad, 3.0))


def heal(hosts: NetnsHosts, fault: str, bad: int, background: list, init_method: str) -> None:
    for t in background:
        t.join(30)
    if fault == "kill":
        hosts.start_rank(bad, init_method, token_file=token_file(hosts))
    elif fault == "link-down":
        hosts.set_link(bad, True)
    elif fault == "slow-lossy":
        hosts.unshape(bad)


def assert_clean(eng: Engine) -> None:
    rep = eng.audit()
    assert rep.ok, rep.to_dict()
    assert eng.account.charged == eng.catalog.charged()
    assert not eng.catalog.journal()


FAULTS = ["kill", "link-down", "slow-lossy", "partition"]
FULL = os.environ.get("PREFIXSTORE_MULTIHOST_FULL") == "1"
BEFORE_WRITES, BEFORE_PUBLISH = ("store.intent", "after"), ("store.publish", "before")
CASES = [pytest.param(*BEFORE_WRITES, f, id=f"before-writes-{f}", marks=() if FULL or f != "slow-lossy" else
                      pytest.mark.skip(reason="PREFIXSTORE_MULTIHOST_FULL=1 runs the slow and lossy link (70 s)"))
         for f in FAULTS] + [
    pytest.param(*BEFORE_PUBLISH, f, id=f"before-publish-{f}", marks=() if FULL or f == "kill" else
                 pytest.mark.skip(reason="PREFIXSTORE_MULTIHOST_FULL=1 runs every fault before the publish"))
    for f in FAULTS]
"""In CI: a host killed, its link down and a partition before the writes, and a host killed
before the publish (about 13 s each); the full run adds the slow and lossy link (about
70 s) and every fault before the publish."""


@pytest.mark.parametrize(("label", "when", "fault"), CASES)
def test_host_fault_mid_store(hosts, fault, label, when):
    """A 4-rank store with host 2 hit by ``fault`` once the store's intent is committed
    (its shards not yet written) or just before its publish (every shard durable). Every
    wait is bounded: the store ends within a few op timeouts, whatever the link does; a
    rank that failed is treated as today (a failed store rolls back, its files charged
    until reclaimed; a restore needing it misses). Once the host is back: reclaim, and
    every store that returned success restores bit for bit; the audit is clean."""
    bad = 2
    hook = FaultAtCommit(label, when)
    background: list = []
    with hosts.coordinator():
        group = group_in(hosts, token=TOKEN, op_timeout=OP_TIMEOUT, connect_timeout=15)
        try:
            for r in range(4):
                hosts.start_rank(r, group.init_method, token_file=token_file(hosts))
            remotes = group.connect(range(4), timeout=60)
            eng = Engine.open(os.path.join(hosts.base, "cache"), make_layout(ranks=4), CAP, hook=hook, ranks=remotes)
            a, b = tokens_for(11, 6), tokens_for(12, 3)
            acked = []
            for t in (a[:8], b):
                assert store_tokens(eng, t).status == "stored"
                acked.append(t)
            hook.action = lambda: inject(hosts, fault, bad, background)
            t0 = time.monotonic()
            res = store_tokens(eng, a)
            took = time.monotonic() - t0
            assert hook.action is None  # the fault was injected
            assert took < 4 * OP_TIMEOUT + 10, (took, res)
            if res.status == "stored":
                acked.append(a)
            else:
                assert res.status == "failed" and f"rank {bad}:" in res.reason, res
            t0 = time.monotonic()
            for t in acked:  # while the host may be away: a hit restores, anything else misses
                m = eng.lookup(Prefix.from_tokens(t, BT))
                got = eng.restore(m) if m.hit else None
                if got is not None:
                    assert_restores(eng, t, blocks=m.blocks)
            assert time.monotonic() - t0 < 2 * OP_TIMEOUT + 10
            rep = eng.audit()  # what can be checked holds; the audit says which rank it could not read
            assert rep.ok, rep.to_dict()
            down = [i["rank"] for i in rep.ranks if "unavailable" in i]
            if fault in ("kill", "link-down"):
                assert down == [bad] and "unavailable, not checked" in rep.checked[1], rep.to_dict()
            heal(hosts, fault, bad, background, group.init_method)
            remotes[bad].reconnect(timeout=60)
            eng.reclaim()
            assert eng.stats()["garbage_bytes"] == 0
            for t in acked:
                assert_restores(eng, t, blocks=len(t) // BT)
            c = tokens_for(13, 4)  # the cache takes stores again
            assert store_tokens(eng, c).status == "stored"
            assert_restores(eng, c, blocks=4)
            assert_clean(eng)
            eng.close()
        finally:
            for t in background:
                t.join(30)
            group.close()


def read_log(hosts: NetnsHosts, name: str) -> str:
    with open(os.path.join(hosts.base, name), errors="replace") as f:
        return f.read()


def test_coordinator_host_lost_silently(hosts):
    """The coordinator's host vanishes without closing a connection (its link pulled,
    then every process on it killed: no FIN or RST ever reaches the ranks). Each rank
    server notices within its bound (the coordinator's store stops answering) and
    exits 1 instead of waiting forever; restarted against a new coordinator on another
    host, the cache opens, recovers, restores every acknowledged store and audits clean."""
    tok = token_file(hosts)
    root = os.path.join(hosts.base, "cache")
    coord = hosts.spawn(hosts.coord_ns, [sys.executable, os.path.join(HERE, "netns_coordinator.py"), root,
                                         hosts.coord_ip, "2", tok], "coordinator.log")
    wait_until(lambda: "PORT" in read_log(hosts, "coordinator.log"), 60, hosts.logs())
    port = int(read_log(hosts, "coordinator.log").split("PORT ")[1].split()[0])
    ranks = [hosts.start_rank(r, f"tcp://{hosts.coord_ip}:{port}", token_file=tok, connect_timeout=4)
             for r in range(2)]
    wait_until(lambda: "ACKED" in read_log(hosts, "coordinator.log"), 90, hosts.logs())
    hosts.set_link_ns(hosts.switch, "c0", False)
    hosts.kill_ns(hosts.coord_ns)
    assert coord.wait(10) == -9
    t0 = time.monotonic()
    for p in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, 30 - (time.monotonic() - t0)))
    assert [p.poll() for p in ranks] == [1, 1], hosts.logs()  # not left waiting for a dead peer
    with hosts.coordinator(hosts.stranger_ns):  # a new coordinator, on another host
        group = RankGroup(hosts.stranger_ips[0], 0, gloo_host=hosts.stranger_ips[0], op_timeout=5,
                          connect_timeout=20, token=TOKEN)
        try:
            for r in range(2):
                hosts.start_rank(r, group.init_method, token_file=tok)
            with Engine.open(root, make_layout(ranks=2), CAP, ranks=group.connect(range(2), timeout=60)) as eng:
                for seed, blocks in ((31, 4), (32, 3)):
                    assert_restores(eng, tokens_for(seed, blocks), blocks=blocks)
                assert_clean(eng)
        finally:
            group.close()


# ------------------------------------------------------------------------ audit from the coordinator


def free_port_in(hosts: NetnsHosts) -> int:
    with hosts.coordinator(), socket.socket() as s:
        s.bind((hosts.coord_ip, 0))
        return s.getsockname()[1]


def json_line(text: str, prefix: str = "") -> dict:
    for line in text.splitlines():
        if line.startswith(prefix + "{"):
            return json.loads(line[len(prefix):])
    raise AssertionError(text)


def without_dirs(rep: dict) -> dict:
    return {**rep, "ranks": [{k: v for k, v in r.items() if k != "dir"} for r in rep["ranks"]]}


def test_audit_from_a_coordinator_that_sees_no_rank_disk(hosts):
    """Four ranks on four hosts, one shard damaged on host 2. ``prefixstore audit DIR
    --ranks tcp://...`` run where no rank directory is visible (its own mount namespace
    hides them) reads every rank through its rank server and prints the same JSON as
    the audit that reads the directories; so does a blind coordinator's ``Engine.audit``."""
    tok = token_file(hosts)
    root = os.path.join(hosts.base, "cache")
    with hosts.coordinator():
        group = group_in(hosts, token=TOKEN)
        try:
            for r in range(4):
                hosts.start_rank(r, group.init_method, token_file=tok)
            with Engine.open(root, make_layout(ranks=4), CAP, ranks=group.connect(range(4), timeout=60)) as eng:
                for seed, blocks in ((41, 4), (42, 3), (43, 2)):
                    assert store_tokens(eng, tokens_for(seed, blocks)).status == "stored"
        finally:
            group.close()
    victim = sorted(e for e in os.listdir(hosts.rank_dir(2)) if e.endswith(".st"))[0]
    with open(os.path.join(hosts.rank_dir(2), victim), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    want = audit_dir(root, rank_dirs=[hosts.rank_dir(r) for r in range(4)]).to_dict()
    assert not want["ok"] and [v["invariant"] for v in want["violations"]] == [1], want
    assert "rank 2" in want["violations"][0]["detail"], want

    blind = hosts.spawn_blind(hosts.coord_ns, ["ls", "-A", hosts.hosts_dir], "blind-ls.log")
    assert blind.wait(30) == 0 and read_log(hosts, "blind-ls.log") == ""
    port = free_port_in(hosts)
    init = f"tcp://{hosts.coord_ip}:{port}"
    for r in range(4):
        hosts.start_rank(r, init, token_file=tok)
    cli = hosts.spawn_blind(hosts.coord_ns, [sys.executable, "-m", "prefixstore.cli", "audit", root, "--json",
                                             "--ranks", init, "--token-file", tok, "--rank-timeout", "30"],
                            "audit-cli.log")
    assert cli.wait(120) == 1, hosts.logs()  # 1: a violation found
    got = json_line(read_log(hosts, "audit-cli.log"))
    assert without_dirs(got) == without_dirs(want)
    assert [r["dir"] for r in got["ranks"]] == [f"rank-server@vm:{hosts.rank_dir(r)}" for r in range(4)]

    coord = hosts.spawn_blind(hosts.coord_ns, [sys.executable, os.path.join(HERE, "netns_coordinator.py"), root,
                                               hosts.coord_ip, "4", tok, "audit"], "coordinator.log")
    wait_until(lambda: "PORT" in read_log(hosts, "coordinator.log"), 60, hosts.logs())
    port = int(read_log(hosts, "coordinator.log").split("PORT ")[1].split()[0])
    for r in range(4):
        hosts.start_rank(r, f"tcp://{hosts.coord_ip}:{port}", token_file=tok)
    assert coord.wait(120) == 0, hosts.logs()
    got = json_line(read_log(hosts, "coordinator.log"), "AUDIT ")
    assert [v["detail"] for v in got["violations"]] == [v["detail"] for v in want["violations"]], got
