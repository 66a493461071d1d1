"""A new eviction policy is one entry in ``statemachine/policy.py``'s ``REGISTRY``:
registered here, inside the test, it is drawn by the fuzzer (campaign and
Hypothesis machine) and run by its engines, replayed and simulated by
``prefixstore replay --compare`` (and ``--policy``), and run by the simulator's
``POLICIES`` and ``evaluate``, none of which holds a list of names of its own."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import find

from prefixstore.cli import main
from prefixstore.fuzz import campaign, stateful
from prefixstore.replay import sim
from prefixstore.replay.sim import compile_trace, evaluate, simulate
from prefixstore.statemachine import policy as pol

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


class NewestLeafFirst:
    """The test's policy: the most recently used leaf goes first (no built-in does)."""

    name = "mru-leaf"
    uses_retention = False

    def __init__(self) -> None:
        self.asked = 0

    def retires(self, layout_has_snapshot: bool) -> bool:
        return False

    def action(self, node, layout_has_snapshot, retention):  # type: ignore[no-untyped-def]
        self.asked += 1
        return (pol.EVICT, (pol.NORMAL, -node.last_used)) if node.is_leaf else None


@pytest.fixture
def mru(monkeypatch: pytest.MonkeyPatch) -> NewestLeafFirst:
    p = NewestLeafFirst()
    monkeypatch.setitem(pol.REGISTRY, p.name, p)
    return p


def _first_run_policy(seed: int) -> str:
    """The policy the first run of campaign ``seed`` draws (as ``run_campaign`` does)."""
    return campaign.draw_config(random.Random(f"campaign/{seed}").getrandbits(32)).policy


def test_the_fuzzer_draws_and_runs_a_registered_policy(mru: NewestLeafFirst) -> None:
    assert campaign.policy_weights() == {"prefixstore": 6, "leaf-lru": 2, "lru": 2, "mru-leaf": 2}
    assert find(stateful.policies(), lambda p: p == mru.name) == mru.name
    seed = next(s for s in range(100) if _first_run_policy(s) == mru.name)
    res = campaign.run_campaign(seed, steps=60, shrink_s=0)
    assert res.runs == 1 and [k.split()[-1] for k in res.configs] == [mru.name]
    assert res.violations == []
    assert mru.asked > 0  # the run's engine ordered its victims by it


def test_the_simulator_runs_a_registered_policy(mru: NewestLeafFirst) -> None:
    assert list(sim.POLICIES) == ["prefixstore", "leaf-lru", "lru", "mru-leaf"]
    host = sim.POLICIES[mru.name]()
    assert host.name == mru.name
    trace = compile_trace([[1], [2], [3], [1], [2]])
    rows = evaluate(trace, (0.7,), block_bytes=1)  # capacity: 2 of the 3 blocks
    assert [r.policy for _, r in rows] == [*pol.registered(), "optimal"]
    by = {r.policy: r for _, r in rows}
    assert by[mru.name].hits == (0, 0, 0, 1, 0) == simulate(trace, 2, host, block_bytes=1).hits
    assert by["leaf-lru"].hits == (0, 0, 0, 0, 0)  # the oldest leaf goes: [1] is gone by r3


def test_replay_compare_and_policy_run_a_registered_policy(mru: NewestLeafFirst, capsys) -> None:
    assert TRACE.exists(), f"the Mooncake trace is expected at {TRACE} (shared/ beside the repo)"
    code = main(["replay", str(TRACE), "--limit", "150", "--compare", "--json", "--quiet", "--capacity", "10%"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"prefixstore", "leaf-lru", "lru", mru.name, "optimal"}
    r = out[mru.name]
    assert r["policy"] == mru.name and r["engine"] and r["audit_ok"]
    assert r["sim_hit_ratio_blocks"] > 0 and r["hit_ratio_blocks"] <= out["optimal"]["hit_ratio_blocks"]
    assert mru.asked > 0  # the engine's victim heap and the simulator asked it
    assert r["hit_ratio_blocks"] != out["leaf-lru"]["hit_ratio_blocks"]  # its own order, not leaf-lru's
    assert r["sim_hit_ratio_blocks"] != out["leaf-lru"]["sim_hit_ratio_blocks"]
    assert main(["replay", str(TRACE), "--limit", "40", "--policy", mru.name, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == mru.name
