"""The campaign with real servers (``prefixstore/fuzz/cluster.py``): rank servers in
their own processes, SIGKILLed, powered off, stopped and restarted, and a redis-server
behind the remote tier, killed, stopped, flushed and with blobs altered in it.

Short campaigns only (CI): the plants in the rank-server and remote-tier paths are
found, a found remote failure shrinks to a reproducer that replays (and is clean
against the real engine), and a campaign of the real engine with every server fault
is clean. Longer campaigns: ``prefixstore fuzz --rank-servers N --remote redis``.
"""

from __future__ import annotations

import os

import pytest
from redis_servers import need_redis

from prefixstore.cli import main
from prefixstore.fuzz import netns, plants
from prefixstore.fuzz.campaign import load_reproducer, replay_in_tmp, run_campaign
from prefixstore.fuzz.driver import RunConfig, replay

CAUGHT_BY = {
    "rank-server-ack-before-fsync": {"audit:1", "damaged", "miss"},
    "remote-trusts-blob": {"bytes"},
}


def test_rank_server_plant_is_found():
    """A rank server that acknowledges a write before fsyncing it: the campaign takes
    that rank's host's power away after the publish, and the audit through the
    restarted rank server finds the acknowledged shard empty."""
    res = run_campaign(0, steps=150, plant=plants.get("rank-server-ack-before-fsync"), stop_after=1, shrink_s=0)
    assert res.violations, f"not found in {res.steps} ops: {res.to_dict()['cluster']}"
    v = res.violations[0]
    assert v["kind"] in CAUGHT_BY["rank-server-ack-before-fsync"], v
    cfg = v["config"]
    assert cfg["rank_servers"] == 1
    assert f"rank {cfg['ranks'] - 1}" in v["detail"], v  # the served rank (the highest)
    assert res.counts["cluster.rank_power"] >= 1


def test_remote_plant_is_found_and_its_reproducer_replays(tmp_path):
    """A remote tier that restores a fetched blob without checking it: a blob altered in
    redis is restored and its bytes differ. The saved reproducer names the remote run,
    alters a blob and fails again when replayed; without the plant the same ops are
    clean (the altered blob is a miss)."""
    need_redis()
    plant = plants.get("remote-trusts-blob")
    res = run_campaign(2, steps=600, plant=plant, stop_after=1, shrink_s=0, out=str(tmp_path))
    assert res.violations, f"not found in {res.steps} ops: {res.to_dict()['cluster']}"
    (v,) = res.violations
    assert v["kind"] in CAUGHT_BY[plant.name], v
    cfg, ops, got_plant, _ = load_reproducer(v["reproducer"])
    assert cfg.remote == "redis" and got_plant is plant
    assert any(op["op"] == "remote_damage" for op in ops), ops
    again, _ = replay_in_tmp(ops, cfg, plant)
    assert again is not None and again.kind == v["kind"]
    clean, n = replay_in_tmp(ops, cfg, None)
    assert clean is None and n == len(ops)


def test_every_server_fault_is_injected_and_the_real_engine_is_clean():
    """Rank servers killed, powered off, stopped and (on a host of their own: a network
    namespace, where this runs as root with ``ip``, as CI does) cut off, redis killed,
    stopped, flushed and altered, with the in-process faults and crashes as in any
    campaign: no violation; restores were served by the remote tier and compared bit
    for bit. The namespaces are gone afterwards."""
    need_redis()
    hosts = netns.unavailable() is None
    res = run_campaign(1, steps=120, ranks=2, rank_servers=1, remote="redis", netns=hosts)
    d = res.to_dict()
    assert not res.violations, res.violations
    ops = ["rank_kill", "rank_power", "rank_stop", "redis_kill", "redis_stop", "redis_flush", "remote_damage"]
    for op in ops + ["rank_cut"] * hosts:
        assert d["cluster"].get(op, 0) >= 1, d["cluster"]
    if hosts:
        assert not [ns for ns in os.listdir("/run/netns") if ns.startswith(f"psfz{os.getpid()}x")]
    assert res.counts["engine.remote.restored"] >= 1, {k: v for k, v in res.counts.items() if "remote" in k}
    assert d["outcomes"]["restore.ok"] >= 5
    assert all(f"rank_servers=1{' netns' * hosts} remote=redis" in c for c in d["configs"]), d["configs"]


def test_list_plants_names_the_server_plants_and_bad_options_are_exit_2(capsys):
    assert main(["fuzz", "--list-plants"]) == 0
    out = capsys.readouterr().out
    assert "rank-server-ack-before-fsync" in out and "remote-trusts-blob" in out
    assert main(["fuzz", "--rank-servers", "-1", "--steps", "1", "--quiet"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["fuzz", "--remote", "memcached", "--steps", "1", "--quiet"])
    assert exc.value.code == 2


def test_a_remote_miss_restores_the_local_shallower_hit_and_that_is_no_violation(tmp_path):
    """A remote match whose blob fails verification falls back to the local tiers'
    shallower hit (``Restored.match`` names it): the model compares the bytes against
    what was served, not against the remote match's depth (found by a 10-minute campaign
    of this mode: a false ``bytes`` violation)."""
    need_redis()
    cfg = RunConfig(ranks=1, remote="redis", snapshot=False)
    ops = [{"op": "store", "seq": 1, "blocks": 2}, {"op": "store", "seq": 1, "blocks": 4},
           {"op": "evict_key", "seq": 1, "blocks": 4},  # local: blocks 2; remote: 2 and 4
           {"op": "remote_damage", "i": 0, "at": 0.5, "bit": 3},  # a blob of blocks 4 (not held locally)
           {"op": "restore", "seq": 1, "blocks": 4}]
    v, n, d = replay(ops, cfg, str(tmp_path / "cache"))
    assert v is None and n == len(ops), v
    assert d.counts["engine.remote.missed"] == 1 and d.counts["restore.ok"] == 1, d.counts
