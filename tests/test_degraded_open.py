"""Open with a rank down (degraded) and repair through rank servers, on loopback:
``RankServer`` threads of this process over the same gloo pairs and protocol as rank
processes (``tests/test_multihost_degraded.py`` runs both on network-namespace hosts
with rank processes, ``PREFIXSTORE_MULTIHOST_FULL=1``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import threading
import time

import pytest
from conftest import BT, assert_restores, make_layout, store_tokens, tokens_for
from prometheus_client import generate_latest

from prefixstore.base.errors import CatalogLostError, InvalidArgumentError, SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.cli import main
from prefixstore.engine import degraded, lifecycle
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir
from prefixstore.engine.repair import repair
from prefixstore.gpu.distributed import RankGroup
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.rank_server import RankServer
from prefixstore.gpu.ranks import LocalRank

CAP = 16 << 20


def rank_dir(base, r: int) -> str:
    return os.path.join(str(base), f"host{r}", f"rank{r}")


def serve(base, r: int, port: int) -> threading.Thread:
    """A rank server for rank ``r`` on a thread, for the coordinator's store at ``port``."""
    server = RankServer(r, rank_dir(base, r), "127.0.0.1", port, connect_timeout=20, gloo_host="127.0.0.1")
    t = threading.Thread(target=server.serve, daemon=True, name=f"rank-server-{r}")
    t.start()
    return t


def new_group() -> RankGroup:
    return RankGroup(op_timeout=5, connect_timeout=10, gloo_host="127.0.0.1")


class CrashBeforePublish(FaultHook):
    """Process death just before a store's publish commit (every shard written), once armed."""

    armed = False

    def before(self, op: str, target: str, rank: int | None) -> None:
        if self.armed and op == "commit" and target == "store.publish":
            self.armed = False
            raise SimulatedCrash(target)


