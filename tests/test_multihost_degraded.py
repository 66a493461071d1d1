"""A coordinator that opens with a rank host down (degraded), and repairs through
the rank servers alone: rank processes on network-namespace "hosts"
(``tests/netns_hosts.py``, built once for the module), the coordinator in a namespace
of its own. About 40 s a test on a loaded 2-core machine: run with
``PREFIXSTORE_MULTIHOST_FULL=1``; CI runs the same scenarios on loopback with rank
server threads (``tests/test_degraded_open.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
from conftest import BT, make_layout, store_tokens, tokens_for
from netns_hosts import NetnsHosts, netns_leftovers, require_netns
from prometheus_client import generate_latest
from test_degraded_open import CrashBeforePublish, assert_revived

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.engine import lifecycle
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir
from prefixstore.engine.repair import repair
from prefixstore.gpu.distributed import RankGroup

pytestmark = pytest.mark.skipif(os.environ.get("PREFIXSTORE_MULTIHOST_FULL") != "1",
                                reason="PREFIXSTORE_MULTIHOST_FULL=1 runs the rank processes on namespace hosts")
CAP = 16 << 20
RANKS = 4
BAD = 2
TOKEN = b"a-token-shared-by-coordinator-and-ranks"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    require_netns()
    h = NetnsHosts(RANKS, str(tmp_path_factory.mktemp("hosts")))
    try:
        yield h
    finally:
        h.close()
        assert not netns_leftovers(h)


@pytest.fixture
def fresh(hosts):
    """The module's hosts with no process running and empty rank directories."""
    for r in range(RANKS):
        hosts.kill_host(r)
        shutil.rmtree(os.path.dirname(hosts.rank_dir(r)))
        os.makedirs(hosts.rank_dir(r))
    for name in os.listdir(hosts.base):
        if name.endswith(".log"):
            os.unlink(os.path.join(hosts.base, name))
    yield hosts
    for r in range(RANKS):
        hosts.kill_host(r)


def token_file(hosts: NetnsHosts) -> str:
    path = os.path.join(hosts.base, "token")
    with open(path, "wb") as f:
        f.write(TOKEN + b"\n")
    return path


def group_in(hosts: NetnsHosts) -> RankGroup:
    return RankGroup(hosts.coord_ip, 0, gloo_host=hosts.coord_ip, op_timeout=3, connect_timeout=15, token=TOKEN)


