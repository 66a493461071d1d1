"""Backings: memory (volatile), disk (durable), composite (RAM in front of disk,
write-through). Restart semantics, each tier's own capacity and counters, exact
accounting checked by the audit (and the audit catching a planted accounting bug)."""

from __future__ import annotations

import os

import pytest
from conftest import (
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine import lifecycle
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CountingHook, CrashAt

CAP = 16 << 20
BACKINGS = ["disk", "memory", "composite"]


def fill(eng: Engine, seeds=range(3)) -> list[list[int]]:
    """A chain and a few conversations; returns every stored token list."""
    stored = []
    for s in seeds:
        toks = tokens_for(s, 6)
        for b in (2, 4, 6):
            assert store_tokens(eng, toks[: b * 4]).ok
            stored.append(toks[: b * 4])
    return stored


@pytest.mark.parametrize("backing", BACKINGS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_restart_keeps_durable_rows_and_drops_volatile_ones(tmp_path, backing, ranks):
    L = make_layout(ranks=ranks)
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP, backing=backing, ram_bytes=CAP) as eng:
        stored = fill(eng)
        for t in stored:
            assert_restores(eng, t, blocks=len(t) // 4)
        assert eng.audit().ok
        before = eng.account.charged
    with Engine.open(root, L, CAP, backing=backing) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        if backing == "memory":
            assert len(eng.index) == 0 and eng.account.charged == 0
            assert not eng.catalog.query("SELECT 1 FROM files")
            for t in stored:
                assert eng.lookup(Prefix.from_tokens(t, 4)).outcome == "miss"
            assert not os.listdir(os.path.join(root, "rank0"))  # nothing was ever on disk
        else:
            assert eng.account.charged == before
            for t in stored:
                assert_restores(eng, t, blocks=len(t) // 4)
            if backing == "composite":
                ram = eng.stats()["backing"]["ram"]
                assert ram["promotions"] > 0 and ram["hits"] > 0  # the disk copy refilled RAM
        # the restarted cache keeps working
        assert store_tokens(eng, tokens_for(99, 3)).ok
        assert eng.audit().ok


def test_memory_crash_then_reopen_is_clean_including_a_crash_in_the_drop(tmp_path):
    L = make_layout(ranks=2)

    def crashed_cache(root):
        eng = Engine.open(root, L, CAP, backing="memory", synchronous="NORMAL")
        fill(eng, seeds=range(2))
        lifecycle.abandon(eng.life)  # process death: RAM gone, catalog left as it was

    counter = CountingHook()
    crashed_cache(str(tmp_path / "count"))
    Engine.open(str(tmp_path / "count"), L, CAP, backing="memory", hook=counter).close()
    assert counter.count >= 2  # the drop commit, before and after
    for i in range(counter.count):
        root = str(tmp_path / f"c{i}")
        crashed_cache(root)
        hook = CrashAt(i)
        with pytest.raises(E.SimulatedCrash):
            Engine.open(root, L, CAP, backing="memory", hook=hook)
        assert hook.fired is not None
        with Engine.open(root, L, CAP, backing="memory") as eng:
            assert eng.audit().ok and len(eng.index) == 0 and not eng.catalog.journal()
            assert store_tokens(eng, tokens_for(5, 2)).ok


def test_memory_capacity_is_the_ram_budget_with_exact_accounting(tmp_path):
    L = make_layout()
    one = None
    with Engine.open(str(tmp_path / "c"), L, 6000, backing="memory") as eng:
        for s in range(40):
            r = store_tokens(eng, tokens_for(200 + s, 3))
            assert r.ok
            one = r.nbytes
            ram = eng.stats()["backing"]["ram"]
            assert ram["used_bytes"] == eng.account.charged <= 6000 == ram["capacity_bytes"]
        assert eng.stats()["counters"].get("evictions.evict", 0) >= 40 - 6000 // one
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert rep.accounting["ram_memory_used"] == eng.account.charged


def test_composite_serves_ram_hits_and_falls_back_to_disk_after_lru_eviction(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    convs = [tokens_for(300 + i, 4) for i in range(6)]
    with Engine.open(root, L, CAP, backing="composite", ram_bytes=2000) as eng:
        sizes = [store_tokens(eng, t).nbytes for t in convs]
        ram = eng.stats()["backing"]["ram"]
        assert ram["used_bytes"] <= 2000 and ram["evictions"] >= len(convs) - 2000 // sizes[0]
        copies = eng.stats()["transfers"]["copies"]
        assert_restores(eng, convs[-1])  # the most recent: a RAM hit, no file read
        assert eng.stats()["transfers"]["copies"]["tier_read_bytes"] == copies["tier_read_bytes"]
        assert_restores(eng, convs[0])  # evicted from RAM: read from disk, then promoted
        after = eng.stats()["transfers"]["copies"]
        assert after["tier_read_bytes"] - copies["tier_read_bytes"] == sizes[0]
        hits = eng.stats()["backing"]["ram"]["hits"]
        assert_restores(eng, convs[0])
        assert eng.stats()["backing"]["ram"]["hits"] == hits + 1
        assert eng.stats()["transfers"]["copies"]["tier_read_bytes"] == after["tier_read_bytes"]
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        # evicting a node removes it from both tiers
        node = node_at(eng, convs[0])
        name = f"{node.key.hex()}-g{node.generation}.st"
        assert (0, name) in dict(eng.backing.tier.items())
        assert eng.evict(prefix=Prefix.from_tokens(convs[0], 4)) == sizes[0]
        assert (0, name) not in dict(eng.backing.tier.items())
        assert not os.path.exists(os.path.join(root, "rank0", name))
        assert eng.audit().ok


@pytest.mark.parametrize("ranks", [1, 2])
def test_mixed_ram_and_disk_restore_returns_every_buffer_on_success_and_on_damage(tmp_path, ranks):
    """A restore takes the RAM-resident shards first and reads the rest: whether it
    succeeds or stops at a damaged file, every RAM buffer it took is handed back (the
    tier's own reference is the only one left) and no staging buffer stays out."""
    L = make_layout(ranks=ranks)
    root = str(tmp_path / "c")
    toks = tokens_for(410, 8)
    with Engine.open(root, L, CAP, backing="composite", ram_bytes=CAP) as eng:
        for b in (2, 4, 6, 8):
            assert store_tokens(eng, toks[: b * 4]).ok
        tier = eng.backing.tier
        path = eng.index.path(node_at(eng, toks))
        names = [f"{x.key.hex()}-g{x.generation}.st" for x in path]
        for name in names[:2]:  # the two deepest stay in RAM; the others are read from disk
            for r in range(ranks):
                assert tier.remove(r, name)

        def quiet() -> None:
            assert all(buf.refs == 1 for _, buf in tier.items())
            assert eng.stats()["transfers"]["staging_pool"]["outstanding_bytes"] == sum(
                b.klass for _, b in tier.items())

        before = eng.stats()["transfers"]["copies"]["tier_read_bytes"]
        assert_restores(eng, toks, blocks=8)
        assert eng.stats()["transfers"]["copies"]["tier_read_bytes"] > before  # some shards were read
        quiet()
        for name in names[:2]:  # promoted again by that restore: take them out once more
            for r in range(ranks):
                tier.remove(r, name)
        with open(os.path.join(root, f"rank{ranks - 1}", names[1]), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        assert eng.restore(eng.lookup(Prefix.from_tokens(toks, 4))) is None  # damaged: a miss
        quiet()
        assert eng.lookup(Prefix.from_tokens(toks, 4)).blocks == 2  # above the damaged node


def test_composite_ram_copy_never_hides_disk_damage_after_restart(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    toks = tokens_for(400, 4)
    with Engine.open(root, L, CAP, backing="composite", ram_bytes=CAP) as eng:
        store_tokens(eng, toks)
        name = eng.catalog.query("SELECT name FROM files")[0][0]
        path = os.path.join(root, "rank0", name)
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        assert_restores(eng, toks)  # the RAM copy is the bytes stored: still right
        assert not eng.audit().ok  # but the audit sees the damaged file
    with Engine.open(root, L, CAP, backing="composite") as eng:
        assert eng.restore(eng.lookup(Prefix.from_tokens(toks, 4))) is None  # a miss, never other bytes
        assert eng.lookup(Prefix.from_tokens(toks, 4)).outcome in ("damaged", "miss")


@pytest.mark.parametrize("backing", ["memory", "composite"])
def test_audit_catches_ram_tier_accounting_errors(tmp_path, backing):
    L = make_layout()
    with Engine.open(str(tmp_path / "c"), L, CAP, backing=backing) as eng:
        store_tokens(eng, tokens_for(500, 3))
        tier = eng.backing.tier
        assert eng.audit().ok
        tier.used += 1  # a planted accounting bug
        rep = eng.audit()
        assert not rep.ok and any(v.invariant == 3 for v in rep.violations)
        tier.used -= 1
        (_, buf), = tier.items()
        buf.view()[-1] ^= 0xFF  # a bit flipped in RAM
        rep = eng.audit()
        assert not rep.ok and any(v.invariant == 1 for v in rep.violations)
        buf.view()[-1] ^= 0xFF
        stray = eng.executor.pool.acquire(64)
        tier.insert(0, "0" * 32 + "-g9.st", stray)  # a shard the catalog does not know
        rep = eng.audit()
        assert not rep.ok and any(v.invariant == 3 for v in rep.violations)
        tier.remove(0, "0" * 32 + "-g9.st")
        assert eng.audit().ok


def test_backing_options_are_checked_and_switching_is_safe(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    with pytest.raises(E.InvalidInputError):
        Engine.open(str(tmp_path / "x"), L, CAP, backing="tape")
    with pytest.raises(E.InvalidInputError):
        Engine.open(str(tmp_path / "y"), L, CAP, backing="composite", ram_bytes=0)
    with pytest.raises(E.InvalidInputError):
        Engine.open(str(tmp_path / "z"), L, CAP, backing="memory", ram_bytes=CAP // 2)
    toks = tokens_for(600, 3)
    with Engine.open(root, L, CAP) as eng:
        store_tokens(eng, toks)
    with pytest.raises(E.InvalidInputError):
        Engine.open(root, L, CAP, backing="memory")  # would orphan durable files
    with Engine.open(root, L, CAP, backing="composite") as eng:  # disk <-> composite: same files
        assert_restores(eng, toks)
    with Engine.open(root, L, CAP) as eng:
        assert_restores(eng, toks)
        eng.evict(prefix=Prefix.from_tokens(toks, 4))
    with Engine.open(root, L, CAP, backing="memory") as eng:  # empty now: allowed
        store_tokens(eng, toks)
    with Engine.open(root, L, CAP) as eng:  # volatile rows dropped, then durable again
        assert len(eng.index) == 0 and eng.audit().ok
        store_tokens(eng, toks)
        assert_restores(eng, toks)


@pytest.mark.parametrize("backing", ["memory", "composite"])
def test_failed_rank_write_rolls_back_on_every_backing(tmp_path, backing):
    L = make_layout(ranks=2)
    with Engine.open(str(tmp_path / "c"), L, CAP, backing=backing) as eng:
        a = tokens_for(700, 4)
        store_tokens(eng, a[:8])
        bad = eng.ranks[1]
        orig = bad.adopt_shard

        def fail(name, buf):
            raise OSError(28, "no space")

        bad.adopt_shard = fail
        res = eng.store(Prefix.from_tokens(a, 4), seg_tensors(L, a), snap_tensors(L, a))
        assert res.status == "failed"
        bad.adopt_shard = orig
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        tier = eng.backing.tier
        assert tier.used == sum(b.nbytes for _, b in tier.items())
        # every staging buffer not held by the tier went back to the pool (no leak)
        assert eng.stats()["transfers"]["staging_pool"]["outstanding_bytes"] == sum(b.klass for _, b in tier.items())
        assert store_tokens(eng, a).ok
        assert_restores(eng, a, blocks=4)


def test_out_of_process_audit_of_a_memory_cache_checks_the_catalog_only(tmp_path):
    from prefixstore.engine.audit import audit_dir

    L = make_layout()
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP, backing="memory") as eng:
        fill(eng, seeds=range(1))
        rep = audit_dir(root)  # beside the running engine: its RAM is not visible from here
        assert rep.ok and "memory" in rep.checked[1]
    rep = audit_dir(root)
    assert rep.ok and any("volatile" in r for r in rep.recovery)
    with Engine.open(root, L, CAP, backing="memory"):
        pass
    assert not any("volatile" in r for r in audit_dir(root).recovery)  # dropped by the reopen