def assert_revived(eng: Engine, rank: int, restorable: list[list[int]]) -> None:
    """What holds once the down ``rank`` is back and its deferred recovery ran: no garbage
    and no rank down (the stats and the gauge), one revival and one retried store, every
    conversation in ``restorable`` restores bit for bit, the audit is clean without notes,
    the charged bytes are the catalog's and its journal is empty."""
    st = eng.stats()
    assert st["garbage_bytes"] == 0 and st["ranks_down"] == {}, st
    assert st["counters"]["degraded.revived"] == 1 and st["counters"]["retries.succeeded"] == 1, st
    assert f'prefixstore_rank_down{{rank="{rank}"}} 0.0' in generate_latest(eng.counters.registry).decode()
    for t in restorable:
        assert_restores(eng, t, blocks=len(t) // BT)
    rep = eng.audit()
    assert rep.ok and not rep.notes, rep.to_dict()
    assert eng.account.charged == eng.catalog.charged() and not eng.catalog.journal()


def test_open_with_a_rank_down_then_reconnect(tmp_path):
    """Rank 1's server is not running when the cache (an unfinished store left by a
    crash, an orphan on rank 1) is opened: the open is degraded, not refused; lookups
    miss, stores are refused or queued, the gauges and counters say so. Rank 1 back,
    ``reconnect_ranks`` completes its recovery: garbage and orphan gone, the queued
    store stored, every acknowledged store restores, the audit is clean."""
    root = str(tmp_path / "cache")
    layout = make_layout(ranks=2)
    acked = [tokens_for(71, 4), tokens_for(72, 3)]
    hook = CrashBeforePublish()
    group = new_group()
    servers = [serve(tmp_path, r, group.port) for r in range(2)]
    eng = Engine.open(root, layout, CAP, hook=hook, ranks=group.connect(range(2), timeout=20))
    for t in acked:
        assert store_tokens(eng, t).status == "stored"
    hook.armed = True
    with pytest.raises(SimulatedCrash):
        store_tokens(eng, tokens_for(73, 2))
    lifecycle.abandon(eng.life)
    group.close()
    for t in servers:
        t.join(20)
    orphan = os.path.join(rank_dir(tmp_path, 1), "f" * 32 + "-g1.st")
    with open(orphan, "wb") as f:
        f.write(b"o" * 100)

    group = new_group()
    serve(tmp_path, 0, group.port)
    t0 = time.monotonic()
    ranks = group.connect(range(2), timeout=2, missing_ok=True)
    assert time.monotonic() - t0 < 5 and not ranks[1].available
    eng = Engine.open(root, layout, CAP, ranks=ranks)
    try:
        assert eng.degraded is not None and eng.degraded.ranks == (1,)
        assert len(eng.recovery_report.rolled_back) == 1 and not eng.recovery_report.damaged
        for t in acked:
            assert eng.lookup(Prefix.from_tokens(t, BT)).outcome == "miss"
        res = store_tokens(eng, tokens_for(74, 2))
        assert (res.status, res.reason) == ("refused", "ranks_down")
        queued = tokens_for(75, 2)
        assert store_tokens(eng, queued, valid=lambda: True).status == "queued"
        assert eng.stats()["garbage_bytes"] > 0  # the rolled-back store's shard on rank 1
        text = generate_latest(eng.counters.registry).decode()
        assert 'prefixstore_rank_down{rank="1"} 1.0' in text and 'prefixstore_rank_down{rank="0"} 0.0' in text
        assert 'prefixstore_state{kind="ranks_down"} 1.0' in text
        t0 = time.monotonic()
        assert eng.reconnect_ranks(0.3) == (1,)  # bounded: nobody registered
        assert time.monotonic() - t0 < 3
        with pytest.raises(InvalidArgumentError):
            eng.reconnect_ranks(-1)

        serve(tmp_path, 1, group.port)
        assert eng.reconnect_ranks(20) == ()
        assert eng.degraded is None
        assert not os.path.exists(orphan)
        assert_revived(eng, 1, [*acked, queued])
    finally:
        eng.close()
        group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_dirs(rep: dict) -> dict:
    return {**rep, "ranks": [{k: v for k, v in r.items() if k != "dir"} for r in rep["ranks"]]}


def test_audit_repair_through_rank_servers(tmp_path, capsys):
    """``prefixstore audit DIR --ranks tcp://... --repair``: the rank servers unlink the
    orphan, quarantine the foreign file and serve the reads that find the damaged
    shard; the JSON is that of a local repair of a copy; the directories audit clean."""
    root = str(tmp_path / "cache")
    group = new_group()
    servers = [serve(tmp_path, r, group.port) for r in range(2)]
    with Engine.open(root, make_layout(ranks=2), CAP, ranks=group.connect(range(2), timeout=20)) as eng:
        for seed, blocks in ((81, 4), (82, 3)):
            assert store_tokens(eng, tokens_for(seed, blocks)).status == "stored"
    group.close()
    for t in servers:
        t.join(20)
    victim = sorted(os.listdir(rank_dir(tmp_path, 1)))[0]
    with open(os.path.join(rank_dir(tmp_path, 1), victim), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    orphan = os.path.join(rank_dir(tmp_path, 0), "e" * 32 + "-g1.st")
    with open(orphan, "wb") as f:
        f.write(b"o" * 64)
    with open(os.path.join(rank_dir(tmp_path, 1), "notes.txt"), "wb") as f:
        f.write(b"not a shard")
    copy = tmp_path / "copy"
    for r in range(2):
        shutil.copytree(rank_dir(tmp_path, r), rank_dir(copy, r))
    shutil.copytree(root, copy / "cache")
    fix, rep = repair(str(copy / "cache"), rank_dirs=[rank_dir(copy, r) for r in range(2)])
    want = {**without_dirs(rep.to_dict()), "repair": fix.to_dict()}
    assert len(fix.lines()) == 3 and rep.ok, want

    port = free_port()
    for r in range(2):
        serve(tmp_path, r, port)
    assert main(["audit", root, "--json", "--repair", "--ranks", f"tcp://127.0.0.1:{port}",
                 "--rank-timeout", "20"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert without_dirs(got) == want
    assert [r["dir"].split(":", 1)[1] for r in got["ranks"]] == [rank_dir(tmp_path, r) for r in range(2)]
    assert not os.path.exists(orphan)
    assert os.listdir(os.path.join(tmp_path, "host1", "lost+found", "rank1")) == ["notes.txt"]
    after = audit_dir(root, rank_dirs=[rank_dir(tmp_path, r) for r in range(2)])
    assert after.ok and len(after.damaged_nodes) == 1, after.to_dict()


def test_audit_ranks_refuses_rank_dirs_and_a_bad_rank_count(tmp_path, capsys):
    for extra, said in ((["--rank-dir", str(tmp_path)], "not with --rank-dir"),
                        (["--rank-count", "0"], "--rank-count needs --ranks and a positive")):
        assert main(["audit", str(tmp_path), "--ranks", "tcp://127.0.0.1:1", *extra]) == 2
        assert said in capsys.readouterr().err
    assert main(["audit", str(tmp_path), "--rank-count", "2"]) == 2
    assert "--rank-count needs --ranks" in capsys.readouterr().err


def test_a_lost_catalog_is_rebuilt_through_the_rank_servers(tmp_path, capsys):
    """The catalog is lost (empty) and a shard on rank 1 is cut short: ``audit --ranks ... --repair
    --rebuild --rank-count 2`` (the rank directories are not beside the catalog, so it is
    not taken as lost by itself) rebuilds the catalog from the shards' headers read through the rank
    servers (the short shard quarantined by its rank server), the same JSON as a local
    rebuild of a copy; every checkpoint with all its shards restores afterwards."""
    root = str(tmp_path / "cache")
    layout = make_layout(ranks=2)
    convs = [tokens_for(s, b) for s, b in ((96, 4), (97, 3), (98, 2))]
    group = new_group()
    servers = [serve(tmp_path, r, group.port) for r in range(2)]
    with Engine.open(root, layout, CAP, ranks=group.connect(range(2), timeout=20)) as eng:
        for t in convs:
            assert store_tokens(eng, t).status == "stored"
    group.close()
    for t in servers:
        t.join(20)
    for name in os.listdir(root):
        if name.startswith("catalog.sqlite-"):
            os.unlink(os.path.join(root, name))
    os.truncate(os.path.join(root, "catalog.sqlite"), 0)  # lost: an empty catalog beside the shards
    victim = sorted(os.listdir(rank_dir(tmp_path, 1)))[0]
    path = os.path.join(rank_dir(tmp_path, 1), victim)
    os.truncate(path, os.path.getsize(path) - 8)  # cut short: it no longer verifies against its header
    copy = tmp_path / "copy"
    for r in range(2):
        shutil.copytree(rank_dir(tmp_path, r), rank_dir(copy, r))
    shutil.copytree(root, copy / "cache")
    fix, rep = repair(str(copy / "cache"), rank_dirs=[rank_dir(copy, r) for r in range(2)], rebuild_catalog=True)
    want = {**without_dirs(rep.to_dict()), "repair": fix.to_dict()}
    assert fix.rebuilt is not None and fix.rebuilt.nodes >= 2 and fix.rebuilt.quarantined, want

    port = free_port()
    for r in range(2):
        serve(tmp_path, r, port)
    assert main(["audit", root, "--json", "--repair", "--ranks", f"tcp://127.0.0.1:{port}",
                 "--rebuild", "--rank-count", "2", "--rank-timeout", "20"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert without_dirs(got) == want
    assert victim in os.listdir(os.path.join(tmp_path, "host1", "lost+found", "rank1"))
    after = audit_dir(root, rank_dirs=[rank_dir(tmp_path, r) for r in range(2)])
    assert after.ok, after.to_dict()
    with Engine.open(root, layout, CAP, ranks=[LocalRank(r, rank_dir(tmp_path, r)) for r in range(2)]) as eng:
        restored = [t for t in convs if eng.restore(eng.lookup(Prefix.from_tokens(t, BT))) is not None]
        assert len(restored) >= 2
        for t in restored:
            assert_restores(eng, t)


def test_audit_through_rank_servers_reports_a_rank_that_does_not_come(tmp_path, capsys):
    """``audit --ranks``: a rank server that does not register within --rank-timeout is
    reported unavailable (not checked), the others are audited; no violation found, but
    not shown sound: exit 3."""
    root = str(tmp_path / "cache")
    group = new_group()
    servers = [serve(tmp_path, r, group.port) for r in range(2)]
    with Engine.open(root, make_layout(ranks=2), CAP, ranks=group.connect(range(2), timeout=20)) as eng:
        assert store_tokens(eng, tokens_for(95, 3)).status == "stored"
    group.close()
    for t in servers:
        t.join(20)
    port = free_port()
    serve(tmp_path, 0, port)
    assert main(["audit", root, "--json", "--ranks", f"tcp://127.0.0.1:{port}", "--rank-timeout", "2"]) == 3
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [("unavailable" in r, r["files"]) for r in got["ranks"]] == [(False, 1), (True, 0)], got
    assert any("rank 1 is unavailable" in n for n in got["notes"]), got


def test_a_lookup_alone_brings_a_rank_back_that_serves_again(cache_dir) -> None:
    """The lookup asks the down ranks' tiers itself (once ``PROBE_S`` has passed): a rank
    marked down whose tier serves is brought back by the next lookup, and until then
    its hits miss."""
    layout = make_layout(ranks=2)
    tokens = tokens_for(76, 2)
    with Engine.open(cache_dir, layout, CAP) as eng:
        assert store_tokens(eng, tokens).ok
        prefix = Prefix.from_tokens(tokens, BT)
        down = eng.flows.reviving.tiers.down
        down.why[1] = "marked down by the test"
        down.probed = time.monotonic()  # just asked: the next lookup does not ask again
        assert eng.lookup(prefix).outcome == "miss" and eng.degraded is not None
        down.probed = time.monotonic() - 2 * degraded.PROBE_S
        assert eng.lookup(prefix).hit and eng.degraded is None
        assert eng.stats()["counters"]["degraded.revived"] == 1


@pytest.mark.parametrize("where", ["rank-servers", "rank-dirs"])
def test_an_open_refused_for_a_lost_catalog_names_the_command_that_rebuilds_it(tmp_path, capsys, where):
    """The catalog is lost on the coordinator while its ranks are served by rank servers
    (or kept outside the cache directory): ``Engine.open`` refuses, nothing changed, and
    names the command that rebuilds the catalog for such ranks; that command, run as
    named, rebuilds it and the store restores. (It used to name ``audit --repair DIR``,
    which reads neither rank servers nor rank directories kept elsewhere.)"""
    root = str(tmp_path / "cache")
    layout = make_layout(ranks=2)
    conv = tokens_for(93, 3)
    with Engine.open(root, layout, CAP, ranks=[LocalRank(r, rank_dir(tmp_path, r)) for r in range(2)]) as eng:
        assert store_tokens(eng, conv).status == "stored"
    for name in os.listdir(root):
        if name.startswith("catalog.sqlite"):
            os.unlink(os.path.join(root, name))
    shards = [sorted(os.listdir(rank_dir(tmp_path, r))) for r in range(2)]
    group = new_group()
    if where == "rank-servers":
        for r in range(2):
            serve(tmp_path, r, group.port)
        ranks = group.connect(range(2), timeout=20)
    else:
        ranks = [LocalRank(r, rank_dir(tmp_path, r)) for r in range(2)]
    with pytest.raises(CatalogLostError) as err:
        Engine.open(root, layout, CAP, ranks=ranks)
    group.close()
    assert [sorted(os.listdir(rank_dir(tmp_path, r))) for r in range(2)] == shards
    command = shlex.split(str(err.value).split("`")[1])
    assert command[:2] == ["prefixstore", "audit"] and "--rebuild" in command, command
    if where == "rank-servers":
        port = free_port()
        for r in range(2):
            serve(tmp_path, r, port)
        command = [c.replace("tcp://HOST:PORT", f"tcp://127.0.0.1:{port}") for c in command] + ["--rank-timeout", "20"]
    assert main(command[1:]) == 0, capsys.readouterr()
    with Engine.open(root, layout, CAP, ranks=[LocalRank(r, rank_dir(tmp_path, r)) for r in range(2)]) as eng:
        assert_restores(eng, conv)
