"""Every planted bug is found by the campaign runner within a bounded budget, by the
check meant to catch it; a found failure shrinks to a short reproducer that replays.

Budgets are op counts from campaign seed 0 (runs drawn as in any campaign, with the
settings a plant needs to show at all, e.g. synchronous=NORMAL for lost commits).
"""

from __future__ import annotations

import json

import pytest

from prefixstore.cli import main
from prefixstore.fuzz import plants
from prefixstore.fuzz.campaign import load_reproducer, replay_in_tmp, run_campaign

BUDGET = 6000  # ops; from seed 0 the slowest plant (rename-over-live) is found after ~2600

CAUGHT_BY = {
    "publish-early": {"damaged", "miss", "audit:1"},
    "skip-dir-fsync": {"damaged", "miss", "audit:1"},
    "double-count-retire": {"audit:3", "capacity"},
    "evict-pinned": {"pin", "audit:6"},
    "rename-over-live": {"audit:1", "audit:2", "damaged", "miss"},  # 2: a cached row no longer the catalog's
    "skip-orphan-cleanup": {"audit:3"},
    "skip-restore-checksum": {"bytes"},
    "skip-barrier": {"damaged", "miss", "audit:1"},
}


def test_every_plant_is_listed_and_has_an_expected_catch():
    assert set(plants.PLANTS) == set(CAUGHT_BY)
    assert len(plants.PLANTS) >= 7


@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_plant_is_found_within_budget(name):
    res = run_campaign(0, steps=BUDGET, plant=plants.get(name), stop_after=1, shrink_s=0)
    assert res.violations, f"plant {name} not found in {res.steps} ops"
    v = res.violations[0]
    assert v["kind"] in CAUGHT_BY[name], v


def test_found_failure_shrinks_and_replays(tmp_path, capsys):
    out = tmp_path / "repro"
    rc = main(["fuzz", "--plant", "skip-dir-fsync", "--steps", str(BUDGET), "--stop-after", "1",
               "--shrink-seconds", "20", "--out", str(out), "--json", "--quiet"])
    assert rc == 1
    report = json.loads(capsys.readouterr().out)
    (v,) = report["violations"]
    assert v["replayed"] is True
    assert v["shrunk_ops"] <= 4, v  # a store, then power loss, is all it takes
    cfg, ops, plant, doc = load_reproducer(v["reproducer"])
    assert plant.name == "skip-dir-fsync" and doc["replay"] == v["replay"]
    assert any(op["op"] == "power" or op.get("crash", {}).get("power") for op in ops), ops
    assert main(["fuzz", "--replay", v["reproducer"], "--quiet"]) == 1
    again, _ = replay_in_tmp(ops, cfg, plant)
    assert again is not None and again.kind == v["kind"]
    # The same ops against the real engine: clean.
    clean, n = replay_in_tmp(ops, cfg, None)
    assert clean is None and n == len(ops)
