"""A store's shards written beside its intent's log sync (``store.written_beside_intent``):
each rank writes and fsyncs its temporary while the sync runs, and renames it into place
only once the intent is durable, so no shard is ever named on disk without a durable
intent, and what a returned success promises is unchanged.

A child (``tests/overlap_workload.py``) is SIGKILLed while the intent's sync is held
after every rank's temporary was fsynced, with and without a power loss (the catalog's
log back to before the intent, the rank directories as written). After each, the rank
directories hold no named shard, recovery sweeps the temporaries (only they are its
orphans) and the audit is clean. The plant ``rename-before-intent`` (renamed before the
gate) leaves named shards that no durable record knows, and the check says so. An EIO
on the intent's sync fails the store with CatalogIOError, as before the overlap, and
renames nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import store_tokens
from group_workload import CAP
from overlap_workload import LAYOUT, IntentPoint, the_store
from test_crash_group import lose_power

import prefixstore
from prefixstore.base.errors import CatalogIOError
from prefixstore.engine import staging
from prefixstore.engine.api import Engine
from prefixstore.gpu.ranks import SHARD_SUFFIX, TMP_SUFFIX, rank_dir_name

TESTS = os.path.dirname(os.path.abspath(__file__))

POINTS = ["intent-sync", "intent-sync", "intent-sync:rename-before-intent"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> list[dict]:
    """One killed run per entry of ``POINTS``."""
    base = str(tmp_path_factory.mktemp("overlap"))
    here = os.path.dirname(os.path.dirname(prefixstore.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "overlap_workload.py"), base, *POINTS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert len(runs) == len(POINTS)
    return runs


def entries(root: str) -> dict[int, list[str]]:
    return {r: sorted(os.listdir(os.path.join(root, rank_dir_name(r)))) for r in range(LAYOUT.ranks)}


def what_is_wrong(root: str) -> list[str]:
    """A named shard in a rank directory (the intent is not durable), then what recovery
    and the audit say: an orphan it removed that is not a temporary, a finding, a file left."""
    wrong = [f"rank{r}/{e} named before its intent was durable"
             for r, es in entries(root).items() for e in es if e.endswith(SHARD_SUFFIX)]
    with Engine.open(root, LAYOUT, CAP) as eng:
        rep = eng.audit()
        if not rep.ok:
            wrong.append(f"audit: {rep.to_dict()}")
        wrong += [f"recovery removed {e}, not a temporary" for e in eng.recovery_report.orphans_removed
                  if not e.endswith(TMP_SUFFIX)]
        if eng.index.by_key:
            wrong.append(f"nodes after recovery: {len(eng.index.by_key)}")
    left = [e for es in entries(root).values() for e in es if e.endswith((SHARD_SUFFIX, TMP_SUFFIX))]
    return wrong + [f"left after recovery: {left}"] * bool(left)


@pytest.mark.parametrize(("n", "power"), [(0, True), (1, False)])
def test_a_kill_while_the_intent_syncs_beside_the_writes_leaves_no_named_shard(killed, n, power):
    run = killed[n]
    assert run["last"] == "paused" and run["acked"] == [], run  # killed at its point
    temps = [e for es in entries(run["root"]).values() for e in es if e.endswith(TMP_SUFFIX)]
    assert len(temps) == LAYOUT.ranks  # the writes did run beside the held sync
    if power:
        lose_power(run["root"])
    assert what_is_wrong(run["root"]) == []


def test_a_shard_renamed_before_its_intent_is_durable_is_caught(killed):
    run = killed[2]
    assert run["plant"] == "rename-before-intent" and run["last"] == "paused", run
    lose_power(run["root"])
    assert any("named before its intent was durable" in w for w in what_is_wrong(run["root"]))


def test_an_eio_on_the_intent_sync_fails_the_store_and_renames_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "GATED_MIN_BYTES", 0)
    root = str(tmp_path / "cache")
    hook = IntentPoint(root, "intent-sync", fail=True)
    with Engine.open(root, LAYOUT, CAP, hook=hook) as eng:
        hook.armed = True
        with pytest.raises(CatalogIOError, match="injected EIO"):
            store_tokens(eng, the_store())
        assert hook.temps == LAYOUT.ranks and hook.renames == 0
        assert entries(root) == {r: [] for r in range(LAYOUT.ranks)}  # each rank removed its temporary
        assert not [t for t in threading.enumerate() if t.name == "prefixstore-beside"]
    hook.armed = False
    assert what_is_wrong(root) == []