def wait_until(cond, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def gauges(eng: Engine) -> str:
    return generate_latest(eng.counters.registry).decode()


def test_open_with_a_rank_host_down_then_back(fresh):
    """The coordinator dies just before publishing a 4-rank store; its cache is
    reopened while host 2 is down (its rank server not running; an orphan shard left
    on its disk). The open is degraded (``Engine.degraded`` names rank 2): the
    unfinished store is rolled back on the ranks that answer, lookups miss, stores are
    refused (``ranks_down``) or queued, the gauges and the audit say rank 2 is down.
    Host 2's rank server restarted: the next lookup brings it back, its deferred
    recovery removes the rolled-back store's shard and the orphan, the queued store is
    stored, every acknowledged store restores bit for bit, the audit is clean."""
    hosts = fresh
    tok = token_file(hosts)
    root = os.path.join(hosts.base, "cache-degraded")
    layout = make_layout(ranks=RANKS)
    acked = [tokens_for(51, 4), tokens_for(52, 3)]
    hook = CrashBeforePublish()
    with hosts.coordinator():
        group = group_in(hosts)
        try:
            for r in range(RANKS):
                hosts.start_rank(r, group.init_method, token_file=tok)
            eng = Engine.open(root, layout, CAP, hook=hook, ranks=group.connect(range(RANKS), timeout=60))
            for t in acked:
                assert store_tokens(eng, t).status == "stored"
            hook.armed = True
            with pytest.raises(SimulatedCrash):
                store_tokens(eng, tokens_for(53, 2))
            lifecycle.abandon(eng.life)
        finally:
            group.close()
    hosts.kill_host(BAD)
    left = set(os.listdir(hosts.rank_dir(BAD)))  # the crashed store's shard is among them
    assert len(left) == 3, left
    orphan = os.path.join(hosts.rank_dir(BAD), "f" * 32 + "-g1.st")
    with open(orphan, "wb") as f:
        f.write(b"o" * 100)

    queued = tokens_for(54, 2)
    with hosts.coordinator():
        group = group_in(hosts)
        try:
            for r in set(range(RANKS)) - {BAD}:
                hosts.start_rank(r, group.init_method, token_file=tok)
            up = group.connect([r for r in range(RANKS) if r != BAD], timeout=60)
            ranks = [*up[:BAD], group.remote(BAD), *up[BAD:]]  # rank 2 never registered
            t0 = time.monotonic()
            eng = Engine.open(root, layout, CAP, ranks=ranks)
            assert time.monotonic() - t0 < 10
            try:
                assert eng.degraded is not None and eng.degraded.ranks == (BAD,), eng.degraded
                assert "rank 2 is unavailable" in eng.degraded.why[BAD]
                assert len(eng.recovery_report.rolled_back) == 1, eng.recovery_report
                for t in acked:
                    assert eng.lookup(Prefix.from_tokens(t, BT)).outcome == "miss"
                res = store_tokens(eng, tokens_for(55, 2))
                assert (res.status, res.reason) == ("refused", "ranks_down"), res
                assert store_tokens(eng, queued, valid=lambda: True).status == "queued"
                rep = eng.audit()
                assert rep.ok, rep.to_dict()
                assert [i["rank"] for i in rep.ranks if "unavailable" in i] == [BAD], rep.to_dict()
                assert any("runs without rank 2" in n for n in rep.notes), rep.notes
                st = eng.stats()
                assert list(st["ranks_down"]) == ["2"] and st["garbage_bytes"] > 0, st
                assert st["counters"]["skips.ranks_down"] == 2 and st["counters"]["degraded.lookup_missed"] == 2
                text = gauges(eng)
                assert 'prefixstore_rank_down{rank="2"} 1.0' in text and 'prefixstore_rank_down{rank="1"} 0.0' in text
                assert 'prefixstore_state{kind="ranks_down"} 1.0' in text
                assert os.path.exists(orphan) and set(os.listdir(hosts.rank_dir(BAD))) == left | {os.path.basename(orphan)}

                hosts.start_rank(BAD, group.init_method, token_file=tok)
                wait_until(lambda: eng.lookup(Prefix.from_tokens(acked[0], BT)).hit, 60, hosts.logs)
                assert eng.degraded is None and eng.reconnect_ranks() == ()
                assert 'prefixstore_state{kind="ranks_down"} 0.0' in gauges(eng)
                assert not os.path.exists(orphan)
                assert len(os.listdir(hosts.rank_dir(BAD))) == 3  # the two acked and the queued store
                assert_revived(eng, BAD, [*acked, queued])
            finally:
                eng.close()
        finally:
            group.close()


def json_line(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(text)


def without_dirs(rep: dict) -> dict:
    return {**rep, "ranks": [{k: v for k, v in r.items() if k != "dir"} for r in rep["ranks"]]}


def test_repair_from_a_coordinator_that_sees_no_rank_disk(fresh):
    """A shard damaged on host 2, an orphan shard on host 1 and a foreign file on host
    3. ``prefixstore audit DIR --ranks tcp://... --repair`` run where no rank directory
    is visible repairs through the rank servers alone: the same JSON as a local repair
    of a copy; the orphan is unlinked and the foreign file quarantined on their hosts,
    the damaged node invalidated, and the hosts' directories then audit clean."""
    hosts = fresh
    tok = token_file(hosts)
    root = os.path.join(hosts.base, "cache-repair")
    with hosts.coordinator():
        group = group_in(hosts)
        try:
            for r in range(RANKS):
                hosts.start_rank(r, group.init_method, token_file=tok)
            with Engine.open(root, make_layout(ranks=RANKS), CAP, ranks=group.connect(range(RANKS), timeout=60)) as eng:
                for seed, blocks in ((61, 4), (62, 3)):
                    assert store_tokens(eng, tokens_for(seed, blocks)).status == "stored"
        finally:
            group.close()
    victim = sorted(e for e in os.listdir(hosts.rank_dir(2)) if e.endswith(".st"))[0]
    with open(os.path.join(hosts.rank_dir(2), victim), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    orphan = os.path.join(hosts.rank_dir(1), "e" * 32 + "-g1.st")
    with open(orphan, "wb") as f:
        f.write(b"o" * 64)
    with open(os.path.join(hosts.rank_dir(3), "notes.txt"), "wb") as f:
        f.write(b"not a shard")
    copy = os.path.join(hosts.base, "copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(hosts.hosts_dir, os.path.join(copy, "hosts"))
    shutil.copytree(root, os.path.join(copy, "cache"))
    local_fix, local_rep = repair(os.path.join(copy, "cache"), rank_dirs=[
        os.path.join(copy, "hosts", f"host{r}", f"rank{r}") for r in range(RANKS)])
    want = {**without_dirs(local_rep.to_dict()), "repair": local_fix.to_dict()}
    assert len(want["repair"]["changes"]) == 3 and want["ok"], want

    for r in range(RANKS):
        hosts.start_rank(r, f"tcp://{hosts.coord_ip}:29517", token_file=tok)
    cli = hosts.spawn_blind(hosts.coord_ns, [sys.executable, "-m", "prefixstore.cli", "audit", root, "--json",
                                             "--repair", "--ranks", f"tcp://{hosts.coord_ip}:29517",
                                             "--token-file", tok, "--rank-timeout", "30"], "repair-cli.log")
    assert cli.wait(120) == 0, hosts.logs()
    with open(os.path.join(hosts.base, "repair-cli.log"), errors="replace") as f:
        got = json_line(f.read())
    assert without_dirs(got) == want
    assert not os.path.exists(orphan)
    assert os.listdir(os.path.join(hosts.hosts_dir, "host3", "lost+found", "rank3")) == ["notes.txt"]
    after = audit_dir(root, rank_dirs=[hosts.rank_dir(r) for r in range(RANKS)])
    assert after.ok, after.to_dict()
    assert len(after.damaged_nodes) == 1

