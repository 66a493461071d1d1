"""Adding a tier is one module plus a registry entry: ``tests/tier_dict.py``, registered
here, serves an engine end to end (store, restore bit for bit, audit, a corrupted shard
found as damage through the one verified read path), used only through what it
declares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_restores, make_layout, node_at, store_tokens, tokens_for
from tier_dict import DictBacking, DictRank

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir
from prefixstore.gpu import tiers, verify
from prefixstore.gpu.tier import Capability

CAP = 16 << 20
ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def dict_tier():
    tiers.register("dict", DictBacking)
    try:
        yield
    finally:
        tiers.unregister("dict")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_registered_tier_serves_an_engine_end_to_end(tmp_path, dict_tier, ranks):
    L = make_layout(ranks=ranks)
    toks = tokens_for(7, 6)
    with Engine.open(str(tmp_path / "c"), L, CAP, backing="dict") as eng:
        assert eng.backing.kind == "dict" and all(isinstance(r, DictRank) for r in eng.ranks)
        for b in (2, 4, 6):
            assert store_tokens(eng, toks[: b * 4]).ok
        assert all(len(r.shards) == 3 for r in eng.ranks)  # written through write_shard
        before = [r.reads for r in eng.ranks]
        assert_restores(eng, toks, blocks=6)
        assert all(r.reads > b for r, b in zip(eng.ranks, before, strict=True))
        assert eng.audit().ok
        assert eng.stats()["backing"] == {"kind": "dict"}

        node = node_at(eng, toks)
        name = next(n for n in eng.ranks[-1].shards if n.startswith(node.key.hex()))
        eng.ranks[-1].shards[name][-1] ^= 0xFF  # one bit of tensor data flipped at rest
        rep = eng.audit()
        assert any(v.invariant == 1 and "checksum mismatch" in v.detail for v in rep.violations), rep.violations
        m = eng.lookup(Prefix.from_tokens(toks, L.block_tokens))
        assert m.blocks == 6
        assert eng.restore(m) is None  # damage, never wrong bytes
        assert node.state == "damaged"
        assert eng.lookup(Prefix.from_tokens(toks, L.block_tokens)).blocks == 4
    with Engine.open(str(tmp_path / "c"), L, CAP, backing="dict") as eng:  # volatile: its rows died with it
        assert len(eng.index) == 0 and not eng.lookup(Prefix.from_tokens(toks, L.block_tokens)).hit
        assert eng.audit().ok


def test_the_verified_read_path_reports_damage_and_transient_errors():
    t = DictRank(0)
    t.write_shard("a", b"x" * 10)
    ck = verify.shards.checksum(b"x" * 10)
    assert isinstance(verify.read(t, "a", 10, ck), verify.Shard)
    assert verify.read(t, "b", 10, ck) == verify.Damage("shard b missing")
    assert verify.read(t, "a", 11, ck) == verify.Damage("shard a is 10 bytes, catalog says 11")
    t.shards["a"][0] ^= 1
    assert verify.read(t, "a", 10, ck) == verify.Damage("shard a: checksum mismatch")
    assert verify.resident(t, "a", 10) is None  # no RESIDENT_VIEWS declared: view_shard not called

    class Down(DictRank):
        def read_shard(self, name):
            raise E.RankUnavailableError(5, "rank down")

    got = verify.read(Down(0), "a", 10, ck)
    assert isinstance(got, verify.Transient) and got.unavailable
    assert Capability.VOLATILE in t.capabilities and Capability.RESIDENT_VIEWS not in t.capabilities


def test_an_unknown_tier_name_is_a_typed_error_and_a_name_is_registered_once(tmp_path, dict_tier):
    with pytest.raises(tiers.UnknownTierError, match="tape"):
        tiers.lookup("tape")
    with pytest.raises(E.InvalidInputError, match="already registered"):
        tiers.register("dict", DictBacking)
    with pytest.raises(E.InvalidInputError, match="backing"):
        Engine.open(str(tmp_path / "c"), make_layout(), CAP, backing="tape")


def test_a_registered_tier_audits_clean_offline_in_and_out_of_process(tmp_path, dict_tier):
    """The test tier's cache audited with no engine holding it: clean, as the same cache
    on ``memory`` is (its rows describe the engine's RAM, not the rank directories),
    in this process and by ``prefixstore audit DIR`` in a process where the tier is not
    registered (the catalog records that its backing was volatile)."""
    L = make_layout(ranks=2)
    toks = tokens_for(7, 6)
    reports = {}
    for backing in ("dict", "memory"):
        root = str(tmp_path / backing)
        with Engine.open(root, L, CAP, backing=backing) as eng:
            for b in (2, 4, 6):
                assert store_tokens(eng, toks[: b * 4]).ok
            assert eng.audit().ok
            assert audit_dir(root).ok  # beside the running engine: its RAM is not visible from here
        reports[backing] = audit_dir(root)
        cli = subprocess.run([sys.executable, "-m", "prefixstore.cli", "audit", root, "--json"],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
        out = json.loads(cli.stdout)
        assert cli.returncode == 0 and out["ok"] and not out["violations"], (backing, cli.stdout, cli.stderr)
        assert out["recovery"] == reports[backing].recovery
    dict_rep, mem_rep = reports["dict"], reports["memory"]
    assert dict_rep.ok, dict_rep.violations
    unchecked = {i for i in dict_rep.checked if dict_rep.status(i) == "not checked"}
    assert unchecked == {i for i in mem_rep.checked if mem_rep.status(i) == "not checked"} >= {1, 3, 5, 8}
    assert "backing=dict" in dict_rep.checked[1] and any("volatile" in r for r in dict_rep.recovery)
    with Engine.open(str(tmp_path / "dict"), L, CAP, backing="dict") as eng:  # the reopen drops its rows
        assert len(eng.index) == 0
    assert audit_dir(str(tmp_path / "dict")).ok
