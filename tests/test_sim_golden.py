"""The simulator's results, every field, for each policy on a slice of the Mooncake trace,
against values recorded by an earlier implementation (``tests/sim_golden.json``).

A change to an eviction policy or to the simulator that moves any result shows here.
Regenerate the fixture only for an intended change: ``python3 tests/test_sim_golden.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from prefixstore.replay.sim import PrefixStorePolicy, SimResult, compile_trace, simulate
from prefixstore.replay.trace import load_trace

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "sim_golden.json"
TRACE = HERE.parents[1] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
REQUESTS = 2000
BLOCK_BYTES = 1 << 20
FRACTIONS = (0.01, 0.05, 0.10, 0.25)
SMALL_BLOCKS = (16, 64)  # below the longest request: exercises the no-room path
RUNS = {
    "leaf-lru": "leaf-lru",
    "lru": "lru",
    "prefixstore": "prefixstore",
    "prefixstore-window4": lambda: PrefixStorePolicy(admit_window=4),
    "prefixstore-theta0-gate1": lambda: PrefixStorePolicy(theta=0.0, gate_alpha=1.0),
}


def record(r: SimResult) -> dict[str, object]:
    """Every field of ``r``, floats exactly (hex), the per-request hits as a digest."""
    d = dataclasses.asdict(r)
    d["prefill_s_total"] = r.prefill_s_total.hex()
    d["prefill_s_saved"] = r.prefill_s_saved.hex()
    d["hits"] = hashlib.sha256(",".join(map(str, r.hits)).encode()).hexdigest()
    return d


def results() -> dict[str, dict[str, object]]:
    ct = compile_trace(load_trace(TRACE)[:REQUESTS])
    caps = [int(ct.unique_bytes(BLOCK_BYTES) * f) for f in FRACTIONS]
    caps += [b * BLOCK_BYTES for b in SMALL_BLOCKS]
    out: dict[str, dict[str, object]] = {}
    for label, policy in RUNS.items():
        for cap in caps:
            chosen = policy if isinstance(policy, str) else policy()
            out[f"{label}@{cap // BLOCK_BYTES}"] = record(
                simulate(ct, cap, chosen, block_bytes=BLOCK_BYTES)
            )
    return out


def test_simulator_results_match_the_recorded_ones() -> None:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE} (expected shared/ beside the repo)")
    want = json.loads(FIXTURE.read_text())
    got = results()
    assert sorted(got) == sorted(want)
    for run in want:
        assert got[run] == want[run], run
    # the slice exercises evictions, admission refusals and no-room skips
    assert all(got[r]["evicted"] > 0 for r in got)
    assert any(got[r]["skipped_admission"] > 0 for r in got)
    assert any(got[r]["skipped_no_room"] > 0 for r in got)


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(results(), indent=1, sort_keys=True) + "\n")
